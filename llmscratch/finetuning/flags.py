"""The command-line flags the finetuning scripts of chapters 5 and 6 share, and the model chapter 6 starts from.

Each flag comes from a ``FinetuneConfig`` or ``LoRAConfig`` field (``llmscratch.cli.add_flags``), so its
default, check and help are the config's.
"""

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

from llmscratch.assets import PRETRAINED_PATH
from llmscratch.cli import add_flags, build_config, check_device, check_in_files, check_out_dir, refuse
from llmscratch.config import ConfigError
from llmscratch.finetuning.config import FinetuneConfig, LoRAConfig

# The script that trains the model chapter 6 starts from (the repository's, beside this package).
CHAPTER_5_SCRIPT = Path(__file__).resolve().parents[2] / "ch05-finetuning" / "finetune_instructions.py"


def add_finetune_flags(parser: argparse.ArgumentParser, defaults: FinetuneConfig) -> None:
    """The flags both finetuning scripts share, with this task's defaults (each script adds its own --data,
    --out-dir (``add_out_dir_flags``) and --test-mode)."""
    parser.add_argument("--base", type=Path, default=PRETRAINED_PATH,
                        help="the model to start from: a run folder of ch04-pretraining/pretrain.py (e.g. "
                             "runs/pretrain), the model.safetensors or checkpoint.pt in it, or a Hugging Face "
                             "GPT-2 folder (config.json + model.safetensors); default: the bundled model of "
                             "pretrain.py's default run")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a tokenizer JSON file to use instead of the base's own (or of GPT-2's for a "
                             "Hugging Face folder)")
    add_lora_flags(parser, defaults, "shorthand for --trainable lora")
    add_flags(parser, defaults, "epochs", "lr", "batch_size", "dtype", "seed")
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_lora_flags(parser: argparse.ArgumentParser, defaults: FinetuneConfig, lora_help: str) -> None:
    """--trainable (or its shorthand --lora: one or the other), --last-k, --lora-rank and --lora-alpha."""
    either = parser.add_mutually_exclusive_group()  # --lora beside --trainable X: argparse refuses, naming both
    trainable, = add_flags(either, defaults, "trainable")
    # argparse counts a flag of the group as given when its value `is not` the default object; "all" typed in a
    # Python list is the very (interned) object the default is, so the default gets an equal string of its own.
    trainable.default = trainable.default.encode().decode()
    either.add_argument("--lora", action="store_true", help=lora_help)
    add_flags(parser, defaults, "last_k")
    add_flags(parser, defaults.lora, "rank", "alpha", prefix="lora_")


def check_finetune_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error for a shared flag that cannot work, the config's checks included; resolves --device."""
    if not args.base.exists():
        parser.error(f"--base {args.base}: no such file or folder (expected a run folder of "
                     "ch04-pretraining/pretrain.py, its model.safetensors or checkpoint.pt, or a Hugging Face "
                     "GPT-2 folder)")
    check_in_files(parser, {"--data": args.data} | ({} if args.tokenizer is None else {"--tokenizer": args.tokenizer}))
    check_out_dir(parser, args.out_dir, starting_model=("--base", args.base))
    check_device(parser, args)
    try:
        finetune_config(args)  # made again by the script's run: refused here, before any work
    except ValueError as err:
        refuse(parser, err)


def finetune_config(args: argparse.Namespace, config_class: type[FinetuneConfig] = FinetuneConfig) -> FinetuneConfig:
    """The FinetuneConfig (or subclass, e.g. DPOConfig) the shared flags describe: --lora is trainable lora,
    --test-mode one epoch."""
    try:
        lora = LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha)  # args.lora is only the switch
    except ConfigError as err:  # "LoRA rank must be ...": refuse() would name the field's flag --rank
        raise ValueError(f"LoRA {err}") from None
    config = build_config(config_class, args, lora=lora, trainable="lora" if args.lora else args.trainable)
    return dataclasses.replace(config, epochs=1) if args.test_mode else config  # a new config, checked again


def train_instruction_model(argv: list[str]) -> None:
    """Run ch05-finetuning/finetune_instructions.py with ``argv`` (it trains the model chapter 6 starts from)."""
    script = CHAPTER_5_SCRIPT
    status = subprocess.run([sys.executable, str(script), *argv], check=False).returncode
    if status != 0:  # its own message is printed above
        raise ValueError(f"{script.name} {' '.join(argv)} failed (exit status {status}), so there is no model to "
                         "start from")


def starting_model(model: Path, default: Path, args: argparse.Namespace, train=train_instruction_model) -> Path:
    """A chapter-6 script's --model: ``model`` if it exists; else (it is ``default``) trained first by chapter 5's
    script, in its usual folder (in --test-mode: a test-mode model in ``args.out_dir``/instructions). ``args``
    gives --out-dir, --instructions, --test-mode and --no-progress."""
    if model.exists():
        return model
    if model != default:
        raise ValueError(f"--model {model}: no such file or folder")
    folder = args.out_dir / "instructions" if args.test_mode else model.parent
    print(f"{model} does not exist: training it with ch05-finetuning/finetune_instructions.py --out-dir {folder} first")
    extra = ["--test-mode"] * args.test_mode + ["--no-progress"] * args.no_progress
    train(["--out-dir", str(folder), "--data", str(args.instructions), *extra])
    return folder / "model.safetensors"
