"""Pretrain a small Llama-style model on Moby-Dick (or your text): on a CPU, or on many GPUs under torchrun.

    python ch04-pretraining/pretrain.py                        # the default run: 4 to 10 minutes on 2 CPU cores
    python ch04-pretraining/pretrain.py --max-steps 20         # a quick check of the whole pipeline
    python ch04-pretraining/pretrain.py --resume               # continue runs/pretrain from its last checkpoint
    torchrun --nproc_per_node=8 ch04-pretraining/pretrain.py --data tokens/ --tokenizer gpt2 --preset llama-small

Under torchrun, --parallel fsdp gives each process a shard of the model, --parallel tp a slice of every
block's heads and MLP, --parallel fsdp+tp --tp N both (llmscratch.parallel).
The run folder (--out-dir) receives checkpoint.pt (to resume; a checkpoint/ folder with --parallel
fsdp, tp or fsdp+tp), model.safetensors (weights, config and tokenizer, for finetuning), tokenizer.json,
metrics.jsonl, loss.png, summary.json and sample.txt.
"""

import argparse
import contextlib
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from llmscratch import distributed
from llmscratch.assets import MOBY_DICK_PATH
from llmscratch.atomic import remove_stale_temporaries, write_text_atomically
from llmscratch.checkpoint import load_checkpoint, tokenizer_from_checkpoint
from llmscratch.cli import HelpFormatter, add_flags, build_config, finite_float, refuse
from llmscratch.data import load_token_meta, load_token_split, read_text_file, split_text
from llmscratch.device import DTYPES, choose_dtype, resolve_device
from llmscratch.interrupt import exit_status, stop_on_signals
from llmscratch.parallel import mesh_shape
from llmscratch.model import GPT, PRESETS, GPTConfig
from llmscratch.runfolder import FolderInUse, claim, folder_problem, present
from llmscratch.runlog import METRICS_FILE, PLOT_FILE, SAMPLE_FILE, SUMMARY_FILE
from llmscratch.tokenizer import ENDOFTEXT, BPETokenizer
from llmscratch.sharded_checkpoint import read_meta, sharded_checkpoint_path
from llmscratch.train import (CHECKPOINT_FILE, SHARDED_CHECKPOINT_DIR, TrainConfig, Trainer, TrainingDiverged,
                              TrainingStopped)

RUN_FILE = "run.json"  # the flags of the run, so that --resume needs no others
TOKENIZER_FILE = "tokenizer.json"
MODEL_FILE = "model.safetensors"
# What a run leaves in its folder: any of them means the folder holds a run (finished or not).
RUN_OUTPUTS = (CHECKPOINT_FILE, SHARDED_CHECKPOINT_DIR, MODEL_FILE, RUN_FILE, TOKENIZER_FILE, METRICS_FILE,
               SUMMARY_FILE, SAMPLE_FILE, PLOT_FILE)
# The default run: what the flags of TrainConfig's fields start from (--min-lr's default follows --lr).
DEFAULTS = TrainConfig(max_steps=800, batch_size=8, lr=2e-3, warmup_steps=50, eval_interval=100, eval_tokens=16384,
                       checkpoint_interval=100, sample_interval=200)


