"""Time forward+backward and measure peak memory of the attention paths over sequence lengths.

Three variants of one llmscratch MultiHeadAttention (same weights): the explicit path, the fused
path (scaled_dot_product_attention) and torch.compile of the fused module. Prints a table and
saves a plot. Example: python ch02-attention/attention_bench.py --seq-lens 128 256 512
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # a script writes a PNG; it needs no display
import matplotlib.pyplot as plt
import torch
from matplotlib.ticker import NullLocator
from tqdm import tqdm

from llmscratch.cli import check_device, check_out_files, run_script
from llmscratch.device import DTYPES, choose_dtype
from llmscratch.model.attention import MultiHeadAttention
from llmscratch.model.rope import RotaryEmbedding
from llmscratch.profiling import (backward_step, device_description, failed_allocation, peak_memory_bytes, sdpa_kernels,
                                  time_steps)

VARIANTS = ("explicit", "fused", "compiled")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keep the description's line breaks and show each flag's default."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add = parser.add_argument
    add("--seq-lens", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096],
        help="sequence lengths to measure")
    add("--batch-size", type=int, default=2, help="sequences per batch")
    add("--d-model", type=int, default=256, help="input and output width")
    add("--n-heads", type=int, default=4, help="query heads; the head size is d_model / n_heads")
    add("--n-kv-heads", type=int, default=None,
        help="key/value heads for grouped-query attention; None means n_heads (multi-head)")
    add("--rope", action="store_true", help="rotate queries and keys with RoPE")
    add("--repeats", type=int, default=7, help="timed forward+backward steps per variant; reports the median")
    add("--warmup", type=int, default=2,
        help="untimed steps first; the compiled variant compiles during the first, whose time is reported")
    add("--no-compile", action="store_true", help="skip the torch.compile variant (which builds C++ on CPU)")
    add("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda when available, else cpu")
    add("--threads", type=int, default=None,
        help="CPU threads for PyTorch (None: torch's default); 1 steadies timings on a shared machine")
    add("--dtype", choices=["auto", *DTYPES], default="auto",
        help="auto: bfloat16 on cuda (float16 on GPUs without it: flash kernels need 16 bits), float32 on cpu")
    add("--out", type=Path, default=Path("runs/attention_bench.png"), help="where to save the plot (PNG)")
    add("--seed", type=int, default=0, help="seed for the weights and inputs")
    args = parser.parse_args()
    check_device(parser, args)
    if args.dtype == "auto":
        args.dtype = choose_dtype(args.device)
    for flag_name, values in (("--seq-lens", args.seq_lens), ("--batch-size", [args.batch_size]),
                              ("--d-model", [args.d_model]), ("--n-heads", [args.n_heads]),
                              ("--n-kv-heads", [] if args.n_kv_heads is None else [args.n_kv_heads]),
                              ("--repeats", [args.repeats]), ("--warmup", [args.warmup]),
                              ("--threads", [] if args.threads is None else [args.threads])):
        if bad := [value for value in values if value < 1]:
            parser.error(f"{flag_name} must be at least 1, got {bad[0]}")
    if args.d_model % args.n_heads:
        parser.error(f"--d-model {args.d_model} must be a multiple of --n-heads {args.n_heads}")
    if args.n_kv_heads is not None and args.n_heads % args.n_kv_heads:
        parser.error(f"--n-heads {args.n_heads} must be a multiple of --n-kv-heads {args.n_kv_heads}")
    check_out_files(parser, {"--out": args.out})
    if args.out.suffix.lower() != ".png":
        parser.error(f"--out {args.out}: the plot is a PNG: give a file name ending in .png")
    return args


def build_variants(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    """The explicit, fused and (unless --no-compile) compiled modules, all with the same weights."""
    torch.manual_seed(args.seed)
    explicit = MultiHeadAttention(args.d_model, args.d_model, args.n_heads, args.n_kv_heads, fused=False)
    fused = MultiHeadAttention(args.d_model, args.d_model, args.n_heads, args.n_kv_heads, fused=True)
    fused.load_state_dict(explicit.state_dict())
    dtype = DTYPES[args.dtype]
    variants = {"explicit": explicit.to(args.device, dtype), "fused": fused.to(args.device, dtype)}
    if not args.no_compile:
        variants["compiled"] = torch.compile(variants["fused"])
    return variants


def print_table(results: dict, args: argparse.Namespace) -> None:
    names = [n for n in VARIANTS if n in results]
    header = ["seq_len", *(f"{n} ms" for n in names), "fused/explicit", *(f"{n} MiB" for n in names)]
    if "compiled" in names:
        header.append("compile s")
    print("| " + " | ".join(header) + " |")
    print("|" + "---:|" * len(header))
    for seq_len in args.seq_lens:
        row = [str(seq_len)]
        row += [f"{results[n][seq_len]['ms']:.1f}" for n in names]
        row.append(f"{results['fused'][seq_len]['ms'] / results['explicit'][seq_len]['ms']:.2f}")
        row += [f"{results[n][seq_len]['mib']:.1f}" for n in names]
        if "compiled" in names:
            row.append(f"{results['compiled'][seq_len]['first_s']:.1f}")
        print("| " + " | ".join(row) + " |")


def plot(results: dict, args: argparse.Namespace, title: str) -> None:
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    for name, by_len in results.items():
        ax_time.plot(args.seq_lens, [by_len[t]["ms"] for t in args.seq_lens], marker="o", label=name)
        ax_mem.plot(args.seq_lens, [by_len[t]["mib"] for t in args.seq_lens], marker="o", label=name)
    for ax, ylabel in [(ax_time, "forward+backward (ms, median)"), (ax_mem, "peak memory above start (MiB)")]:
        ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel=ylabel)
        ax.xaxis.set_minor_locator(NullLocator())  # label only the measured lengths
        ax.set_xticks(args.seq_lens, [str(t) for t in args.seq_lens])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        variants = build_variants(args)
        head_dim = args.d_model // args.n_heads
        rope = RotaryEmbedding(head_dim, max(args.seq_lens)).to(args.device) if args.rope else None
    except ValueError as error:
        raise SystemExit(f"error: {error}")
    n_kv_heads = args.n_kv_heads or args.n_heads
    title = (f"{device_description(args.device)}, {args.dtype}; batch {args.batch_size}, d_model {args.d_model}, "
             f"{args.n_heads} heads / {n_kv_heads} kv heads{', RoPE' if args.rope else ''}")
    print(title)
    generator = torch.Generator().manual_seed(args.seed)

    def random_input(seq_len: int) -> torch.Tensor:
        shape = (args.batch_size, seq_len, args.d_model)
        return torch.randn(shape, generator=generator).to(args.device, DTYPES[args.dtype])

    results = {name: {} for name in variants}
    seq_len = args.seq_lens[0]
    try:
        x = random_input(seq_len)
        kernels = sdpa_kernels(lambda: variants["fused"](x, rope))
        print(f"fused path runs: {', '.join(kernels) or 'none found'}")
        for seq_len in tqdm(args.seq_lens, desc=f"measuring {', '.join(variants)}"):
            x = random_input(seq_len).requires_grad_()
            grad_out = random_input(seq_len)
            steps = {name: backward_step(module, (x, rope), grad_out) for name, module in variants.items()}
            for name, (first_s, median_s) in time_steps(steps, args.repeats, args.warmup, args.device).items():
                mib = peak_memory_bytes(steps[name], args.device) / 2**20
                results[name][seq_len] = {"ms": median_s * 1e3, "mib": mib, "first_s": first_s}
    except (torch.OutOfMemoryError, RuntimeError) as error:  # the CPU allocator's failure is a RuntimeError
        if (asked := failed_allocation(error)) is None:
            raise
        raise SystemExit(f"error: batch {args.batch_size} x {seq_len} tokens x d_model {args.d_model} needs more "
                         f"memory than {args.device} has{f' (one tensor of {asked})' if asked else ''}; use a "
                         f"smaller --batch-size or --seq-lens") from None
    print_table(results, args)
    plot(results, args, title)
    memory_note = ("torch.cuda.max_memory_allocated" if args.device.type == "cuda"
                   else "PyTorch CPU allocations replayed from the profiler")
    print(f"peak memory: {memory_note}, above what was held before the step")
    if "compiled" in variants:
        print("compile s: the first compiled step, compilation included (not in the medians)")
    print(f"plot saved to {args.out}")


if __name__ == "__main__":
    run_script(main)
