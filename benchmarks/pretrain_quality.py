"""Pretraining quality on Moby-Dick: our default run against a nanoGPT-style character-level baseline.

    python -m benchmarks.pretrain_quality baseline          # nanoGPT's CPU char recipe, rebuilt with our GPT
    python -m benchmarks.pretrain_quality cost              # step cost of pretrain.py's default vs the baseline
    python -m benchmarks.pretrain_quality cost --variant default --variant muon   # step cost of speedrun variants
    python -m benchmarks.pretrain_quality speedrun --variant default --variant muon --seeds 1337 1338 1339
                                                            # the speedrun log: changes against the default

The speedrun runs ``ch04-pretraining/pretrain.py`` once per variant (a named set of its flags,
``SPEEDRUN``) and seed, seeds outermost, each in its own folder under ``--out-dir`` (a finished run
is kept, so the command picks up where it stopped), then prints the table of RESULTS.md's speedrun
log: validation bits per byte at every evaluation, step-matched, as the mean over seeds and their
spread; the whole command's wall time; the time each first crossed 2.07; and where the first
variant (the reference) stood at the same wall time. ``--report`` only prints the table.

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
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import add_threads_flag, machine_description, set_threads, today
from llmscratch.assets import read_moby_dick
from llmscratch.device import autocast
from llmscratch.files import write_text_atomically
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.profiling import round_robin
from llmscratch.text.data import split_text
from llmscratch.text.tokenizer import BPETokenizer
from llmscratch.training.config import TrainConfig
from llmscratch.training.optim import configure_optimizer
from llmscratch.training.runlog import RunLog
from llmscratch.training.train import Trainer

BASELINE_MODEL = dict(vocab_size=256, context_length=64, d_model=128, n_layers=4, n_heads=4, bias=False,
                      qkv_bias=False)
NANOGPT_SECONDS_PER_ITERATION = 540 / 18_000  # issue 5: nanoGPT's recipe, 18,000 iterations in 9 minutes
PRETRAIN = Path(__file__).resolve().parents[1] / "ch04-pretraining" / "pretrain.py"
# The speedrun log (issue 18): each change a named set of pretrain.py flags. The precision and the MLP are
# pinned in each, since --dtype auto differs between CPUs and the defaults moved: "default" is the main
# job as it was before the log (float32, the preset's SwiGLU), the changes screened against it are float32
# too, and those after the switch to bfloat16 on CPUs with AMX are measured against "bfloat16".
F32, BF16 = ["--dtype", "float32", "--mlp", "preset"], ["--dtype", "bfloat16", "--mlp", "preset"]
SPEEDRUN: dict[str, list[str]] = {
    "default": F32,
    "muon": [*F32, "--optimizer", "muon"],
    "muon-lr4e-3": [*F32, "--optimizer", "muon", "--lr", "4e-3"],
    "min-lr-0": [*F32, "--min-lr", "0"],
    "min-lr-0-lr3e-3": [*F32, "--min-lr", "0", "--lr", "3e-3"],
    "dropout-0.1": [*F32, "--dropout", "0.1"],
    "wsd": [*F32, "--schedule", "wsd"],
    "qk-norm": [*F32, "--qk-norm"],
    "zero-init": [*F32, "--zero-init-residual"],
    "bfloat16": BF16,
    "bf16-weight-decay-0.5": [*BF16, "--weight-decay", "0.5"],
    "bf16-context-512": [*BF16, "--context-length", "512", "--batch-size", "4"],
    "bf16-relu2": ["--dtype", "bfloat16", "--mlp", "relu2", "--d-ff", "1152"],  # the weights of SwiGLU's 768
    "bf16-wsd": [*BF16, "--schedule", "wsd"],
}
RELU2 = SPEEDRUN["bf16-relu2"]  # the main job's default since the log adopted it (on CPUs with AMX)
SPEEDRUN |= {
    "relu2-weight-decay-0.5": [*RELU2, "--weight-decay", "0.5"],
    "relu2-wsd": [*RELU2, "--schedule", "wsd"],
    # Issue 34: mixtures of experts against the main job in float32 (a CPU without AMX), the same active weights
    "relu2-f32": ["--dtype", "float32", "--mlp", "relu2", "--d-ff", "1152"],
    "moe-8x-top2-f32": ["--dtype", "float32", "--experts", "8", "--experts-per-token", "2"],
    "moe-4x-top1-f32": ["--dtype", "float32", "--experts", "4", "--experts-per-token", "1"],
}
MIN_SEEDS = 3  # a gain is claimed over at least this many seeds of both runs
TARGET_BPB = 2.07  # where nanoGPT's character-level CPU recipe ends on the same split (issue 5)
BASELINE_TRAIN = dict(batch_size=12, lr=1e-3, min_lr=1e-4, warmup_steps=100, beta2=0.99, weight_decay=0.1,
                      grad_clip=1.0)


def byte_data() -> tuple[BPETokenizer, np.ndarray, np.ndarray]:
    text = read_moby_dick()
    train_text, val_text = split_text(text, 0.1)  # the same character split as pretrain.py and nanoGPT's prepare.py
    tokenizer = BPETokenizer.train(train_text, 256, name="bytes")  # no merges: one token per byte
    train = np.frombuffer(train_text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    val = np.frombuffer(val_text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    return tokenizer, train, val


def baseline(steps: int, eval_interval: int | None = None) -> dict:
    """Train the char-style baseline for ``steps`` iterations; validation on the whole held-out tenth.

    Also its validation curve (bits per byte every ``eval_interval`` iterations, on 65,536 bytes;
    default: steps // 8) and the iteration where it first went below ``TARGET_BPB`` (linear between
    evaluations; None if it never did).
    """
    tokenizer, train, val = byte_data()
    torch.manual_seed(1337)
    model = GPT(GPTConfig(**BASELINE_MODEL))
    config = TrainConfig(max_steps=steps, eval_interval=eval_interval or max(1, steps // 8), eval_tokens=65_536,
                         checkpoint_interval=steps, sample_interval=steps, log_interval=50, seed=1337,
                         **BASELINE_TRAIN)
    with tempfile.TemporaryDirectory() as out_dir:
        cpu, wall = time.process_time(), time.perf_counter()
        trainer = Trainer(model, config, train, val, out_dir, tokenizer)
        summary = trainer.fit(progress=False)
        summary["cpu_seconds"], summary["wall_seconds"] = time.process_time() - cpu, time.perf_counter() - wall
    curve = {r["step"]: r["val_bits_per_byte"] for r in trainer.history if "val_bits_per_byte" in r}
    summary["curve"] = curve
    crossing = crossing_seconds({"curve": curve, "steps": steps, "wall_seconds": steps}, TARGET_BPB)
    summary[f"first_step_below_{TARGET_BPB}"] = crossing  # wall_seconds = steps: the crossing in iterations
    return summary


def pretrain_script():
    """``ch04-pretraining/pretrain.py`` as a module (its parser and config builders)."""
    spec = importlib.util.spec_from_file_location("pretrain", PRETRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_defaults() -> argparse.Namespace:
    """The flags ``ch04-pretraining/pretrain.py`` runs with when given none."""
    return pretrain_script().build_parser().parse_args([])


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


def speedrun(variants: list[str], seeds: list[int], out_dir: Path) -> None:
    """Each variant once per seed, seeds outermost (a slow spell of a shared machine hits every variant alike).

    A folder that already holds a finished run (summary.json and speedrun.json) is kept. The wall
    time of the whole command (tokenizer, training, evaluations, export) goes to speedrun.json.
    """
    for seed in seeds:
        for name in variants:
            run_dir = out_dir / f"{name}-seed{seed}"
            if (run_dir / "summary.json").exists() and (run_dir / "speedrun.json").exists():
                continue
            command = [sys.executable, str(PRETRAIN), "--no-progress", "--overwrite", "--out-dir", str(run_dir),
                       "--seed", str(seed), *SPEEDRUN[name]]
            print(f"{name}, seed {seed}: python {shlex.join(command[1:])}", flush=True)
            start = time.perf_counter()
            subprocess.run(command, check=True)
            record = {"variant": name, "seed": seed, "flags": SPEEDRUN[name],
                      "wall_seconds": time.perf_counter() - start, "machine": machine_description(),
                      "date": today()}
            write_text_atomically(run_dir / "speedrun.json", json.dumps(record, indent=2) + "\n")  # marks it finished


def read_speedrun(run_dir: Path) -> dict:
    """One finished run: its validation curve {step: bits per byte}, steps and wall seconds."""
    record = json.loads((run_dir / "speedrun.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = {r["step"]: r["val_bits_per_byte"] for r in RunLog(run_dir).records() if "val_bits_per_byte" in r}
    return {"curve": curve, "steps": summary["steps"], "wall_seconds": record["wall_seconds"]}


def crossing_seconds(run: dict, level: float) -> float | None:
    """When the run's validation curve first went below ``level``, linear between evaluations.

    Time is the run's wall time prorated by steps (the tokenizer and evaluations spread evenly);
    None if it never went below.
    """
    previous = None
    for step in sorted(run["curve"]):
        value = run["curve"][step]
        if value < level:
            if previous is None:
                at = step
            else:
                (step0, value0) = previous
                at = step0 + (step - step0) * (value0 - level) / (value0 - value)
            return run["wall_seconds"] * at / run["steps"]
        previous = (step, value)
    return None


def value_at_seconds(run: dict, seconds: float) -> float:
    """The run's validation bits per byte at ``seconds`` of its wall time (prorated), linear between evaluations."""
    points = [(run["wall_seconds"] * step / run["steps"], value) for step, value in sorted(run["curve"].items())]
    if seconds <= points[0][0]:
        return points[0][1]
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if seconds <= t1:
            return v0 + (v1 - v0) * (seconds - t0) / (t1 - t0)
    return points[-1][1]  # the run had ended: its final value


