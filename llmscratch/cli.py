"""Command-line flags made from the config dataclasses: a field's default, check and help are written once.

``add_flags`` gives each named field of a config its flag (``max_steps`` becomes ``--max-steps``, with the
field's type, help and choices), ``build_config`` makes the config from the parsed flags, and ``refuse``
turns a value the config refused into ``parser.error``, naming the flag. Then the run folder's flags and
checks (``llmscratch.runfolder`` behind them), and what a script's ``--model NAME`` means. The flags the
finetuning scripts share are ``llmscratch.finetuning.flags``.
"""

import argparse
import contextlib
import dataclasses
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from llmscratch.assets import PRETRAINED_PATH
from llmscratch.config import ConfigError, types_of
from llmscratch.device import resolve_device
from llmscratch.files import input_problem
from llmscratch.interrupt import TrainingDiverged
from llmscratch.runfolder import FolderInUse, claim, file_problem, folder_problem, present, same_folder

__all__ = ["HelpFormatter", "add_flags", "add_out_dir_flags", "build_config", "check_device", "check_in_files",
           "check_out_dir", "check_out_files", "finite_float", "refuse", "resolve_model", "run_folder", "run_script",
           "value_errors_exit"]

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


def add_flags(parser, defaults, *names: str, prefix: str = "") -> list[argparse.Action]:
    """A flag for each named field of the config ``defaults``, whose values are the flags' defaults; returns them.

    ``prefix`` goes before each name: "lora_" makes LoRAConfig's rank --lora-rank.
    """
    declared = {f.name: f for f in dataclasses.fields(defaults)}
    actions = []
    for name in names:
        declaration = declared[name]
        kind = next(t for t in types_of(declaration.type) if t is not type(None))  # int for int | None
        options = {"default": getattr(defaults, name), "help": declaration.metadata["help"]}
        if kind is bool:  # a default of True needs its --no- form to be turned off
            options["action"] = argparse.BooleanOptionalAction if options["default"] else "store_true"
        else:
            options.update(type=finite_float if kind is float else kind, choices=declaration.metadata["choices"])
        actions.append(parser.add_argument(flag(prefix + name), **options))
    return actions


def build_config(config_class, args: argparse.Namespace, **values):
    """``config_class`` from the flags named after its fields, and ``values``: what the script worked out itself."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return config_class(**{**{k: v for k, v in vars(args).items() if k in names}, **values})


def refuse(parser: argparse.ArgumentParser, err: ValueError):
    """parser.error (the message and exit status 2) for a value a config refused, naming its flag."""
    if isinstance(err, ConfigError):
        parser.error(f"{flag(err.name)} {err.problem}, got {err.value!r}")
    parser.error(str(err))


def check_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.device`` resolved to a torch.device on this machine (``resolve_device``), or parser.error naming it."""
    try:
        args.device = resolve_device(args.device)
    except ValueError as err:
        parser.error(f"--device: {err}")


@contextlib.contextmanager
def value_errors_exit() -> Iterator[None]:
    """A ValueError (bad data, a model file that does not load), a diverged run or a file that cannot be
    written or read ends the script: "error: ...", status 1; Ctrl-C ends it with status 130. No traceback."""
    try:
        yield
    except (ValueError, TrainingDiverged, OSError) as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)


def run_script(main: Callable[[], int | None]) -> None:
    """A script's ``if __name__ == "__main__":`` ``main()``'s return value is the exit status; Ctrl-C ends it with
    status 130 and one line, not a traceback."""
    try:
        status = main()
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        status = 130
    sys.exit(status)


# --------------------------------------------------------------------------- the run folder
def add_out_dir_flags(parser: argparse.ArgumentParser, default: Path, holds: str) -> None:
    """--out-dir (default ``default``) and --overwrite; ``holds`` says what the run folder gets."""
    parser.add_argument("--out-dir", type=Path, default=default, help=f"the run folder: {holds}")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the results of an earlier run in --out-dir (without it, such a folder is "
                             "refused)")


def check_out_dir(parser: argparse.ArgumentParser, out_dir: Path,
                  starting_model: tuple[str, Path] | None = None) -> None:
    """parser.error if --out-dir cannot be a writable folder, or is the folder of ``starting_model``
    ((flag, path): the model a run starts from, which it must not write over)."""
    if problem := folder_problem(out_dir):
        parser.error(f"--out-dir {out_dir}: {problem}")
    if starting_model is not None and same_folder(out_dir, starting_model[1]):
        flag_name, path = starting_model
        parser.error(f"--out-dir {out_dir} is the folder of {flag_name} {path}, the model this run starts from: its "
                     f"results would replace it; choose another --out-dir")


