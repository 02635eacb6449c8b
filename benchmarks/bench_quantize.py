"""Weight-only quantization (llmscratch.model.quantize): what it costs in quality, and what it buys in decoding speed.

    python -m benchmarks.bench_quantize                 # from the repository root; prints a Markdown section
    python -m benchmarks.bench_quantize --quick         # a quarter of the held-out text, fewer tokens and rounds
    python -m benchmarks.bench_quantize --no-torchao    # without the peer

The peer needs `pip install torchao==0.18.0`, not in requirements.txt: once installed, transformers imports it and
its failed CUDA-library loads print to stderr in every notebook that imports transformers (nbval fails on that).

Quality: bits per byte of the bundled model on the held-out tenth of Moby-Dick, in float32 and with
its linear layers quantized (int8 per row; int4 per group, the head int8). Speed: greedy decoding of
the gpt2-small shape (random weights, batch 1, 32-token prompt), each model through
``generate(compile=True)`` (ours multiply by the stored integers in the C kernel of
``llmscratch/kernels/word_product.c``), in interleaved rounds, median tokens/s: float32, our int8 and int4, and
torchao's int8 weight-only model (``quantize_(model, Int8WeightOnlyConfig())``) through the same
compiled step as gpt-fast compiles it (its own linear kernels, not ours). Then the one-row products
alone: x (1, 768) times a gpt2-small MLP weight (3072, 768) by each way there is to compute it.
"""

import argparse
import contextlib
import copy
import importlib.util
import unittest.mock

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import add_threads_flag, load_average, machine_description, median, set_threads, today
from llmscratch.assets import PRETRAINED_PATH
from llmscratch.model import generate as generate_module
from llmscratch.model.checkpoint import model_from_checkpoint, tokenizer_from_checkpoint
from llmscratch.model.config import GPTConfig
from llmscratch.model.generate import generate
from llmscratch.model.gpt import GPT
from llmscratch.model.quantize import (QuantizedLinear, dequantize_int8, native_word_product, quantize, quantize_int8,
                                       to_word_order, word_product)
from llmscratch.profiling import round_robin, time_once
from llmscratch.text.data import held_out_moby_dick
from llmscratch.training.evaluation import evaluate, token_byte_lengths

SCHEMES = [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)]
PROMPT_TOKENS = 32


def quality(fraction: float) -> list[tuple[str, float]]:
    """(label, bits per byte) of the bundled model in float32 and under each scheme."""
    held_out = held_out_moby_dick()
    model, tokenizer = model_from_checkpoint(PRETRAINED_PATH).float().eval(), tokenizer_from_checkpoint(PRETRAINED_PATH)
    ids = np.array(tokenizer.encode(held_out[: int(len(held_out) * fraction)]), dtype=np.int64)
    lengths = token_byte_lengths(tokenizer, model.config.vocab_size)

    def bits(m):
        return evaluate(m, ids, lengths, 16, torch.device("cpu"))["bits_per_byte"]

    rows = [("float32", bits(model))]
    for scheme, group in SCHEMES:
        label = scheme if group is None else f"{scheme}, group {group}"
        rows.append((f"{label}, head int8", bits(quantize(model, scheme, group or 64))))
    rows.append(("int4, group 64, head float32", bits(quantize(model, "int4", 64, head=False))))
    return rows


