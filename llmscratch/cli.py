"""Command-line flags made from the config dataclasses: a field's default, check and help are written once.

``add_flags`` gives each named field of a config its flag (``max_steps`` becomes ``--max-steps``, with the
field's type, help and choices), ``build_config`` makes the config from the parsed flags, and ``refuse``
turns a value the config refused into ``parser.error``, naming the flag. The flags that the two finetuning
scripts share come last.
"""

import argparse
import contextlib
import dataclasses
import math
import sys
from collections.abc import Iterator
from pathlib import Path

from llmscratch.assets import PRETRAINED_PATH
from llmscratch.config import ConfigError, FinetuneConfig, types_of
from llmscratch.device import resolve_device
from llmscratch.lora import LoRAConfig
from llmscratch.optim import TrainingDiverged

__all__ = ["HelpFormatter", "add_finetune_flags", "add_flags", "build_config", "check_finetune_flags",
           "finetune_config", "finite_float", "refuse", "value_errors_exit"]

FLOAT32_MAX = 3.4028234663852886e38  # the weights' precision: a larger learning rate overflows in the optimizer


def finite_float(text: str) -> float:
    """argparse type: a finite number that float32 can hold."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of at most {FLOAT32_MAX:.1e} "
                                         f"(what float32 can hold)")
    return value


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description's line breaks kept; a flag's default shown, unless it has none or its help says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        said = action.nargs == 0 or action.default is None or "default" in action.help.lower()  # nargs 0: a switch
        return action.help if said else f"{action.help} (default: %(default)s)"


def flag(name: str) -> str:
    """The flag of a config field: --max-steps for max_steps."""
    return "--" + name.replace("_", "-")


def add_flags(parser, defaults, *names: str) -> None:
    """A flag for each named field of the config ``defaults``, whose values are the flags' defaults."""
    declared = {f.name: f for f in dataclasses.fields(defaults)}
    for name in names:
        declaration = declared[name]
        kind = next(t for t in types_of(declaration.type) if t is not type(None))  # int for int | None
        options = {"default": getattr(defaults, name), "help": declaration.metadata["help"]}
        if kind is bool:
            options["action"] = "store_true"
        else:
            options.update(type=finite_float if kind is float else kind, choices=declaration.metadata["choices"])
        parser.add_argument(flag(name), **options)


def build_config(config_class, args: argparse.Namespace, **values):
    """``config_class`` from the flags named after its fields, and ``values``: what the script worked out itself."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return config_class(**{**{k: v for k, v in vars(args).items() if k in names}, **values})


def refuse(parser: argparse.ArgumentParser, err: ValueError):
    """parser.error (the message and exit status 2) for a value a config refused, naming its flag."""
    if isinstance(err, ConfigError):
        parser.error(f"{flag(err.name)} {err.problem}, got {err.value!r}")
    parser.error(str(err))


@contextlib.contextmanager
def value_errors_exit() -> Iterator[None]:
    """A ValueError (bad data, a model file that does not load) or a diverged run ends the script:
    "error: ...", status 1."""
    try:
        yield
    except (ValueError, TrainingDiverged) as err:
        sys.exit(f"error: {err}")


# --------------------------------------------------------------------------- the finetuning scripts
def add_finetune_flags(parser: argparse.ArgumentParser, defaults: FinetuneConfig) -> None:
    """The flags both finetuning scripts share, with this task's defaults (each script adds its own --data,
    --out-dir and --test-mode)."""
    parser.add_argument("--base", type=Path, default=PRETRAINED_PATH,
                        help="the model to start from: a run folder of ch04-pretraining/pretrain.py (e.g. "
                             "runs/pretrain), the model.safetensors or checkpoint.pt in it, or a Hugging Face "
                             "GPT-2 folder (config.json + model.safetensors); default: the bundled model of "
                             "pretrain.py's default run")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a tokenizer JSON file to use instead of the base's own (or of GPT-2's for a "
                             "Hugging Face folder)")
    add_flags(parser, defaults, "trainable", "last_k")
    parser.add_argument("--lora", action="store_true", help="shorthand for --trainable lora")
    parser.add_argument("--lora-rank", type=int, default=defaults.lora.rank, help="rank of the LoRA matrices")
    parser.add_argument("--lora-alpha", type=finite_float, default=defaults.lora.alpha,
                        help="LoRA scale: the update is multiplied by alpha / rank")
    add_flags(parser, defaults, "epochs", "lr", "batch_size", "dtype", "seed")
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def check_finetune_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error for a shared flag that cannot work, the config's checks included; resolves --device."""
    if not args.base.exists():
        parser.error(f"--base {args.base}: no such file or folder (expected a run folder of "
                     "ch04-pretraining/pretrain.py, its model.safetensors or checkpoint.pt, or a Hugging Face "
                     "GPT-2 folder)")
    if args.tokenizer is not None and not args.tokenizer.is_file():
        parser.error(f"--tokenizer {args.tokenizer}: no such file")
    if not args.data.is_file():
        parser.error(f"--data {args.data}: no such file")
    try:
        args.device = resolve_device(args.device)
    except ValueError as err:
        parser.error(f"--device: {err}")
    try:
        finetune_config(args)  # made again by the script's run: refused here, before any work
    except ValueError as err:
        refuse(parser, err)


def finetune_config(args: argparse.Namespace) -> FinetuneConfig:
    """The FinetuneConfig the shared flags describe: --lora is trainable lora, --test-mode one epoch."""
    lora = LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha)  # args.lora is only the switch
    config = build_config(FinetuneConfig, args, lora=lora, trainable="lora" if args.lora else args.trainable)
    return dataclasses.replace(config, epochs=1) if args.test_mode else config  # a new config, checked again