def build_parser() -> argparse.ArgumentParser:
    """The flags: TrainConfig's fields (help and checks from llmscratch.config), then the script's own."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                formatter_class=HelpFormatter)
    d = p.add_argument_group("data")
    d.add_argument("--data", type=Path, nargs="+", default=[MOBY_DICK_PATH], metavar="PATH",
                   help="UTF-8 text file(s), or one folder of token files made by llmscratch.data."
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
                   help="model shape from llmscratch.model.PRESETS; the vocabulary size comes from the "
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


def read_run_flags(out_dir: Path) -> dict:
    """The flags of the run in ``out_dir``, with its own tokenizer; {"error": message} if there is no run.

    run.json holds them; the checkpoint holds a copy, used when run.json is lost or damaged. The
    tokenizer is the run's tokenizer.json, or the one in the checkpoint if that file is gone.
    """
    checkpoint, run_file = run_checkpoint(out_dir), out_dir / RUN_FILE
    if checkpoint is None:
        left = present(out_dir, RUN_OUTPUTS)
        return {"error": f"--resume: {out_dir} holds no checkpoint to resume from (it needs {CHECKPOINT_FILE} or "
                         f"{SHARDED_CHECKPOINT_DIR}/, and {RUN_FILE}, written by this script)"
                         + (f"; it holds {', '.join(left)} of a run whose checkpoint is gone: --overwrite starts "
                            f"a new run there" if left else "")}
    try:
        flags = json.loads(run_file.read_text(encoding="utf-8"))
        problem = None if isinstance(flags, dict) and "data" in flags else "does not hold a run's flags"
    except FileNotFoundError:
        problem = "is missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        problem = f"is unreadable ({err})"
    if problem is not None:
        try:
            saved = read_meta(checkpoint) if checkpoint.is_dir() else load_checkpoint(checkpoint)
            flags = saved.get("run", {}).get("flags")
        except ValueError as err:
            return {"error": f"--resume: {run_file} {problem}, and {err}"}
        if not isinstance(flags, dict) or "data" not in flags:
            return {"error": f"--resume: {run_file} {problem}, and {checkpoint} holds no copy of the run's flags"}
        print(f"note: {run_file} {problem}; resuming with the flags saved in {checkpoint}", file=sys.stderr)
    own = out_dir / TOKENIZER_FILE
    return {**flags, "tokenizer": str(own if own.is_file() else checkpoint)}


def run_checkpoint(out_dir: Path) -> Path | None:
    """The run's checkpoint: checkpoint.pt, or the checkpoint/ folder of a sharded (--parallel fsdp, tp,
    fsdp+tp) run (None: neither)."""
    if (out_dir / CHECKPOINT_FILE).exists():
        return out_dir / CHECKPOINT_FILE
    return sharded_checkpoint_path(out_dir / SHARDED_CHECKPOINT_DIR)  # or its .old copy after a crash


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


def run_folder_problem(args) -> str | None:
    """Why this run may not start in --out-dir as it is now (checked while holding it), or None."""
    found = present(args.out_dir, RUN_OUTPUTS)
    if found and not (args.resume or args.overwrite):
        return (f"--out-dir {args.out_dir} already holds a run ({', '.join(found)}); pass --resume to continue it, "
                f"--overwrite to start again, or choose another --out-dir")
    return None


@contextlib.contextmanager
def hold_run_folder(args, dist: distributed.DistInfo):
    """Rank 0 holds --out-dir for the whole run (llmscratch.runfolder.claim); ValueError on every process if it
    cannot, or if the folder holds a run that these flags may not touch."""
    with contextlib.ExitStack() as stack:
        problem = None
        if dist.is_main:  # multi-node: only rank 0 needs the run folder
            try:
                stack.enter_context(claim(args.out_dir))
                problem = run_folder_problem(args)
            except FolderInUse as err:
                problem = f"--out-dir {err}"
        problem = distributed.broadcast_object(problem)
        if problem is not None:
            raise ValueError(problem)
        yield


# --------------------------------------------------------------------------- data
def build_tokenizer(spec: str, train_text: str | None) -> BPETokenizer:
    if spec == "gpt2":
        return BPETokenizer.gpt2()
    if spec.startswith("bpe:"):
        return BPETokenizer.train(train_text, int(spec[4:]), special_tokens=[ENDOFTEXT], name=spec.replace(":", "-"))
    if Path(spec).suffix in (".pt", ".safetensors") or Path(spec).is_dir():
        return tokenizer_from_checkpoint(spec)
    return BPETokenizer.load(spec)


def load_data(args, dist) -> tuple[BPETokenizer, np.ndarray, np.ndarray, str]:
    """The tokenizer, the train and validation token arrays, and a line describing them.

    Splits too short for one window are a ValueError, found before the tokenizer is trained
    when the text's bytes (at least as many as its tokens) already fall short.
    """
    context_length = model_config_for(args, vocab_size=1).context_length  # the vocabulary is not known yet
    if args.data[0].is_dir():
        folder = args.data[0]
        meta = load_token_meta(folder)
        spec = args.tokenizer
        if spec == "auto":
            if meta["tokenizer"] != "gpt2":
                raise ValueError(f"{folder} was tokenized with {meta['tokenizer']!r}: "
                                 f"pass its JSON file with --tokenizer")
            spec = "gpt2"
        tokenizer = build_tokenizer(spec, None)
        if tokenizer.vocab_size != meta["vocab_size"]:
            raise ValueError(f"--tokenizer has {tokenizer.vocab_size} tokens, but {folder} was made with "
                             f"{meta['vocab_size']}")
        check_lengths(meta["num_tokens"]["train"], meta["num_tokens"]["val"], context_length, "tokens", folder)
        train, val = load_token_split(folder, "train"), load_token_split(folder, "val")
        return tokenizer, train, val, f"{folder}: {len(train):,} train and {len(val):,} validation tokens"
    texts = [read_text_file(path, "--data") for path in args.data]
    if not any(texts):
        raise ValueError(f"--data {' '.join(map(str, args.data))}: no text (empty file{'s' * (len(texts) > 1)})")
    text = ENDOFTEXT.join(texts)  # documents separated by the end-of-text token
    train_text, val_text = split_text(text, args.val_fraction)  # by characters
    # Every token holds at least one byte: too few bytes is too few tokens, known before any encoding.
    check_lengths(len(train_text.encode("utf-8")), len(val_text.encode("utf-8")), context_length, "bytes",
                  val_fraction=args.val_fraction)
    # One tokenizer for all: rank 0 trains (or reads) it, every process gets the same JSON.
    tokenizer_json = build_tokenizer(args.tokenizer, train_text).to_json() if dist.is_main else None
    tokenizer = BPETokenizer.from_json(distributed.broadcast_object(tokenizer_json))
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    train = np.array(tokenizer.encode(train_text, allowed_special="all"), dtype=dtype)
    val = np.array(tokenizer.encode(val_text, allowed_special="all"), dtype=dtype)
    check_lengths(len(train), len(val), context_length, "tokens", val_fraction=args.val_fraction)
    n_bytes = len(text.encode("utf-8"))
    bytes_per_token = n_bytes / (len(train) + len(val))
    return tokenizer, train, val, (f"{len(args.data)} text file(s), {n_bytes:,} bytes: {len(train):,} train and "
                                   f"{len(val):,} validation tokens ({bytes_per_token:.2f} bytes/token)")


def check_lengths(n_train: int, n_val: int, context_length: int, unit: str = "tokens", folder: Path | None = None,
                  val_fraction: float | None = None) -> None:
    """ValueError, with advice that helps, when a split is shorter than one window of context_length + 1 tokens."""
    for name, count in (("training", n_train), ("validation", n_val)):
        if count < context_length + 1:
            if folder is not None:
                fix = (f"make {folder} again from more text (or another val_fraction) with "
                       f"llmscratch.data.prepare_token_files, or use a smaller --context-length")
            else:
                other = "smaller" if name == "training" else "larger"
                fix = (f"use more text, a smaller --context-length, or a {other} --val-fraction "
                       f"(now {val_fraction}) if the other split can spare it")
            raise ValueError(f"the {name} split has {count:,} {unit}, fewer than one window of context length "
                             f"+ 1 = {context_length + 1} tokens; {fix}")


def model_config_for(args, vocab_size: int) -> GPTConfig:
    """The model the flags describe, for a vocabulary of ``vocab_size`` ids."""
    overrides = {"vocab_size": vocab_size, "dropout": args.dropout, "qk_norm": args.qk_norm,
                 "zero_init_residual": args.zero_init_residual}
    if args.context_length is not None:
        overrides["context_length"] = args.context_length
    preset = GPTConfig.from_preset(args.preset)
    if args.mlp != "preset":
        overrides["mlp"] = args.mlp
        if args.d_ff is None and (args.mlp == "swiglu") != (preset.mlp == "swiglu"):
            # A gated MLP has three matrices, a plain one two: the same weights at 2/3 or 3/2 the width.
            overrides["d_ff"] = preset.hidden_dim * 3 // 2 if preset.mlp == "swiglu" else preset.hidden_dim * 2 // 3
    if args.d_ff is not None:
        overrides["d_ff"] = args.d_ff
    return GPTConfig.from_preset(args.preset, **overrides)


def train_config_for(args, device: torch.device) -> TrainConfig:
    """The TrainConfig the flags describe; --dtype auto, --min-lr's default and --time-budget settled here."""
    return build_config(TrainConfig, args, dtype=choose_dtype(device) if args.dtype == "auto" else args.dtype,
                        min_lr=args.lr / 10 if args.min_lr is None else args.min_lr,
                        max_time=None if args.time_budget is None else args.time_budget * 60)


