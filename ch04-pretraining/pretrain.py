"""Pretrain a small Llama-style model on Moby-Dick (or your text): on a CPU, or on many GPUs under torchrun.

    python ch04-pretraining/pretrain.py                        # the default run: 4 to 10 minutes on 2 CPU cores
    python ch04-pretraining/pretrain.py --max-steps 20         # a quick check of the whole pipeline
    python ch04-pretraining/pretrain.py --resume               # continue runs/pretrain from its last checkpoint
    torchrun --nproc_per_node=8 ch04-pretraining/pretrain.py --data tokens/ --tokenizer gpt2 --preset llama-small

Under torchrun, --parallel fsdp gives each process a shard of the model, --parallel tp a slice of every
block's heads and MLP, --parallel fsdp+tp --tp N both (llmscratch.training.parallel).
The run folder (--out-dir) receives checkpoint.pt (to resume; a checkpoint/ folder with --parallel
fsdp, tp or fsdp+tp), model.safetensors (weights, config and tokenizer, for finetuning), tokenizer.llmscratch.json
(the tokenizer in the package's own format), metrics.jsonl, loss.png, summary.json and sample.txt.
"""

import argparse
import contextlib
import sys
import time
import traceback
from pathlib import Path

from llmscratch.assets import MOBY_DICK_PATH
from llmscratch.cli import HelpFormatter, add_flags, finite_float, refuse
from llmscratch.device import DTYPES, resolve_device
from llmscratch.model.config import PRESETS
from llmscratch.runfolder import folder_problem
from llmscratch.training import distributed
from llmscratch.training.config import TrainConfig
from llmscratch.training.parallel import mesh_shape
from llmscratch.training.pretraining import (RUN_FILE, build_configs, hold_run_folder, load_data, model_config_for,
                                             read_run_flags, run_folder_problem, train_and_export, train_config_for)
from llmscratch.training.train import CHECKPOINT_FILE, SHARDED_CHECKPOINT_DIR

# The default run: what the flags of TrainConfig's fields start from (--min-lr's default follows --lr).
DEFAULTS = TrainConfig(max_steps=800, batch_size=8, lr=2e-3, warmup_steps=50, eval_interval=100, eval_tokens=16384,
                       checkpoint_interval=100, sample_interval=200)


