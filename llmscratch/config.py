"""Config fields that check themselves: the machinery every config of the package is built with.

A field is declared with ``setting``: its default, the help of its command-line flag and its check,
written once. A config calls ``check_fields`` when it is made (a ``ConfigError`` naming the field),
and ``llmscratch.cli`` turns the same fields into the scripts' flags. The configs themselves live
with their stage: ``GPTConfig`` (``llmscratch.model.config``), ``TrainConfig`` (``llmscratch.training.config``),
``FinetuneConfig`` and ``LoRAConfig`` (``llmscratch.finetuning.config``), ``DPOConfig`` and ``GRPOConfig``
(``llmscratch.alignment.config``).
"""

import math
import numbers
import types
from collections.abc import Callable, Sequence
from dataclasses import field, fields
from typing import Any

__all__ = ["Check", "ConfigError", "check_fields", "setting"]

Check = Callable[[Any], str | None]  # the problem with a value ("must be ..."), or None when it is fine


class ConfigError(ValueError):
    """A value a config refuses: which field, what it must be, and what it got."""

    def __init__(self, name: str, problem: str, value: Any):
        super().__init__(f"{name} {problem}, got {value!r}")
        self.name, self.problem, self.value = name, problem, value


def setting(default: Any, help: str, check: Check | None = None, choices: Sequence | None = None):
    """A config field: its default, the help of its flag, and its check (or the values it may take)."""
    return field(default=default, metadata={"help": help, "check": check, "choices": choices})


def positive_int(value) -> str | None:
    return None if value >= 1 else "must be a positive integer"


def positive(value) -> str | None:
    return None if value > 0 else "must be positive"


def non_negative(value) -> str | None:
    return None if value >= 0 else "must be >= 0"


def fraction(value) -> str | None:
    return None if 0 <= value <= 1 else "must be in [0, 1]"


def below_one(value) -> str | None:
    return None if 0 <= value < 1 else "must be in [0, 1)"


def check_fields(config) -> None:
    """ConfigError for the first field its declaration refuses; None passes where the type allows it."""
    for f in fields(config):
        value = getattr(config, f.name)
        if "help" not in f.metadata or (value is None and optional(f.type)):
            continue
        choices, check = f.metadata["choices"], f.metadata["check"]
        if choices is not None:
            problem = None if value in choices else f"must be one of {list(choices)}"
        else:
            problem = kind_problem(f.type, value) or (check(value) if check else None)
        if problem:
            raise ConfigError(f.name, problem, value)


def kind_problem(annotation, value) -> str | None:
    """What is wrong with the kind of value for a field declared bool, int or float (bool is no number here)."""
    kinds = types_of(annotation)
    if bool in kinds:
        return None if isinstance(value, bool) else "must be True or False"
    if int in kinds:
        return None if isinstance(value, numbers.Integral) and not isinstance(value, bool) else "must be an integer"
    if float in kinds:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            return "must be a finite number"  # inf and NaN, said plainly
    return None


def types_of(annotation) -> tuple:
    """The types an annotation names: (int, NoneType) for ``int | None``."""
    return annotation.__args__ if isinstance(annotation, types.UnionType) else (annotation,)


def optional(annotation) -> bool:
    return type(None) in types_of(annotation)
