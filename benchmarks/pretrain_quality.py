"""Pretraining quality on Moby-Dick: our default run against a nanoGPT-style character-level baseline.

    python -m benchmarks.pretrain_quality baseline          # nanoGPT's CPU char recipe, rebuilt with our GPT
    python -m benchmarks.pretrain_quality cost              # step cost of pretrain.py's default vs the baseline

The baseline reimplements the shape of nanoGPT's shakespeare_char CPU recipe (4 layers, 4 heads,
128 wide, context 64, batch 12, lr 1e-3 with 100 warmup steps and cosine decay to 1e-4, AdamW
betas (0.9, 0.99), weight decay 0.1, clipping 1.0, no dropout, GPT-2-style blocks without biases)
with our own GPT class and Trainer, on the same 90/10 character split of Moby-Dick the default run
uses. Tokens are bytes (a BPE with no merges: 256 ids) instead of nanoGPT's 83 characters: the text
is 1,190,317 characters in 1,204,997 bytes, and bits per byte are compared either way.
"""

import argparse
import functools
import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import add_threads_flag, machine_description, set_threads
from llmscratch.assets import read_moby_dick
from llmscratch.data import split_text
from llmscratch.device import autocast
from llmscratch.model import GPT, GPTConfig
from llmscratch.profiling import round_robin
from llmscratch.tokenizer import BPETokenizer
from llmscratch.train import TrainConfig, Trainer

BASELINE_MODEL = dict(vocab_size=256, context_length=64, d_model=128, n_layers=4, n_heads=4, bias=False,
                      qkv_bias=False)
NANOGPT_SECONDS_PER_ITERATION = 540 / 18_000  # issue 5: nanoGPT's recipe, 18,000 iterations in 9 minutes
BASELINE_TRAIN = dict(batch_size=12, lr=1e-3, min_lr=1e-4, warmup_steps=100, beta2=0.99, weight_decay=0.1,
                      grad_clip=1.0)


def byte_data() -> tuple[BPETokenizer, np.ndarray, np.ndarray]:
    text = read_moby_dick()
    train_text, val_text = split_text(text, 0.1)  # the same character split as pretrain.py and nanoGPT's prepare.py
    tokenizer = BPETokenizer.train(train_text, 256, name="bytes")  # no merges: one token per byte
    train = np.frombuffer(train_text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    val = np.frombuffer(val_text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    return tokenizer, train, val


def baseline(steps: int) -> dict:
    """Train the char-style baseline for ``steps`` iterations; validation on the whole held-out tenth."""
    tokenizer, train, val = byte_data()
    torch.manual_seed(1337)
    model = GPT(GPTConfig(**BASELINE_MODEL))
    config = TrainConfig(max_steps=steps, eval_interval=max(1, steps // 8), eval_tokens=65_536,
                         checkpoint_interval=steps, sample_interval=steps, log_interval=50, seed=1337,
                         **BASELINE_TRAIN)
    with tempfile.TemporaryDirectory() as out_dir:
        cpu, wall = time.process_time(), time.perf_counter()
        summary = Trainer(model, config, train, val, out_dir, tokenizer).fit(progress=False)
        summary["cpu_seconds"], summary["wall_seconds"] = time.process_time() - cpu, time.perf_counter() - wall
    return summary


def script_defaults() -> argparse.Namespace:
    """The flags ``ch04-pretraining/pretrain.py`` runs with when given none."""
    path = Path(__file__).resolve().parents[1] / "ch04-pretraining" / "pretrain.py"
    spec = importlib.util.spec_from_file_location("pretrain", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser().parse_args([])


def timed_step(model: GPT, batch: int, dtype: torch.dtype, optimizer: torch.optim.Optimizer) -> tuple[float, float]:
    """Wall-clock and CPU seconds of one training step on a random batch."""
    x = torch.randint(model.config.vocab_size, (batch, model.config.context_length))
    wall, cpu = time.perf_counter(), time.process_time()
    with autocast("cpu", dtype):
        loss = model(x, targets=x)  # the trainer's loss path
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - wall, time.process_time() - cpu


def step_cost(rounds: int) -> dict:
    """Median seconds per optimizer step of the default run and of the baseline, interleaved.

    Also the default run's length in baseline iterations, and so in minutes on the machine where
    nanoGPT's recipe ran 18,000 iterations in 9 minutes (the figure of issue 5).
    """
    flags = script_defaults()
    vocab_size = int(flags.tokenizer.removeprefix("bpe:"))
    overrides = {} if flags.context_length is None else {"context_length": flags.context_length}
    default = GPTConfig.from_preset(flags.preset, vocab_size=vocab_size, **overrides)
    baseline_config = GPTConfig(**BASELINE_MODEL)
    torch.manual_seed(0)
    batch = flags.batch_size * flags.grad_accum
    setups = {"default": (GPT(default), batch, torch.float32),
              "default_bfloat16": (GPT(default), batch, torch.bfloat16),  # the same step under bf16 autocast
              "baseline": (GPT(baseline_config), BASELINE_TRAIN["batch_size"], torch.float32)}
    steps = {}
    for name, (model, batch, dtype) in setups.items():
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        steps[name] = functools.partial(timed_step, model, batch, dtype, optimizer)
    round_robin(steps, 1)  # a round to warm up
    result = {name: {"wall": statistics.median(wall for wall, _ in runs),
                     "cpu": statistics.median(cpu for _, cpu in runs)}
              for name, runs in round_robin(steps, rounds).items()}
    result["default_run"] = f"{flags.preset}, {flags.max_steps} steps of {flags.batch_size} x {default.context_length}"
    for kind in ("wall", "cpu"):
        result[f"bfloat16_over_float32_{kind}"] = result["default_bfloat16"][kind] / result["default"][kind]
        ratio = result["default"][kind] / result["baseline"][kind]
        result[f"step_ratio_{kind}"] = ratio
        result[f"default_run_in_baseline_iterations_{kind}"] = ratio * flags.max_steps
        result[f"minutes_at_nanogpt_speed_{kind}"] = ratio * flags.max_steps * NANOGPT_SECONDS_PER_ITERATION / 60
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["baseline", "cost"])
    parser.add_argument("--steps", type=int, default=2000, help="baseline iterations (nanoGPT's CPU recipe: 2000)")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds of the cost comparison")
    add_threads_flag(parser)
    args = parser.parse_args()
    set_threads(parser, args.threads)
    print(machine_description())
    result = baseline(args.steps) if args.what == "baseline" else step_cost(args.rounds)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
