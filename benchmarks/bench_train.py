"""Training benchmark: tokens/s, MFU and peak memory of one forward + backward + AdamW step, ours vs transformers.

    python -m benchmarks.bench_train                      # from the repository root; prints a Markdown section
    python -m benchmarks.bench_train --configs 6x384 --modes fp32 --runs 3     # a quick look
    python -m benchmarks.bench_train --device cuda --configs gpt2-small --modes bf16 bf16-compiled --json train.json

For each configuration and mode, llmscratch's GPT and transformers' GPT2LMHeadModel (SDPA attention,
random weights, built offline) of the same shape train on the same random batch with the same
AdamW (``llmscratch.training.optim.configure_optimizer``). Each takes its normal path to the loss: ours
``GPT(idx, targets=...)``, theirs ``GPT2LMHeadModel(input_ids, labels=...)``. They run in
interleaved rounds in one process, so a busy spell of a shared machine hits both; medians are
reported. Tokens/s counts real tokens (batch x context); MFU divides the model's FLOPs (6 per
weight per token plus attention, of the unpadded model) by a matmul ceiling measured in the same
rounds; on a GPU, also by its datasheet peak. Peak memory is what PyTorch's allocator held during one
step above what it held before. --json also writes every number (see ``to_json`` for the keys).
"""

import argparse
import gc
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights: nothing to download

import transformers  # noqa: E402

from benchmarks.common import (add_threads_flag, device_flag, device_name, load_average,  # noqa: E402
                               machine_description, median, set_threads, today)
from llmscratch.device import autocast  # noqa: E402
from llmscratch.files import write_json_atomically  # noqa: E402
from llmscratch.model.config import GPTConfig  # noqa: E402
from llmscratch.model.gpt import GPT
from llmscratch.profiling import peak_memory_bytes, round_robin, time_once  # noqa: E402
from llmscratch.training.config import TrainConfig  # noqa: E402
from llmscratch.training.flops import gpu_peak_flops, measure_matmul_flops  # noqa: E402
from llmscratch.training.optim import configure_optimizer


@dataclass(frozen=True)
class Shape:
    """A GPT-2-style model and the batch it trains on."""

    d_model: int
    n_layers: int
    n_heads: int
    context_length: int
    vocab_size: int
    batch_size: int  # default on a CPU; --batch-size overrides
    runs: int  # interleaved rounds by default on a CPU; --runs overrides
    cuda_batch_size: int  # the same two on a CUDA GPU
    cuda_runs: int


