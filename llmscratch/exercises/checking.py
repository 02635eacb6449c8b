"""How an exercise is checked: run the reader's answer case by case, stop at the first wrong one, say why.

A chapter's checkers (``llmscratch.exercises.ch01`` ... ``ch06``) register each exercise with
``Chapter.exercise``. A checker calls the reader's answer through ``attempt`` and compares with
``expect_equal`` / ``expect_close``, smallest case first, so the first ``Mismatch`` raised is the
smallest failing input. ``Chapter.check`` turns the outcome into a ``Verdict`` and prints it; it
never raises, so a notebook keeps running whatever the answer does.
"""

import importlib.util
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["Chapter", "Exercise", "Mismatch", "NotDone", "Verdict", "attempt", "describe", "diagnose",
           "diagnose_nonfinite", "expect_close", "expect_equal", "load_answers"]

DIFFICULTIES = ("warm-up", "medium", "hard")
KINDS = ("write it yourself", "extend the package")


class Mismatch(Exception):
    """The smallest failing case: its input, what was expected, what came back, and the usual mistake."""

    def __init__(self, case: str, expected: Any, got: Any, hint: str):
        super().__init__(case)
        self.case, self.expected, self.got, self.hint = case, expected, got, hint

    def report(self) -> str:
        return (f"  input:    {self.case}\n  expected: {_text(self.expected)}\n  got:      {_text(self.got)}\n"
                f"  hint:     {self.hint}")


class NotDone(Exception):
    """The answer is still the stub (it raised NotImplementedError)."""


@dataclass(frozen=True)
class Exercise:
    """One exercise: the name the reader's answer goes by, where it sits in the chapter, and its checker."""

    name: str  # the function (or class) the reader defines, e.g. "causal_mask"
    title: str
    difficulty: str  # one of DIFFICULTIES
    section: str  # the notebook section it follows
    kind: str  # one of KINDS
    checker: Callable[[Any], int] = field(repr=False)  # raises Mismatch; returns the number of cases passed


@dataclass(frozen=True)
class Verdict:
    exercise: Exercise
    status: str  # "passed", "failed" or "not done yet"
    detail: str = ""

    def __str__(self) -> str:
        head = f"{self.exercise.name}: {self.status}"
        return f"{head} {self.detail}" if self.status == "passed" else f"{head}\n{self.detail}".rstrip()


class Chapter:
    """The exercises of one chapter, in the order the notebook asks them."""

    def __init__(self, name: str, title: str):
        self.name, self.title = name, title
        self.exercises: dict[str, Exercise] = {}

    def exercise(self, name: str, *, title: str, difficulty: str, section: str, kind: str):
        """Decorator: register ``checker(answer) -> cases passed`` as the check of exercise ``name``."""
        if difficulty not in DIFFICULTIES or kind not in KINDS or name in self.exercises:
            raise ValueError(f"exercise {name!r}: difficulty {difficulty!r} must be one of {DIFFICULTIES}, "
                             f"kind {kind!r} one of {KINDS}, and the name new in {self.name}")

        def register(checker: Callable[[Any], int]) -> Callable[[Any], int]:
            self.exercises[name] = Exercise(name, title, difficulty, section, kind, checker)
            return checker

        return register

    def check(self, answer: Any, name: str | None = None, *, quiet: bool = False) -> Verdict:
        """Check the reader's ``answer`` (found by its ``__name__`` unless ``name`` is given); print the verdict."""
        name = name or getattr(answer, "__name__", None)
        if name not in self.exercises:
            raise KeyError(f"{self.name} has no exercise named {name!r}; its exercises are {list(self.exercises)}")
        verdict = _judge(self.exercises[name], answer)
        if not quiet:
            print(verdict)
        return verdict

    def check_module(self, module: Any) -> list[Verdict]:
        """One verdict per exercise, in order: each answer is the module's attribute of the exercise's name."""
        return [_judge(ex, getattr(module, ex.name, None)) for ex in self.exercises.values()]

    def table(self, verdicts: Iterable[Verdict]) -> str:
        """The verdicts as a text table, the details of the failures below it."""
        verdicts = list(verdicts)
        width = max([len("exercise")] + [len(v.exercise.name) for v in verdicts])
        lines = [f"{self.name}: {self.title}", f"{'exercise':<{width}}  {'difficulty':<10}  verdict",
                 f"{'-' * width}  {'-' * 10}  {'-' * 12}"]
        lines += [f"{v.exercise.name:<{width}}  {v.exercise.difficulty:<10}  {v.status}" for v in verdicts]
        failures = [str(v) for v in verdicts if v.status == "failed"]
        return "\n".join(lines + ([""] + failures if failures else []))


def _judge(exercise: Exercise, answer: Any) -> Verdict:
    if answer is None:
        return Verdict(exercise, "not done yet", "  (no answer of this name found)")
    try:
        with torch.random.fork_rng(devices=[]):  # the reader's notebook keeps its random stream
            passed = exercise.checker(answer)
    except NotDone:
        return Verdict(exercise, "not done yet", "  (the stub still raises NotImplementedError)")
    except Mismatch as mismatch:
        return Verdict(exercise, "failed", mismatch.report())
    except Exception as err:  # a bug in a checker must not stop the reader's notebook either
        return Verdict(exercise, "failed", f"  the check itself could not run: {type(err).__name__}: {err}")
    return Verdict(exercise, "passed", f"({passed} cases)")