def build_parser() -> argparse.ArgumentParser:
    """The flags: TrainConfig's fields (help and checks from llmscratch.config), then the script's own."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                formatter_class=HelpFormatter)
    d = p.add_argument_group("data")
    d.add_argument("--data", type=Path, nargs="+", default=[MOBY_DICK_PATH], metavar="PATH",
                   help="UTF-8 text file(s), or one folder of token files made by llmscratch.text.corpus."
                        "prepare_token_files (train.bin, val.bin, meta.json; for corpora too big for "
                        "memory). Default: the bundled Moby-Dick")
    d.add_argument("--val-fraction", type=finite_float, default=0.1,
                   help="text files only: the last fraction of the characters held out for validation")
    d.add_argument("--tokenizer", default="bpe:4096",
                   help="bpe:N trains a byte-level BPE of N tokens on the training split (text files only); "
                        "gpt2 is GPT-2's 50,257-token vocabulary; or the path of a tokenizer JSON saved "
                        "by BPETokenizer.save, or a checkpoint.pt, checkpoint/ or model.safetensors that holds one "
                        "(default: %(default)s: for this small model it beats "
                        "GPT-2's vocabulary in the same time, 1.99 against 2.14 bits per byte; "
                        "see benchmarks/RESULTS.md)")
    m = p.add_argument_group("model")
    m.add_argument("--preset", default="llama-mini", choices=sorted(PRESETS),
                   help="model shape from llmscratch.model.config.PRESETS; the vocabulary size comes from the "
                        "tokenizer (default: %(default)s, 5.8M parameters with 4,096 tokens)")
    m.add_argument("--context-length", type=int, default=None,
                   help="tokens per training window (default: the preset's)")
    m.add_argument("--dropout", type=finite_float, default=0.0, help="dropout probability")
    m.add_argument("--mlp", choices=["relu2", "swiglu", "gelu", "preset"], default="relu2",
                   help="the MLP: relu2 (max(0, x)^2, two matrices; 1.97 against SwiGLU's 1.99 bits per byte in "
                        "the main job, see benchmarks/RESULTS.md), swiglu, gelu, or the preset's own (default: "
                        "%(default)s). Between a gated (swiglu) and a plain MLP the hidden size is scaled by 3/2 "
                        "or 2/3, keeping the preset's weight count, unless --d-ff is given")
    m.add_argument("--d-ff", type=int, default=None, help="the MLP's hidden size (default: the preset's, or as many "
                                                          "weights as the preset's MLP, see --mlp)")
    m.add_argument("--qk-norm", action="store_true", help="RMS-normalise each head's queries and keys (QK-norm)")
    m.add_argument("--experts", type=int, default=None, metavar="N",
                   help="a mixture of N SwiGLU experts for every MLP (llmscratch.model.moe); each token goes through "
                        "--experts-per-token of them, each --d-expert wide (default: the MLP's weights shared out, "
                        "so a token meets as many weights as in the dense model)")
    m.add_argument("--experts-per-token", type=int, default=2, metavar="K", help="the router's top k (with --experts)")
    m.add_argument("--d-expert", type=int, default=None, help="hidden size of each expert (with --experts)")
    m.add_argument("--router-aux-weight", type=finite_float, default=0.01,
                   help="weight of the experts' load-balancing loss (with --experts; 1 is an even load)")
    m.add_argument("--zero-init-residual", action="store_true",
                   help="attention's output projection and the MLP's last layer start at zero")
    t = p.add_argument_group("training")
    add_flags(t, DEFAULTS, "max_steps", "batch_size", "grad_accum", "lr")
    t.add_argument("--min-lr", type=finite_float, default=None, help="where the decay ends (default: lr / 10)")
    add_flags(t, DEFAULTS, "warmup_steps", "schedule", "decay_fraction", "weight_decay", "grad_clip", "optimizer",
              "muon_momentum")
    t.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="auto: bfloat16 autocast on GPUs that support it, float16 (with a gradient scaler) "
                        "on older GPUs; on a CPU bfloat16 where it has AMX matrix units (about 1.5x faster "
                        "steps there), else float32")
    add_flags(t, DEFAULTS, "compile", "parallel", "tp", "activation_checkpointing")
    t.add_argument("--device", default="auto",
                   help="auto, cpu, cuda, cuda:N or mps; under torchrun each process takes cuda:LOCAL_RANK")
    add_flags(t, DEFAULTS, "seed")
    t.add_argument("--time-budget", type=finite_float, default=None, metavar="MINUTES",
                   help="stop after this much training time (final evaluation and checkpoint included "
                        "in the run, not in the budget); the step count stays the schedule's length")
    r = p.add_argument_group("run folder, logging and checkpoints")
    r.add_argument("--out-dir", type=Path, default=Path("runs/pretrain"), help="run folder")
    r.add_argument("--resume", action="store_true",
                   help="continue the run in --out-dir from its checkpoint, with its flags and tokenizer (flags "
                        "given now override them, e.g. a larger --max-steps); Ctrl-C or SIGTERM stops a run "
                        "after the step under way with a checkpoint of it")
    r.add_argument("--overwrite", action="store_true", help="start afresh in an --out-dir that holds a run")
    add_flags(r, DEFAULTS, "eval_interval", "eval_tokens", "final_eval_tokens", "checkpoint_interval",
              "sample_interval", "sample_prompt", "log_interval", "peak_tflops")
    r.add_argument("--export-dtype", default="float32", choices=sorted(DTYPES),
                   help="precision of the weights in model.safetensors; bfloat16 halves the file")
    r.add_argument("--no-progress", action="store_true", help="no progress bar (e.g. for log files)")
    return p


def parse_args(argv: list[str] | None, dist: distributed.DistInfo | None = None) -> argparse.Namespace:
    """Parse and check the flags; with --resume the run's saved flags are the defaults."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.resume:
        saved = None
        if dist is None or dist.is_main:  # multi-node: only rank 0 needs the run folder
            saved = read_run_flags(args.out_dir)
        saved = distributed.broadcast_object(saved)
        if "error" in saved:
            parser.error(saved["error"])
        defaults = {k: v for k, v in saved.items() if k not in ("resume", "overwrite", "out_dir")}
        defaults.setdefault("mlp", "preset")  # a run from before --mlp had the preset's MLP
        defaults["data"] = [Path(path) for path in saved["data"]]
        parser.set_defaults(**defaults)
        args = parser.parse_args(argv)
        missing = [path for path in args.data if not path.exists()]
        if missing and args.data == defaults["data"]:  # not a flag given now: say where it came from
            parser.error(f"--resume: the run's --data {missing[0]} (as {RUN_FILE} recorded it) no longer exists; "
                         f"pass --data with its new place")
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error (a message and exit status 2) for any flag that cannot work, before any work starts."""
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        parser.error(f"--device: {err}")
    if not 0 < args.val_fraction < 1:
        parser.error(f"--val-fraction must be between 0 and 1, got {args.val_fraction}")
    if args.context_length is not None and args.context_length < 2:
        parser.error(f"--context-length must be at least 2, got {args.context_length}")
    if args.time_budget is not None and not args.time_budget > 0:
        parser.error(f"--time-budget must be positive, got {args.time_budget}")
    try:
        train_config_for(args, device)  # TrainConfig's own checks, each named by its flag
    except ValueError as err:
        refuse(parser, err)
    try:  # e.g. --dropout 1: found now, not after the tokenizer is trained (which sets the vocabulary)
        context_length = model_config_for(args, vocab_size=1).context_length
    except ValueError as err:
        parser.error(f"--preset {args.preset} with these flags: {err}")
    for name in ("eval_tokens", "final_eval_tokens"):
        value = getattr(args, name)
        if value is not None and value < context_length + 1:
            parser.error(f"--{name.replace('_', '-')} {value} is less than one evaluation window "
                         f"(context length + 1 = {context_length + 1} tokens)")
    folders = [path for path in args.data if path.is_dir()]
    for path in args.data:
        if not path.exists():
            parser.error(f"--data {path}: no such file or folder")
    if folders and len(args.data) > 1:
        parser.error(f"--data takes text files, or one token folder alone; got {len(args.data)} paths")
    if folders and args.tokenizer.startswith("bpe:"):
        args.tokenizer = "auto"  # a token folder fixes its tokenizer; resolved from its meta.json
    if args.tokenizer.startswith("bpe:"):
        size = args.tokenizer[4:]
        if not size.isdigit() or int(size) < 257:
            parser.error(f"--tokenizer {args.tokenizer}: expected bpe:N with N >= 257 (256 bytes + <|endoftext|>)")
    elif args.tokenizer not in ("gpt2", "auto") and not Path(args.tokenizer).exists():
        parser.error(f"--tokenizer {args.tokenizer}: not bpe:N, gpt2, or an existing tokenizer JSON file")
    if problem := folder_problem(args.out_dir):
        parser.error(f"--out-dir {args.out_dir}: {problem}")
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --out-dir, --overwrite starts it again: give one of them")
    if problem := run_folder_problem(args):  # checked again once the folder is held (another run may finish)
        parser.error(problem)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    first = build_parser().parse_args(argv)  # --help and syntax errors before touching any device
    try:
        dist = distributed.setup(first.device)
    except ValueError as err:
        build_parser().error(f"--device: {err}")
    try:
        return run(argv, dist, start)
    except BaseException as err:
        # A traceback keeps its frames' locals (the Trainer and its DDP wrapper) alive; they must go
        # before the process group does, or freeing them at exit can hang (see distributed.teardown).
        traceback.clear_frames(err.__traceback__)
        if isinstance(err, KeyboardInterrupt):  # Ctrl-C outside training (loading the data, or once it stopped)
            print("\ninterrupted", file=sys.stderr)
            return 130
        raise
    finally:
        distributed.teardown()


def run(argv: list[str] | None, dist: distributed.DistInfo, start: float) -> int:
    """The whole run but joining and leaving the process group; returns the exit status."""
    args = parse_args(argv, dist)
    say = print if dist.is_main else (lambda *a, **k: None)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(hold_run_folder(args, dist))  # no other run may write here while this one does
            tokenizer, train, val, described = load_data(args, dist)
            model_config, train_config = build_configs(args, tokenizer, dist.device)
            mesh_shape(model_config, train_config, dist.world_size)  # a mesh that does not fit the model: refused
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        say(f"data: {described}")
        result = train_and_export(args, dist, tokenizer, train, val, model_config, train_config, say)
    if isinstance(result, int):
        return result
    minutes, seconds = divmod(time.perf_counter() - start, 60)
    say(f"done in {int(minutes)}m{seconds:02.0f}s: {result['steps']} steps, "
        f"{result['tokens_seen'] / 1e6:.2f}M tokens "
        f"| val loss {result['val_loss']:.3f} nats/token, perplexity {result['val_perplexity']:.1f}, "
        f"{result['val_bits_per_byte']:.3f} bits per byte | {args.out_dir}/: "
        f"{SHARDED_CHECKPOINT_DIR + '/' if args.parallel != 'ddp' else CHECKPOINT_FILE}, model.safetensors, "
        f"loss.png, metrics.jsonl, summary.json, sample.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