SHAPES = {
    # nanoGPT's small Shakespeare model with GPT-2's vocabulary rounded up to a multiple of 64. On a GPU,
    # nanoGPT's own batch for it (64 x 256 = 16,384 tokens a step).
    "6x384": Shape(d_model=384, n_layers=6, n_heads=6, context_length=256, vocab_size=50304, batch_size=8,
                   runs=5, cuda_batch_size=64, cuda_runs=10),
    # GPT-2 small (124M). Batch 1 and 3 rounds by default: a step of batch 8 takes minutes on two CPU cores.
    # On a GPU, batch 16 (16,384 tokens a step, products large enough to keep the matrix units busy). Scaled
    # from the peaks measured on a CPU (transformers in fp32 eager keeps about 26 floats a token per layer,
    # plus three fp32 copies of the logits), its step holds about 16 + 10 + 2 GB (activations, logits,
    # weights with gradients and AdamW): a third of an 80 GB H100. Batch 32 would near 60 GB, next to the
    # other peer's model and the allocator's cached blocks.
    "gpt2-small": Shape(d_model=768, n_layers=12, n_heads=12, context_length=1024, vocab_size=50257, batch_size=1,
                        runs=3, cuda_batch_size=16, cuda_runs=10),
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
              loss_path: str = "targets", device: torch.device = torch.device("cpu")):
    """One training step on ``device`` (model and batch there): forward under autocast, the loss, backward,
    AdamW (fused on CUDA), gradients dropped."""
    optimizer = configure_optimizer(model, TrainConfig(), device)
    forward = torch.compile(model) if compiled else model

    def step() -> float:
        with autocast(device, dtype):
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
    """Interleaved timings (and peak memory) of both peers for one configuration and mode, as ``to_json`` keeps them."""
    shape, (dtype, compiled), device = SHAPES[name], MODES[mode], args.device
    cuda = device.type == "cuda"
    generator = torch.Generator().manual_seed(args.seed)
    batch = args.batch_size or (shape.cuda_batch_size if cuda else shape.batch_size)
    runs = args.runs or (shape.cuda_runs if cuda else shape.runs)
    inputs = torch.randint(shape.vocab_size, (batch, shape.context_length), generator=generator).to(device)
    targets = torch.roll(inputs, -1, dims=1)  # any targets will do; the work does not depend on them
    steps, first = {}, {}
    for peer in PEERS:
        vocab = shape.vocab_size if peer == "transformers" else padded_vocab(shape, args.pad_vocab)
        model = build(peer, shape, vocab, args.seed).to(device)
        steps[peer] = make_step(peer, model, dtype, compiled, inputs, targets, args.loss, device)
        first[peer] = time_once(steps[peer], device)  # warm-up; compiles in a compiled mode
        for _ in range(args.warmup - 1):
            steps[peer]()
    losses = {}
    candidates = {peer: lambda step=steps[peer], peer=peer: time_once(lambda: losses.__setitem__(peer, step()), device)
                  for peer in PEERS}
    for precision, ceiling_dtype in CEILING_DTYPES.items():  # the ceilings under the same load, in every round
        candidates[precision] = lambda dtype=ceiling_dtype: measure_matmul_flops(
            dtype, size=args.matmul_size, max_seconds=1.0, device=str(device))
    measured = round_robin(candidates, runs, description=f"{name} {mode}")
    seconds = {peer: measured[peer] for peer in PEERS}
    ceilings = {precision: median(measured[precision]) for precision in CEILING_DTYPES}
    for peer, loss in losses.items():
        if not math.isfinite(loss):
            raise SystemExit(f"error: {peer} gave a non-finite loss {loss} in {mode}")
    tokens = batch * shape.context_length
    # Each round's two steps ran back to back: their ratio cancels most of a shared machine's drift.
    ratios = sorted(theirs / ours for ours, theirs in zip(seconds["llmscratch"], seconds["transformers"]))
    ceiling = ceilings["bf16" if dtype == torch.bfloat16 else "fp32"]
    datasheet = gpu_peak_flops(torch.cuda.get_device_name(device), dtype) if cuda else None
    fpt = flops_per_token(shape)
    peers = {}
    for peer in PEERS:
        rate = tokens / median(seconds[peer])
        peers[peer] = {"tokens_per_s": rate, "seconds": seconds[peer], "first_step_s": first[peer],
                       "mfu": fpt * rate / ceiling, "bf16_ceiling_share": fpt * rate / ceilings["bf16"],
                       "mfu_datasheet": fpt * rate / datasheet if datasheet else None,
                       "peak_mib": None if args.no_memory else peak_memory_bytes(steps[peer], device) / 2**20}
    del steps
    gc.collect()
    return {"batch": batch, "runs": runs, "tokens_per_step": tokens, "ratio": median(ratios),
            "ratio_range": [ratios[0], ratios[-1]], "ceiling_flops": ceilings, "datasheet_peak_flops": datasheet,
            "peers": peers}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--configs", nargs="+", choices=sorted(SHAPES), default=["6x384", "gpt2-small"],
        help="model configurations (default: both)")
    add("--modes", nargs="+", choices=list(MODES), default=["fp32", "bf16", "compiled"],
        help="fp32 eager, bf16 autocast, fp32 torch.compile, bf16 torch.compile (default: the first three)")
    add("--runs", type=int, default=None,
        help="interleaved timed steps per peer; medians are reported (default: 5 for 6x384, 3 for gpt2-small; "
             "on CUDA, see --device)")
    add("--warmup", type=int, default=1, help="untimed steps first, compilation included (default 1)")
    add("--batch-size", type=int, default=None,
        help="sequences per step (default: 8 for 6x384, 1 for gpt2-small; on CUDA, see --device)")
    add("--pad-vocab", type=int, default=1,
        help="round llmscratch's vocabulary up to a multiple of this (default 1: none); tokens/s and "
             "MFU still count the real vocabulary, which transformers keeps")
    add("--loss", choices=["targets", "logits"], default="targets",
        help="llmscratch's loss: targets = GPT(idx, targets=...), chunked (the normal path); logits = "
             "F.cross_entropy on the full logits (the explicit way) (default targets)")
    add_threads_flag(parser)
    add("--no-memory", action="store_true", help="skip the peak-memory step (a profiled extra step per peer)")
    add("--seed", type=int, default=0, help="seed of the weights and the batch")
    add("--device", default="cpu",
        help="cpu, cuda or cuda:N (default cpu). On CUDA the models, batch and AdamW (fused) are on the GPU, batch "
             "and rounds default to 64 and 10 for 6x384, 16 and 10 for gpt2-small, and MFU is also given against "
             "the GPU's datasheet peak")
    add("--matmul-size", type=int, default=None,
        help="side of the square products that measure the matmul ceilings (default: 1536 on a CPU, 8192 on CUDA)")
    add("--json", type=Path, default=None, metavar="PATH",
        help="also write every measured number to this JSON file (written atomically at the end)")
    args = parser.parse_args()
    for name in ("runs", "warmup", "pad_vocab", "batch_size", "matmul_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    args.device = device_flag(parser, args.device)
    args.matmul_size = args.matmul_size or (8192 if args.device.type == "cuda" else 1536)
    if args.json is not None and args.json.is_dir():
        parser.error(f"--json {args.json} is a folder; give the path of the file to write")
    set_threads(parser, args.threads)
    return args


def command() -> str:
    return " ".join(["python -m benchmarks.bench_train", *sys.argv[1:]])


def main() -> None:
    args = parse_args()
    transformers.utils.logging.set_verbosity_error()
    load_before = load_average()
    results = {}
    for name in args.configs:
        for mode in args.modes:
            results[name, mode] = measure(name, mode, args)
    load_after = load_average()
    if args.json is not None:
        write_json_atomically(args.json, to_json(results, args, load_before, load_after))
    print_section(results, args, load_before, load_after)


def to_json(results: dict, args, load_before: str, load_after: str) -> dict:
    """Every number of the run: the machine and versions, then ``configs[name]["modes"][mode]``.

    Each mode holds batch, runs, tokens_per_step, ratio (median of the per-round llmscratch / transformers
    ratios of tokens/s) and ratio_range [min, max], ceiling_flops {fp32, bf16} (measured FLOP/s),
    datasheet_peak_flops (the GPU's, for the mode's precision; null on a CPU or an unknown GPU), and under
    peers[llmscratch | transformers]: tokens_per_s, seconds (each timed step), first_step_s, mfu (of the
    measured ceiling of the mode's precision, a fraction), bf16_ceiling_share, mfu_datasheet (null where
    there is no datasheet peak) and peak_mib (null with --no-memory).
    """
    configs = {}
    for name in args.configs:
        shape = SHAPES[name]
        configs[name] = {"d_model": shape.d_model, "n_layers": shape.n_layers, "n_heads": shape.n_heads,
                         "context_length": shape.context_length, "vocab_size": shape.vocab_size,
                         "llmscratch_vocab_size": padded_vocab(shape, args.pad_vocab),
                         "flops_per_token": flops_per_token(shape),
                         "modes": {mode: results[name, mode] for mode in args.modes}}
    return {"benchmark": "train", "date": today(), "command": command(), "machine": machine_description(),
            "device": str(args.device), "device_name": device_name(args.device), "torch": torch.__version__,
            "transformers": transformers.__version__, "load_average_before": load_before,
            "load_average_after": load_after, "warmup": args.warmup, "loss": args.loss, "seed": args.seed,
            "matmul_size": args.matmul_size, "configs": configs}


def print_section(results: dict, args, load_before: str, load_after: str) -> None:
    cuda = args.device.type == "cuda"
    print(f"### Training throughput ({today()})\n")
    print(f"Command: `{command()}`  ")
    print(f"Machine: {machine_description()}{f'; GPU: {device_name(args.device)}' if cuda else ''}  ")
    print(f"Load average (1, 5, 15 min) before: {load_before}; after: {load_after}  ")
    print(f"transformers {transformers.__version__} `GPT2LMHeadModel` (SDPA) vs llmscratch `GPT`, "
          f"{'`GPT(idx, targets=...)`' if args.loss == 'targets' else 'full logits + `F.cross_entropy`'}; "
          f"AdamW from `configure_optimizer` for both; interleaved rounds of one timed step per peer after "
          f"{args.warmup} warm-up step(s), medians. Each round also measures the fp32 and bf16 matmul "
          f"ceilings ({args.matmul_size}² products, best of a few), whose medians the MFU columns divide by."
          f"{' On the GPU, the datasheet MFU divides by its datasheet peak instead.' if cuda else ''}\n")
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
              f"| peak MiB llmscratch / transformers | first step s |{' datasheet MFU (TFLOP/s) |' if cuda else ''}")
        print(f"|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|{'---:|' if cuda else ''}")
        for mode in args.modes:
            r = results[name, mode]
            ours, theirs = r["peers"]["llmscratch"], r["peers"]["transformers"]
            memory = " / ".join(f"{r['peers'][p]['peak_mib']:,.0f}" for p in PEERS) if not args.no_memory else "-"
            first = " / ".join(f"{r['peers'][p]['first_step_s']:.1f}" for p in PEERS)
            low, high = r["ratio_range"]
            datasheet = ""
            if cuda:
                datasheet = (f" {100 * ours['mfu_datasheet']:.0f}% / {100 * theirs['mfu_datasheet']:.0f}% "
                             f"({r['datasheet_peak_flops'] / 1e12:,.0f}) |" if r["datasheet_peak_flops"] else " - |")
            print(f"| {mode} | {ours['tokens_per_s']:,.0f} | {theirs['tokens_per_s']:,.0f} | {r['ratio']:.2f} "
                  f"({low:.2f}-{high:.2f}) | {r['ceiling_flops']['fp32'] / 1e9:,.0f} / "
                  f"{r['ceiling_flops']['bf16'] / 1e9:,.0f} | {100 * ours['mfu']:.0f}% | {100 * theirs['mfu']:.0f}% "
                  f"| {100 * ours['bf16_ceiling_share']:.0f}% | {memory} | {first} |{datasheet}")
        print()
    print("Ratio: llmscratch tokens/s over transformers', the median (and range) of the per-round ratios. "
          "MFU: model FLOPs per second over the fp32 ceiling in fp32 modes, the bf16 ceiling in bf16 modes. "
          "First step: llmscratch / transformers, compilation included (not in the medians).", end="")
    print(" Datasheet MFU: llmscratch / transformers, over the GPU's dense datasheet peak of the mode's precision "
          "(TF32 for fp32 where torch allows it), in brackets." if cuda else "")


if __name__ == "__main__":
    main()
