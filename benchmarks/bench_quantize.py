"""Weight-only quantization (llmscratch.quantize): what it costs in quality, and one-row product times.

    python -m benchmarks.bench_quantize            # from the repository root; prints a Markdown section
    python -m benchmarks.bench_quantize --quick    # a quarter of the held-out text, 3 rounds

Quality: bits per byte of the bundled model on the held-out tenth of Moby-Dick, in float32 and with
its blocks' linear layers quantized (int8 per row; int4 per group). Speed: the matrix-vector product
of decoding one token, x (1, 768) times a gpt2-small MLP weight (3072, 768), in float32 with F.linear
beside the int8 ways to compute it (the module's dequantize-then-multiply, PyTorch's CPU int8
weight-only kernel, and an int8 multiply-and-sum through torch.compile), round robin, median.
"""

import argparse

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import add_threads_flag, load_average, machine_description, median, set_threads, today
from llmscratch.assets import PRETRAINED_PATH, read_moby_dick
from llmscratch.checkpoint import model_from_checkpoint, tokenizer_from_checkpoint
from llmscratch.evaluation import evaluate, token_byte_lengths
from llmscratch.profiling import round_robin, time_once
from llmscratch.quantize import dequantize_int8, quantize, quantize_int8

SCHEMES = [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)]


def quality(fraction: float) -> list[tuple[str, float]]:
    """(label, bits per byte) of the bundled model in float32 and under each scheme."""
    text = read_moby_dick()
    held_out = text[int(len(text) * 0.9) :]
    model, tokenizer = model_from_checkpoint(PRETRAINED_PATH).float().eval(), tokenizer_from_checkpoint(PRETRAINED_PATH)
    ids = np.array(tokenizer.encode(held_out[: int(len(held_out) * fraction)]), dtype=np.int64)
    lengths = token_byte_lengths(tokenizer, model.config.vocab_size)

    def bits(m):
        return evaluate(m, ids, lengths, 16, torch.device("cpu"))["bits_per_byte"]

    rows = [("float32", bits(model))]
    for scheme, group in SCHEMES:
        label = scheme if group is None else f"{scheme}, group {group}"
        rows.append((label, bits(quantize(model, scheme, group or 64))))
    return rows


def products(rounds: int) -> dict[str, float]:
    """Median microseconds of each way to compute one row times the weight."""
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(1, 768, generator=generator), torch.randn(3072, 768, generator=generator)
    q, scales = quantize_int8(weight)
    multiply_sum = torch.compile(lambda x, q, s: (x[:, None, :] * q.to(x.dtype)).sum(-1) * s, dynamic=False)
    ways = {"float32 F.linear": lambda: F.linear(x, weight),
            "int8: dequantize, then F.linear (QuantizedLinear)": lambda: F.linear(x, dequantize_int8(q, scales)),
            "int8: torch._weight_int8pack_mm": lambda: torch._weight_int8pack_mm(x, q, scales),
            "int8: multiply-and-sum, compiled": lambda: multiply_sum(x, q, scales)}
    expected = F.linear(x, dequantize_int8(q, scales))
    for name, way in ways.items():  # the int8 ways give the same product; each warm (compiled) before timing
        result = way()
        if name.startswith("int8"):
            torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-3, msg=name)
    per_round = round_robin({name: lambda way=way: median([time_once(way) for _ in range(50)])
                             for name, way in ways.items()}, rounds)
    return {name: 1e6 * median(times) for name, times in per_round.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the held-out text, 3 rounds")
    add_threads_flag(parser)
    args = parser.parse_args()
    set_threads(parser, args.threads)
    rows, times = quality(0.25 if args.quick else 1.0), products(3 if args.quick else 9)
    print("### Weight-only quantization\n")
    print(f"`python -m benchmarks.bench_quantize{' --quick' if args.quick else ''}`, {today()}, "
          f"{machine_description()}; load {load_average()}\n")
    print("| model (bundled llama-mini) | held-out bits per byte | vs float32 |\n|---|---|---|")
    for label, bits in rows:
        print(f"| {label} | {bits:.4f} | {bits - rows[0][1]:+.4f} |")
    print("\n| one-row product, (1, 768) x (3072, 768) | median µs | vs float32 F.linear |\n|---|---|---|")
    base = times["float32 F.linear"]
    for name, micros in times.items():
        print(f"| {name} | {micros:.0f} | {micros / base:.2f}x |")


if __name__ == "__main__":
    main()
