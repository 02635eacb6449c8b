"""A pretraining run from its flags: the run folder (what it holds, who holds it, how to resume), the data
(text files or a token folder, split, the tokenizer trained once for all processes), the configs, and the
training itself (``train_and_export``: resume, Ctrl-C, a lost process, the final export).

``ch04-pretraining/pretrain.py`` parses and checks the flags, then calls these; they take its parsed
flags (``args``), so that a notebook or a test makes the same run from the same flags.
"""

import contextlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from llmscratch.cli import build_config
from llmscratch.device import DTYPES, choose_dtype
from llmscratch.files import JSON_ERRORS, remove_stale_temporaries, write_text_atomically
from llmscratch.interrupt import TrainingDiverged, exit_status, stop_on_signals
from llmscratch.model.checkpoint import load_checkpoint, tokenizer_from_checkpoint
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.runfolder import FolderInUse, claim, present
from llmscratch.text.corpus import load_token_meta, load_token_split, read_text_file
from llmscratch.text.data import split_text
from llmscratch.text.hf_tokenizer import load_tokenizer, tokenizer_from_json
from llmscratch.text.tokenizer import ENDOFTEXT, BPETokenizer
from llmscratch.training import distributed
from llmscratch.training.config import TrainConfig
from llmscratch.training.parallel import mesh_shape
from llmscratch.training.resume import read_meta, sharded_checkpoint_path
from llmscratch.training.runlog import METRICS_FILE, PLOT_FILE, SAMPLE_FILE, SUMMARY_FILE
from llmscratch.training.train import CHECKPOINT_FILE, SHARDED_CHECKPOINT_DIR, Trainer, TrainingStopped

RUN_FILE = "run.json"  # the flags of the run, so that --resume needs no others
# The run's tokenizer in the package's own format, under a name of its own: a file named tokenizer.json is
# Hugging Face's format only (llmscratch.text.hf_export writes one). Runs before that wrote ours under that name.
TOKENIZER_FILE = "tokenizer.llmscratch.json"
OLD_TOKENIZER_FILE = "tokenizer.json"
MODEL_FILE = "model.safetensors"
# What a run leaves in its folder: any of them means the folder holds a run (finished or not).
RUN_OUTPUTS = (CHECKPOINT_FILE, SHARDED_CHECKPOINT_DIR, MODEL_FILE, RUN_FILE, TOKENIZER_FILE, OLD_TOKENIZER_FILE,
               METRICS_FILE, SUMMARY_FILE, SAMPLE_FILE, PLOT_FILE)


