"""Training benchmark: tokens/s, MFU and peak memory of one forward + backward + AdamW step, ours vs transformers.

    python -m benchmarks.bench_train                      # from the repository root; prints a Markdown section
    python -m benchmarks.bench_train --configs 6x384 --modes fp32 --runs 3     # a quick look

For each configuration and mode, llmscratch's GPT and transformers' GPT2LMHeadModel (SDPA attention,
random weights, built offline) of the same shape train on the same random batch with the same
AdamW (``llmscratch.train.configure_optimizer``). Each takes its normal path to the loss: ours
``GPT(idx, targets=...)``, theirs ``GPT2LMHeadModel(input_ids, labels=...)``. They run in
interleaved rounds in one process, so a busy spell of a shared machine hits both; medians are
reported. Tokens/s counts real tokens (batch x context); MFU divides the model's FLOPs (6 per
weight per token plus attention, of the unpadded model) by a matmul ceiling measured in the same
rounds. Peak memory is what PyTorch's allocator held during one step above what it held before.
"""

import argparse
import gc
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights: nothing to download

import transformers  # noqa: E402

from benchmarks.common import (  # noqa: E402
    add_threads_flag, load_average, machine_description, median, set_threads, today,
)
from llmscratch.device import autocast  # noqa: E402
from llmscratch.flops import measure_matmul_flops  # noqa: E402
from llmscratch.model import GPT, GPTConfig  # noqa: E402
from llmscratch.profiling import peak_memory_bytes, round_robin, time_once  # noqa: E402
from llmscratch.train import TrainConfig, configure_optimizer  # noqa: E402

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Shape:
    """A GPT-2-style model and the batch it trains on."""

    d_model: int
    n_layers: int
    n_heads: int
    context_length: int
    vocab_size: int
    batch_size: int  # default; --batch-size overrides
    runs: int  # interleaved rounds by default; --runs overrides


SHAPES = {
    # nanoGPT's small Shakespeare model with GPT-2's vocabulary rounded up to a multiple of 64.
    "6x384": Shape(d_model=384, n_layers=6, n_heads=6, context_length=256, vocab_size=50304, batch_size=8,
                   runs=5),
    # GPT-2 small (124M). Batch 1 and 3 rounds by default: a step of batch 8 takes minutes on two CPU cores.
    "gpt2-small": Shape(d_model=768, n_layers=12, n_heads=12, context_length=1024, vocab_size=50257, batch_size=1,
                        runs=3),
}
MODES = {  # name: (autocast dtype, torch.compile)
    "fp32": (torch.float32, False),
    "bf16": (torch.bfloat16, False),
    "compiled": (torch.float32, True),
    "bf16-compiled": (torch.bfloat16, True),
}
PEERS = ("llmscratch", "transformers")
CEILING_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(peer: str, shape: Shape, vocab_size: int, seed: int) -> torch.nn.Module:
    """A freshly initialised model of the given shape, without dropout, in training mode."""
    torch.manual_seed(seed)
    if peer == "llmscratch":
        config = GPTConfig(vocab_size=vocab_size, context_length=shape.context_length, d_model=shape.d_model,
                           n_layers=shape.n_layers, n_heads=shape.n_heads)
        return GPT(config).train()
    config = transformers.GPT2Config(
        vocab_size=vocab_size, n_positions=shape.context_length, n_embd=shape.d_model, n_layer=shape.n_layers,
        n_head=shape.n_heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
    )
    return transformers.GPT2LMHeadModel(config).train()


def padded_vocab(shape: Shape, multiple: int) -> int:
    """llmscratch's vocabulary: the real one rounded up to a multiple of ``multiple`` (--pad-vocab)."""
    return multiple * math.ceil(shape.vocab_size / multiple)


def flops_per_token(shape: Shape) -> int:
    """Training FLOPs per token of the unpadded model (vocabulary as given), by llmscratch's count."""
    with torch.device("meta"):  # shapes only
        model = GPT(GPTConfig(vocab_size=shape.vocab_size, context_length=shape.context_length,
                              d_model=shape.d_model, n_layers=shape.n_layers, n_heads=shape.n_heads))
    return model.flops_per_token(shape.context_length)