def check_in_files(parser: argparse.ArgumentParser, paths: dict[str, Path]) -> None:
    """parser.error naming the first of ``paths`` (flag -> path) that is not a file to read."""
    for flag_name, path in paths.items():
        if problem := input_problem(path):
            parser.error(f"{flag_name} {path}: {problem}")


def check_out_files(parser: argparse.ArgumentParser, paths: dict[str, Path], inputs: dict[str, Path] | None = None
                    ) -> None:
    """parser.error if no file can be written at one of ``paths`` (flag -> path; missing folders are fine: they
    are made), or if two flags name the same file: two outputs, or an output and one of the ``inputs``."""
    seen = {path.resolve(): flag_name for flag_name, path in (inputs or {}).items()}
    for flag_name, path in paths.items():
        if problem := file_problem(path):
            parser.error(f"{flag_name} {path}: {problem}")
        if (other := seen.setdefault(path.resolve(), flag_name)) != flag_name:
            what = f"the file {other} reads" if other in (inputs or {}) else f"the file {other} writes"
            parser.error(f"{other} and {flag_name} are both {path}: writing {flag_name} would replace {what}; give "
                         f"each its own path")


@contextlib.contextmanager
def run_folder(args: argparse.Namespace, outputs: Sequence[str]) -> Iterator[Path]:
    """Hold --out-dir while the run lasts (``llmscratch.runfolder.claim``); ValueError if another run holds
    it, or if it holds any of ``outputs`` (an earlier run's results) and --overwrite was not given."""
    with contextlib.ExitStack() as stack:
        try:
            folder = stack.enter_context(claim(args.out_dir))
        except FolderInUse as err:
            raise ValueError(f"--out-dir {err}") from None
        found = present(folder, outputs)
        if found and not args.overwrite:
            raise ValueError(f"--out-dir {folder} already holds the results of a run ({', '.join(found)}); pass "
                             f"--overwrite to replace them, or choose another --out-dir")
        yield folder


# --------------------------------------------------------------------------- the finetuning scripts
# name -> (default location, the command that makes it): what a script's --model NAME means
DEFAULT_MODELS = {
    "base": (PRETRAINED_PATH,
             "python ch04-pretraining/pretrain.py --export-dtype bfloat16 --dtype bfloat16 (bundled with llmscratch)"),
    "instructions": (Path("runs/instructions/model.safetensors"), "python ch05-finetuning/finetune_instructions.py"),
    "dpo": (Path("runs/preferences/model.safetensors"), "python ch06-alignment/finetune_preferences.py"),
    "dpo-style": (Path("runs/preferences-style/model.safetensors"),
                  "python ch06-alignment/finetune_preferences.py --style full-stop --sft-weight 1 "
                  "--out-dir runs/preferences-style"),
    "rl": (Path("runs/rl/model.safetensors"), "python ch06-alignment/finetune_rl.py"),
    "classifier": (Path("runs/classifier/classifier.pt"), "python ch05-finetuning/finetune_classifier.py"),
}


def resolve_model(spec: str) -> tuple[str, Path]:
    """(column name, path) of one --model value; ValueError naming it when there is no such model."""
    label, sep, value = spec.partition("=")
    if not sep or Path(spec).exists():  # a path may hold "=" itself
        label, value = "", spec
    if not value:
        raise ValueError(f"--model {spec}: no model after {label!r}= (expected LABEL=PATH, or a path or name alone)")
    if value in DEFAULT_MODELS:
        path, command = DEFAULT_MODELS[value]
        if not path.exists():
            raise ValueError(f"--model {value}: {path} does not exist; make it with: {command}")
        return label or value, path
    path = Path(value)
    if not path.exists():
        raise ValueError(f"--model {value}: no such file or folder (expected a run folder, a model file, or one of "
                         f"{', '.join(DEFAULT_MODELS)})")
    if path.is_dir() and (path / "classifier.pt").is_file():
        path = path / "classifier.pt"
    return label or (path.parent.name if path.is_file() else path.name) or str(path), path