def spread(values: list[float]) -> float:
    """Half the range of the values over seeds (0 for one seed)."""
    return (max(values) - min(values)) / 2


def speedrun_table(runs: dict[str, list[dict]], level: float = TARGET_BPB) -> dict:
    """Mean and spread over seeds of each variant's curve, wall time and time to ``level``.

    runs: variant -> its runs (read_speedrun), the first variant the reference. Each row also says
    whether its final value beats the reference's by more than the larger of the two seed spreads,
    both over at least ``MIN_SEEDS`` seeds ("gain"), and the reference's value at the variant's mean
    wall time (time-matched).
    """
    names = list(runs)
    reference = runs[names[0]]
    rows = {}
    for name in names:
        group = runs[name]
        steps = sorted(set.intersection(*(set(run["curve"]) for run in group)))
        finals = [run["curve"][run["steps"]] for run in group]
        walls = [run["wall_seconds"] for run in group]
        crossings = [crossing_seconds(run, level) for run in group]
        row = {"seeds": len(group), "steps": group[0]["steps"],
               "curve": {step: statistics.mean(run["curve"][step] for run in group) for step in steps},
               "final": statistics.mean(finals), "final_spread": spread(finals),
               "wall_seconds": statistics.mean(walls), "wall_spread": spread(walls),
               "seconds_to_level": None if None in crossings else statistics.mean(crossings)}
        row["reference_at_same_time"] = statistics.mean(value_at_seconds(run, row["wall_seconds"])
                                                        for run in reference)
        rows[name] = row
    ref = rows[names[0]]
    for row in rows.values():
        margin = max(row["final_spread"], ref["final_spread"])
        row["final_change"] = row["final"] - ref["final"]
        row["gain"] = min(row["seeds"], ref["seeds"]) >= MIN_SEEDS and row["final_change"] < -margin
        row["wall_ratio"] = row["wall_seconds"] / ref["wall_seconds"]
    return rows