# --------------------------------------------------------------------------- the run folder
def read_run_flags(out_dir: Path) -> dict:
    """The flags of the run in ``out_dir``, with its own tokenizer; {"error": message} if there is no run.

    run.json holds them; the checkpoint holds a copy, used when run.json is lost or damaged. The
    tokenizer is the run's tokenizer file (tokenizer.llmscratch.json, or tokenizer.json in a run from before it
    had that name), or the one in the checkpoint if that file is gone.
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
    own = next((out_dir / name for name in (TOKENIZER_FILE, OLD_TOKENIZER_FILE) if (out_dir / name).is_file()),
               checkpoint)
    return {**flags, "tokenizer": str(own)}


def run_checkpoint(out_dir: Path) -> Path | None:
    """The run's checkpoint: checkpoint.pt, or the checkpoint/ folder of a sharded (--parallel fsdp, tp,
    fsdp+tp) run (None: neither)."""
    if (out_dir / CHECKPOINT_FILE).exists():
        return out_dir / CHECKPOINT_FILE
    return sharded_checkpoint_path(out_dir / SHARDED_CHECKPOINT_DIR)  # or its .old copy after a crash


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
    if Path(spec).is_dir():  # a sharded checkpoint/ folder
        if (text := read_meta(spec).get("tokenizer")) is None:
            raise ValueError(f"{spec} was saved without a tokenizer")
        return tokenizer_from_json(text, source=f"the tokenizer in {spec}")
    if Path(spec).suffix in (".pt", ".safetensors"):
        return tokenizer_from_checkpoint(spec)
    return load_tokenizer(spec)


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
    tokenizer = tokenizer_from_json(distributed.broadcast_object(tokenizer_json))
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
                       f"llmscratch.text.corpus.prepare_token_files, or use a smaller --context-length")
            else:
                other = "smaller" if name == "training" else "larger"
                fix = (f"use more text, a smaller --context-length, or a {other} --val-fraction "
                       f"(now {val_fraction}) if the other split can spare it")
            raise ValueError(f"the {name} split has {count:,} {unit}, fewer than one window of context length "
                             f"+ 1 = {context_length + 1} tokens; {fix}")


# --------------------------------------------------------------------------- configs
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
    if getattr(args, "experts", None) is not None:  # (a run folder from before --experts has none)
        # SwiGLU experts; by default k of them hold the weights of the dense MLP (a gated MLP of 2/3 a plain one's width)
        dense = GPTConfig.from_preset(args.preset, **overrides)
        gated_width = dense.hidden_dim if dense.mlp == "swiglu" else dense.hidden_dim * 2 // 3
        overrides.update(mlp="swiglu", n_experts=args.experts, experts_per_token=args.experts_per_token,
                         d_expert=args.d_expert or max(1, gated_width // args.experts_per_token),
                         router_aux_weight=args.router_aux_weight)
    return GPTConfig.from_preset(args.preset, **overrides)


def train_config_for(args, device: torch.device) -> TrainConfig:
    """The TrainConfig the flags describe; --dtype auto, --min-lr's default and --time-budget settled here."""
    return build_config(TrainConfig, args, dtype=choose_dtype(device) if args.dtype == "auto" else args.dtype,
                        min_lr=args.lr / 10 if args.min_lr is None else args.min_lr,
                        max_time=None if args.time_budget is None else args.time_budget * 60)


def build_configs(args, tokenizer: BPETokenizer, device: torch.device) -> tuple[GPTConfig, TrainConfig]:
    vocab_size = -(-tokenizer.vocab_size // 64) * 64  # a multiple of 64: faster matrix multiplies on GPUs
    return model_config_for(args, vocab_size), train_config_for(args, device)


# --------------------------------------------------------------------------- training
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
    """The run's tokenizer and flags; an older run resumed here has its tokenizer.json (ours) renamed."""
    tokenizer.save(out_dir / TOKENIZER_FILE)
    write_text_atomically(out_dir / RUN_FILE, json.dumps(flags, indent=2) + "\n")
    if _holds_our_tokenizer(out_dir / OLD_TOKENIZER_FILE):  # not a Hugging Face one exported into the folder
        (out_dir / OLD_TOKENIZER_FILE).unlink()


def _holds_our_tokenizer(path: Path) -> bool:
    """Whether ``path`` is a tokenizer file in the package's own format (it names its "format")."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, *JSON_ERRORS):
        return False
    return isinstance(document, dict) and "format" in document


def train_and_export(args, dist, tokenizer, train, val, model_config, train_config, say) -> dict | int:
    """Train (or resume) and write model.safetensors; the summary, or an exit status on failure.

    The model and the Trainer (with its DDP wrapper) live only in here: they are gone when it
    returns, before the process group is left.
    """
    if dist.is_main:
        remove_stale_temporaries(args.out_dir / CHECKPOINT_FILE)  # left by a process killed mid-save
    torch.manual_seed(args.seed)  # the same initial weights on every process
    # Sharded, the others' weights come from rank 0's (llmscratch.training.parallel): they build theirs without memory.
    sharded = train_config.parallel != "ddp" and dist.enabled
    with torch.device("meta") if sharded and not dist.is_main else contextlib.nullcontext():
        model = GPT(model_config)
    dp, _ = mesh_shape(model_config, train_config, dist.world_size)
    active = model.num_params(active=True)
    active = f" ({active:,} active per token)" if active != model.num_params() else ""
    say(f"model: {args.preset}, {model.num_params():,} parameters{active}, context {model_config.context_length}, "
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