def torchao_int8(model: GPT) -> GPT:
    """A copy of ``model`` quantized by torchao: int8 weight-only, per output channel, every linear layer."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    theirs = copy.deepcopy(model)
    theirs.lm_head = torch.nn.Linear(theirs.config.d_model, theirs.config.vocab_size, bias=False)  # untied, as ours
    theirs.lm_head.weight.data.copy_(model.lm_head.weight.data)
    quantize_(theirs, Int8WeightOnlyConfig())
    return theirs.eval()


@contextlib.contextmanager
def library_linears():
    """The compiled step as gpt-fast compiles it: every F.linear left to the library (torchao's own kernels)."""
    with unittest.mock.patch.object(generate_module, "_decode_one_token_as_plain_math", generate_module.decode_one_token):
        generate_module._compile_decode_one_token.cache_clear()
        try:
            yield
        finally:
            generate_module._compile_decode_one_token.cache_clear()


def decoding(new_tokens: int, rounds: int, peer: bool) -> tuple[dict[str, float], dict[str, int], float]:
    """Median tokens/s of each model; how many greedy tokens each shares with float32; float32's MB read a token."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, context_length=1024, d_model=768, n_layers=12, n_heads=12)).eval()
    idx = torch.randint(50257, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))
    models = {"float32": model, "int8": quantize(model, "int8"), "int4, group 64": quantize(model, "int4", 64),
              "int4, group 128": quantize(model, "int4", 128)}
    decoders = {name: (lambda m=m: generate(m, idx, new_tokens, compile=True)) for name, m in models.items()}
    if peer:
        theirs = torchao_int8(model)

        def torchao_decode():
            with library_linears():
                return generate(theirs, idx, new_tokens, compile=True)

        decoders["torchao int8 weight-only"] = torchao_decode
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(decoders))
    outputs = {name: decode() for name, decode in decoders.items()}  # compiled here, before the timed rounds
    per_round = round_robin({name: lambda d=decode: new_tokens / time_once(d) for name, decode in decoders.items()},
                            rounds)
    shared = {name: int((out[0, PROMPT_TOKENS:] == outputs["float32"][0, PROMPT_TOKENS:]).cumprod(0).sum())
              for name, out in outputs.items()}
    fp32_mb = sum(p.numel() for p in model.parameters()) * 4 / 1e6
    return {name: median(rates) for name, rates in per_round.items()}, shared, fp32_mb


def products(rounds: int) -> dict[str, float]:
    """Median microseconds of each way to compute one row times the weight."""
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(1, 768, generator=generator), torch.randn(3072, 768, generator=generator)
    q, scales = quantize_int8(weight)
    layer = QuantizedLinear(torch.nn.Linear(768, 3072, bias=False), "int8")
    with torch.no_grad():
        layer.qweight.copy_(to_word_order(q, 4))
        layer.scales.copy_(scales)
    int4 = QuantizedLinear(torch.nn.Linear(768, 3072, bias=False), "int4", 64)
    multiply_sum = torch.compile(lambda x, q, s: (x[:, None, :] * q.to(x.dtype)).sum(-1) * s, dynamic=False)
    fp32_sum = torch.compile(lambda x, w: (x[:, None, :] * w).sum(-1), dynamic=False)
    words8 = torch.compile(lambda x: word_product(x, layer.qweight, layer.scales, "int8"), dynamic=False)
    words4 = torch.compile(lambda x: word_product(x, int4.qweight, int4.scales, "int4"), dynamic=False)
    if not (layer.native and int4.native):
        raise SystemExit("the C kernel of llmscratch/kernels/word_product.c could not be built here (see the warning)")

    def native8(x):
        return native_word_product(x, layer.qweight, layer.scales, "int8", 0)

    def native4(x):
        return native_word_product(x, int4.qweight, int4.scales, "int4", 64)

    ways = {"float32 F.linear": lambda: F.linear(x, weight),
            "float32 multiply-and-sum, compiled (the float32 decoding step's)": lambda: fp32_sum(x, weight),
            "int8: dequantize, then F.linear": lambda: F.linear(x, dequantize_int8(q, scales)),
            "int8: torch._weight_int8pack_mm": lambda: torch._weight_int8pack_mm(x, q, scales),
            "int8: multiply-and-sum of the int8 matrix, compiled": lambda: multiply_sum(x, q, scales),
            "int8: word product in PyTorch, compiled": lambda: words8(x),
            "int8: word product, C kernel (ours; what the layer runs)": lambda: native8(x),
            "int4, group 64: word product in PyTorch, compiled": lambda: words4(x),
            "int4, group 64: word product, C kernel (ours; what the layer runs)": lambda: native4(x)}
    expected = F.linear(x, dequantize_int8(q, scales))
    for name, way in ways.items():  # the int8 ways give the same product; each warm (compiled) before timing
        result = way()
        if name.startswith("int8"):
            torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-3, msg=name)
    for way in (words4, native4):
        torch.testing.assert_close(way(x), F.linear(x, int4.weight), rtol=1e-4, atol=1e-3)
    per_round = round_robin({name: lambda way=way: median([time_once(way) for _ in range(50)])
                             for name, way in ways.items()}, rounds)
    return {name: 1e6 * median(times) for name, times in per_round.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the held-out text, 50 tokens, 3 rounds")
    parser.add_argument("--no-torchao", action="store_true", help="leave out the torchao peer")
    add_threads_flag(parser)
    args = parser.parse_args()
    set_threads(parser, args.threads)
    peer = not args.no_torchao and importlib.util.find_spec("torchao") is not None
    new_tokens, rounds = (50, 3) if args.quick else (100, 5)
    rows = quality(0.25 if args.quick else 1.0)
    rates, shared, fp32_mb = decoding(new_tokens, rounds, peer)
    times = products(3 if args.quick else 9)
    flags = " ".join(flag for flag, on in (("--quick", args.quick), ("--no-torchao", args.no_torchao)) if on)
    print("### Weight-only quantization\n")
    print(f"`python -m benchmarks.bench_quantize{' ' + flags if flags else ''}`, {today()}, {machine_description()}; "
          f"load {load_average()}" + ("" if peer else "; torchao not installed, no peer") + "\n")
    print("| model (bundled llama-mini) | held-out bits per byte | vs float32 |\n|---|---|---|")
    for label, bits in rows:
        print(f"| {label} | {bits:.4f} | {bits - rows[0][1]:+.4f} |")
    print(f"\nGreedy decoding, gpt2-small shape (random weights; float32 reads {fp32_mb:.0f} MB a token), batch 1, "
          f"{PROMPT_TOKENS}-token prompt, {new_tokens} new tokens, `generate(compile=True)`, median of {rounds} "
          f"interleaved rounds:\n")
    print("| model | tokens/s | vs float32 | greedy tokens equal to float32's before the first difference |\n"
          "|---|---|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} | {rate / rates['float32']:.2f}x | {shared[name]} of {new_tokens} |")
    if peer:
        print(f"\nint8 (ours) vs torchao int8: {rates['int8'] / rates['torchao int8 weight-only']:.2f}x")
    print("\n| one-row product, (1, 768) x (3072, 768) | median µs | vs float32 F.linear |\n|---|---|---|")
    base = times["float32 F.linear"]
    for name, micros in times.items():
        print(f"| {name} | {micros:.0f} | {micros / base:.2f}x |")


if __name__ == "__main__":
    main()