def attempt(answer: Callable, *args: Any, case: str, errors: dict[str, str] | None = None, **kwargs: Any) -> Any:
    """``answer(*args, **kwargs)``; an exception it raises becomes a Mismatch naming the case.

    errors maps a text to a hint: an exception whose message holds the text gets that hint (the
    usual mistake behind, say, "size of tensor"), any other the general one.
    """
    try:
        return answer(*args, **kwargs)
    except NotImplementedError:
        raise NotDone from None
    except Exception as err:
        got = f"{type(err).__name__}: {err}"
        hint = next((hint for text, hint in (errors or {}).items() if text in got),
                    "your code raised an exception on this input (read the message above)")
        raise Mismatch(case, "a result", got, hint) from None


def expect_equal(got: Any, expected: Any, *, case: str, hint: str) -> None:
    """Mismatch unless ``got == expected`` (tensors: same shape and every element equal)."""
    if isinstance(expected, torch.Tensor):
        _expect_tensor(got, expected, case, hint, atol=0.0, rtol=0.0)
    elif got != expected:
        raise Mismatch(case, expected, got, hint)


def expect_close(got: Any, expected: Any, *, case: str, hint: str, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    """Mismatch unless ``got`` is a tensor (or float) of ``expected``'s shape, equal within atol + rtol * |expected|."""
    if isinstance(expected, torch.Tensor):
        _expect_tensor(got, expected, case, hint, atol=atol, rtol=rtol)
    elif not (isinstance(got, (int, float)) and math.isclose(got, expected, rel_tol=rtol, abs_tol=atol)):
        raise Mismatch(case, expected, got, hint)


def _expect_tensor(got: Any, expected: torch.Tensor, case: str, hint: str, atol: float, rtol: float) -> None:
    if not isinstance(got, torch.Tensor):
        raise Mismatch(case, describe(expected), f"a {type(got).__name__}, not a tensor", hint)
    if got.shape != expected.shape:
        raise Mismatch(case, f"shape {tuple(expected.shape)}", f"shape {tuple(got.shape)}",
                       f"the shape is wrong; {hint}")
    if got.is_floating_point() != expected.is_floating_point() or (got.dtype == torch.bool) != (expected.dtype == torch.bool):
        raise Mismatch(case, f"dtype {expected.dtype}", f"dtype {got.dtype}", hint)
    got_d, expected_d = got.detach().double().cpu(), expected.detach().double().cpu()
    bad = ~torch.isclose(got_d, expected_d, atol=atol, rtol=rtol, equal_nan=True)
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise Mismatch(case, describe(expected) + f", at {where}: {expected_d[where].item():.6g}",
                       describe(got) + f", at {where}: {got_d[where].item():.6g} "
                                       f"({int(bad.sum())} of {bad.numel()} elements differ)", hint)


def diagnose(got: Any, mistakes: dict[str, Callable[[], Any]], default: str, atol: float = 1e-5) -> str:
    """The hint of the first usual mistake whose result ``got`` reproduces, else ``default``."""
    for hint, wrong in mistakes.items():
        try:
            value = wrong()
            if isinstance(value, torch.Tensor):
                if (isinstance(got, torch.Tensor) and got.shape == value.shape and torch.allclose(
                        got.detach().double().cpu(), value.double().cpu(), atol=atol, equal_nan=True)):
                    return hint
            elif got == value:
                return hint
        except Exception:  # a mistake that cannot be computed for this case just does not match
            continue
    return default


def diagnose_nonfinite(got: Any, mistakes: dict[str, Callable[[], Any]], default: str, *, hint: str,
                       nan_only: bool = False) -> str:
    """``hint`` when ``got`` is a float tensor holding NaN (or inf, unless ``nan_only``), else ``diagnose``'s hint.

    A non-finite result matches no mistake by comparison, yet it has a usual cause of its own.
    """
    if isinstance(got, torch.Tensor) and got.is_floating_point() and (
            got.isnan().any() if nan_only else not got.isfinite().all()):
        return hint
    return diagnose(got, mistakes, default)


def describe(value: Any, limit: int = 8) -> str:
    """A short, readable account of a value: small tensors in full, large ones by shape and first values."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().flatten()
        head = ", ".join(f"{x:.4g}" if value.is_floating_point() else str(x) for x in flat[:limit].tolist())
        more = ", ..." if flat.numel() > limit else ""
        return f"tensor of shape {tuple(value.shape)} [{head}{more}]"
    return _text(value)


def _text(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...'"


def load_answers(path: str | Path) -> Any:
    """Import a reader's answers file as a module (its top level runs, as ``python path`` would run it)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected a Python file defining your answers)")
    spec = importlib.util.spec_from_file_location(f"answers_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