def markdown_table(rows: dict, level: float = TARGET_BPB) -> str:
    """The speedrun log's table: one row per variant, the reference first."""
    steps = sorted(set.intersection(*(set(row["curve"]) for row in rows.values())))
    head = (["variant (pretrain.py flags)", "seeds"] + [str(step) for step in steps]
            + ["change", "wall (min)", "reference at that time", f"min to {level}"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for name, row in rows.items():
        flags = shlex.join(SPEEDRUN.get(name, [])) or "(none)"
        cells = [f"{name} (`{flags}`)", str(row["seeds"])]
        cells += [f"{row['curve'][step]:.3f}" for step in steps[:-1]]
        cells.append(f"**{row['final']:.3f}** +- {row['final_spread']:.3f}")
        cells.append(f"{row['final_change']:+.3f}" + (" (gain)" if row["gain"] else ""))
        cells.append(f"{row['wall_seconds'] / 60:.2f} +- {row['wall_spread'] / 60:.2f} ({row['wall_ratio']:.2f}x)")
        cells.append(f"{row['reference_at_same_time']:.3f}")
        crossing = row["seconds_to_level"]
        cells.append("never" if crossing is None else f"{crossing / 60:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def variant_step_cost(variants: list[str], rounds: int) -> dict:
    """Median wall seconds of one training step of each speedrun variant, interleaved, and the ratio to the first.

    Each variant's model and optimizer are built from its flags as pretrain.py builds them (so Muon's
    orthogonalisation, QK-norm's extra norms or a longer context are in its step), on random tokens.
    """
    script = pretrain_script()
    parser = script.build_parser()
    steps = {}
    for name in variants:
        args = parser.parse_args(SPEEDRUN[name])
        vocab_size = int(args.tokenizer.removeprefix("bpe:"))
        torch.manual_seed(0)
        model = GPT(script.model_config_for(args, vocab_size))
        config = script.train_config_for(args, torch.device("cpu"))
        optimizer = configure_optimizer(model, config, torch.device("cpu"))
        steps[name] = functools.partial(timed_step, model, args.batch_size * args.grad_accum, config.torch_dtype,
                                        optimizer)
    round_robin(steps, 1)  # a round to warm up
    wall = {name: statistics.median(w for w, _ in runs) for name, runs in round_robin(steps, rounds).items()}
    return {name: {"seconds_per_step": seconds, "ratio": seconds / wall[variants[0]]} for name, seconds in wall.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["baseline", "cost", "speedrun"])
    parser.add_argument("--steps", type=int, default=2000, help="baseline iterations (nanoGPT's CPU recipe: 2000)")
    parser.add_argument("--eval-interval", type=int, default=None,
                        help="baseline: iterations between evaluations (default: an eighth of --steps)")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds of the cost comparison")
    parser.add_argument("--variant", action="append", choices=sorted(SPEEDRUN),
                        help="speedrun: a change to run (repeat; the first is the reference; default: all); "
                             "cost: time these variants' steps instead of the default's and the baseline's")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339], help="speedrun: seeds")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/speedrun"), help="speedrun: where the runs go")
    parser.add_argument("--report", action="store_true", help="speedrun: only print the table of finished runs")
    add_threads_flag(parser)
    args = parser.parse_args()
    set_threads(parser, args.threads)
    print(machine_description())
    if args.what == "speedrun":
        variants = args.variant or list(SPEEDRUN)
        if not args.report:
            speedrun(variants, args.seeds, args.out_dir)
        runs = {name: [read_speedrun(args.out_dir / f"{name}-seed{seed}") for seed in args.seeds
                       if (args.out_dir / f"{name}-seed{seed}" / "speedrun.json").exists()] for name in variants}
        missing = [name for name, group in runs.items() if not group]
        if missing:
            parser.error(f"no finished runs of {missing} under {args.out_dir} for seeds {args.seeds}")
        print(markdown_table(speedrun_table(runs)))
        return
    if args.what == "cost" and args.variant:
        result = variant_step_cost(args.variant, args.rounds)
    else:
        result = baseline(args.steps, args.eval_interval) if args.what == "baseline" else step_cost(args.rounds)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