def build_configs(args, tokenizer: BPETokenizer, device: torch.device) -> tuple[GPTConfig, TrainConfig]:
    vocab_size = -(-tokenizer.vocab_size // 64) * 64  # a multiple of 64: faster matrix multiplies on GPUs
    return model_config_for(args, vocab_size), train_config_for(args, device)


def run_flags(args) -> dict:
    """The flags to record (run.json, and a copy in the checkpoint) as plain JSON data."""
    flags = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    flags["data"] = [str(p) for p in args.data]
    flags["tokenizer"] = str(args.out_dir / TOKENIZER_FILE)  # a resumed run reuses this very tokenizer
    return json.loads(json.dumps(flags))


def remove_outputs(out_dir: Path) -> None:
    """Delete what an earlier run left in ``out_dir`` (a fresh start with --overwrite)."""
    for name in present(out_dir, RUN_OUTPUTS):
        path = out_dir / name
        if path.is_dir():
            shutil.rmtree(path)  # a sharded run's checkpoint/
        else:
            path.unlink()


def save_run_files(out_dir: Path, flags: dict, tokenizer: BPETokenizer) -> None:
    tokenizer.save(out_dir / TOKENIZER_FILE)
    write_text_atomically(out_dir / RUN_FILE, json.dumps(flags, indent=2) + "\n")


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


def train_and_export(args, dist, tokenizer, train, val, model_config, train_config, say) -> dict | int:
    """Train (or resume) and write model.safetensors; the summary, or an exit status on failure.

    The model and the Trainer (with its DDP wrapper) live only in here: they are gone when it
    returns, before the process group is left.
    """
    if dist.is_main:
        remove_stale_temporaries(args.out_dir / CHECKPOINT_FILE)  # left by a process killed mid-save
    torch.manual_seed(args.seed)  # the same initial weights on every process
    # Sharded, the others' weights come from rank 0's (llmscratch.parallel): they build theirs without memory.
    sharded = train_config.parallel != "ddp" and dist.enabled
    with torch.device("meta") if sharded and not dist.is_main else contextlib.nullcontext():
        model = GPT(model_config)
    dp, _ = mesh_shape(model_config, train_config, dist.world_size)
    say(f"model: {args.preset}, {model.num_params():,} parameters, context {model_config.context_length}, "
        f"vocabulary {model_config.vocab_size:,} | {dist.world_size} process(es) on {dist.device.type}"
        f"{f' ({train_config.parallel}: sharded)' if train_config.parallel != 'ddp' and dist.enabled else ''}, "
        f"{train_config.dtype}{', compiled' if train_config.compile else ''}, "
        f"{train_config.batch_size * train_config.grad_accum * dp * model_config.context_length:,} "
        f"tokens per step")
    flags = run_flags(args)
    trainer = Trainer(model, train_config, train, val, args.out_dir, tokenizer, dist,
                      run_info={"flags": flags if dist.is_main else None})
    checkpoint = trainer.checkpoint_path

    def record_run() -> None:  # only once a resumed checkpoint is accepted: a refused --resume changes nothing
        if dist.is_main:  # on --resume too: flags given now (a larger --max-steps) stick
            if not args.resume:  # --overwrite: nothing of the run before may be mistaken for this one's
                remove_outputs(args.out_dir)
            save_run_files(args.out_dir, flags, tokenizer)

    try:
        with stop_on_signals(trainer, say):
            summary = trainer.fit(resume=args.resume, progress=not args.no_progress, on_start=record_run)
        trainer.export(args.out_dir / "model.safetensors", DTYPES[args.export_dtype])  # every process: FSDP gathers
    except TrainingDiverged as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except ValueError as err:  # a checkpoint that does not fit this run
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # e.g. a full disk: the message says where, and what was kept
        print(f"error: {err}", file=sys.stderr)
        return 1
    except TrainingStopped as stopped:
        say(f"\ninterrupted: {checkpoint} holds step {stopped.step}; --resume --out-dir {args.out_dir} "
            f"restarts from step {stopped.step}")
        return exit_status(trainer)
    except KeyboardInterrupt:
        say(f"\ninterrupted at step {trainer.step}; {restart_from(trainer, args.out_dir)}")
        return exit_status(trainer)
    except RuntimeError as err:
        if not distributed.lost_peer(err):
            raise
        print(f"error: process {dist.rank} stops: another process of this run has died (see its own output; "
              f"{str(err).splitlines()[0][:200]}); {restart_from(trainer, args.out_dir)}", file=sys.stderr)
        return 1
    return summary


def restart_from(trainer: Trainer, out_dir: Path) -> str:
    """Where a resumed run would start, for a run that stopped without a checkpoint of its last step."""
    if trainer.saved_step is None:
        return "no checkpoint was written, so there is nothing to resume"
    return f"--resume --out-dir {out_dir} restarts from step {trainer.saved_step}, its last checkpoint"


if __name__ == "__main__":
    sys.exit(main())