def make_step(peer: str, model: torch.nn.Module, dtype: torch.dtype, compiled: bool, inputs, targets,
              loss_path: str = "targets"):
    """One training step: forward under autocast, the loss, backward, AdamW, gradients dropped."""
    optimizer = configure_optimizer(model, TrainConfig(), CPU)
    forward = torch.compile(model) if compiled else model

    def step() -> float:
        with autocast(CPU, dtype):
            if peer == "llmscratch" and loss_path == "logits":  # the explicit way, for comparison
                loss = F.cross_entropy(forward(inputs).float().flatten(0, 1), targets.flatten())
            elif peer == "llmscratch":
                loss = forward(inputs, targets=targets)
            else:  # labels are shifted inside: each position predicts the next input token
                loss = forward(input_ids=inputs, labels=inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def measure(name: str, mode: str, args) -> dict:
    """Interleaved timings (and peak memory) of both peers for one configuration and mode."""
    shape, (dtype, compiled) = SHAPES[name], MODES[mode]
    generator = torch.Generator().manual_seed(args.seed)
    batch, runs = args.batch_size or shape.batch_size, args.runs or shape.runs
    inputs = torch.randint(shape.vocab_size, (batch, shape.context_length), generator=generator)
    targets = torch.roll(inputs, -1, dims=1)  # any targets will do; the work does not depend on them
    steps, first = {}, {}
    for peer in PEERS:
        vocab = shape.vocab_size if peer == "transformers" else padded_vocab(shape, args.pad_vocab)
        model = build(peer, shape, vocab, args.seed)
        steps[peer] = make_step(peer, model, dtype, compiled, inputs, targets, args.loss)
        first[peer] = time_once(steps[peer])  # warm-up; compiles in a compiled mode
        for _ in range(args.warmup - 1):
            steps[peer]()
    losses = {}
    candidates = {peer: lambda step=steps[peer], peer=peer: time_once(lambda: losses.__setitem__(peer, step()))
                  for peer in PEERS}
    for precision, ceiling_dtype in CEILING_DTYPES.items():  # the ceilings under the same load, in every round
        candidates[precision] = lambda dtype=ceiling_dtype: measure_matmul_flops(dtype, max_seconds=1.0)
    measured = round_robin(candidates, runs, description=f"{name} {mode}")
    seconds = {peer: measured[peer] for peer in PEERS}
    ceilings = {precision: measured[precision] for precision in CEILING_DTYPES}
    for peer, loss in losses.items():
        if not math.isfinite(loss):
            raise SystemExit(f"error: {peer} gave a non-finite loss {loss} in {mode}")
    tokens = batch * shape.context_length
    # Each round's two steps ran back to back: their ratio cancels most of a shared machine's drift.
    ratios = sorted(theirs / ours for ours, theirs in zip(seconds["llmscratch"], seconds["transformers"]))
    result = {"tokens_per_s": {p: tokens / median(seconds[p]) for p in PEERS},
              "ratio": (median(ratios), ratios[0], ratios[-1]),
              "ceiling": {precision: median(values) for precision, values in ceilings.items()},
              "first_s": first, "batch": batch, "runs": runs}
    if not args.no_memory:
        result["peak_mib"] = {p: peak_memory_bytes(steps[p]) / 2**20 for p in PEERS}
    del steps
    gc.collect()
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--configs", nargs="+", choices=sorted(SHAPES), default=["6x384", "gpt2-small"],
        help="model configurations (default: both)")
    add("--modes", nargs="+", choices=list(MODES), default=["fp32", "bf16", "compiled"],
        help="fp32 eager, bf16 autocast, fp32 torch.compile, bf16 torch.compile (default: the first three)")
    add("--runs", type=int, default=None,
        help="interleaved timed steps per peer; medians are reported (default: 5 for 6x384, 3 for gpt2-small)")
    add("--warmup", type=int, default=1, help="untimed steps first, compilation included (default 1)")
    add("--batch-size", type=int, default=None,
        help="sequences per step (default: 8 for 6x384, 1 for gpt2-small)")
    add("--pad-vocab", type=int, default=1,
        help="round llmscratch's vocabulary up to a multiple of this (default 1: none); tokens/s and "
             "MFU still count the real vocabulary, which transformers keeps")
    add("--loss", choices=["targets", "logits"], default="targets",
        help="llmscratch's loss: targets = GPT(idx, targets=...), chunked (the normal path); logits = "
             "F.cross_entropy on the full logits (the explicit way) (default targets)")
    add_threads_flag(parser)
    add("--no-memory", action="store_true", help="skip the peak-memory step (a profiled extra step per peer)")
    add("--seed", type=int, default=0, help="seed of the weights and the batch")
    args = parser.parse_args()
    for name in ("runs", "warmup", "pad_vocab", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    set_threads(parser, args.threads)
    return args


def main() -> None:
    args = parse_args()
    transformers.utils.logging.set_verbosity_error()
    load_before = load_average()
    results = {}
    for name in args.configs:
        for mode in args.modes:
            results[name, mode] = measure(name, mode, args)
    print_section(results, args, load_before, load_average())


def print_section(results: dict, args, load_before: str, load_after: str) -> None:
    print(f"### Training throughput ({today()})\n")
    print(f"Command: `{' '.join(['python -m benchmarks.bench_train', *sys.argv[1:]])}`  ")
    print(f"Machine: {machine_description()}  ")
    print(f"Load average (1, 5, 15 min) before: {load_before}; after: {load_after}  ")
    print(f"transformers {transformers.__version__} `GPT2LMHeadModel` (SDPA) vs llmscratch `GPT`, "
          f"{'`GPT(idx, targets=...)`' if args.loss == 'targets' else 'full logits + `F.cross_entropy`'}; "
          f"AdamW from `configure_optimizer` for both; interleaved rounds of one timed step per peer after "
          f"{args.warmup} warm-up step(s), medians. Each round also measures the fp32 and bf16 matmul "
          f"ceilings (1536² products, best of a few), whose medians the MFU columns divide by.\n")
    for name in args.configs:
        shape = SHAPES[name]
        fpt = flops_per_token(shape)
        batch, runs = results[name, args.modes[0]]["batch"], results[name, args.modes[0]]["runs"]
        vocab = padded_vocab(shape, args.pad_vocab)
        padded = f" (llmscratch padded to {vocab:,})" if vocab != shape.vocab_size else ""
        print(f"**{name}**: {shape.n_layers} layers, {shape.n_heads} heads, width {shape.d_model}, context "
              f"{shape.context_length}, vocabulary {shape.vocab_size:,}{padded}, batch {batch}, {runs} rounds; "
              f"{fpt / 1e6:,.0f} MFLOP per token for training.\n")
        print("| mode | llmscratch tokens/s | transformers tokens/s | ratio (range) | ceiling fp32 / bf16 GFLOP/s "
              "| llmscratch MFU | transformers MFU | llmscratch share of bf16 ceiling "
              "| peak MiB llmscratch / transformers | first step s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for mode in args.modes:
            r = results[name, mode]
            ours, theirs = r["tokens_per_s"]["llmscratch"], r["tokens_per_s"]["transformers"]
            ceiling = r["ceiling"]["bf16" if MODES[mode][0] == torch.bfloat16 else "fp32"]
            memory = " / ".join(f"{r['peak_mib'][p]:,.0f}" for p in PEERS) if "peak_mib" in r else "-"
            first = " / ".join(f"{r['first_s'][p]:.1f}" for p in PEERS)
            ratio, low, high = r["ratio"]
            print(f"| {mode} | {ours:,.0f} | {theirs:,.0f} | {ratio:.2f} ({low:.2f}-{high:.2f}) "
                  f"| {r['ceiling']['fp32'] / 1e9:,.0f} / {r['ceiling']['bf16'] / 1e9:,.0f} "
                  f"| {100 * fpt * ours / ceiling:.0f}% | {100 * fpt * theirs / ceiling:.0f}% "
                  f"| {100 * fpt * ours / r['ceiling']['bf16']:.0f}% | {memory} | {first} |")
        print()
    print("Ratio: llmscratch tokens/s over transformers', the median (and range) of the per-round ratios. "
          "MFU: model FLOPs per second over the fp32 ceiling in fp32 modes, the bf16 ceiling in bf16 modes. "
          "First step: llmscratch / transformers, compilation included (not in the medians).")


if __name__ == "__main__":
    main()
