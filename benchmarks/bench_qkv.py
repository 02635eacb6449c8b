"""Fused qkv or separate q, k, v projections: a training step and KV-cache decoding, side by side.

    python -m benchmarks.bench_qkv            # from the repository root; prints a Markdown section
    python -m benchmarks.bench_qkv --quick    # 6x384 training only, fewer rounds, 50 new tokens, no compile

llmscratch's ``MultiHeadAttention`` projects x once with a ``qkv`` Linear and splits the result;
torchtitan and nanochat run three Linears, one feeding each of q, k and v. The variant here
(``SeparateQKV``) does that with exactly the rows of ``qkv.weight`` (and bias), so both models compute
the same function (logits and greedy tokens asserted) and only the projections differ. Training: one
forward + backward + AdamW step (``bench_train``'s step, fp32 eager) at ``bench_train``'s default
shapes. Decoding: ``generate`` with the KV cache at ``bench_generate``'s default sizes (gpt2-small
shape, batch 1, a 32-token prompt, 200 new tokens, greedy), eager and ``compile=True``. The two
models alternate within each round (which goes first swaps every round), so a busy spell of a
shared machine hits both; the per-round ratio separate / fused cancels most of the drift.
"""

import argparse
import copy
import sys
from collections.abc import Callable

import torch
from torch import nn

from benchmarks.bench_train import SHAPES, build, make_step
from benchmarks.common import add_threads_flag, load_average, machine_description, median, set_threads, today
from llmscratch.model.attention import KVCache, MultiHeadAttention, fused_attention, positions_mask
from llmscratch.model.config import GPTConfig
from llmscratch.model.generate import generate
from llmscratch.model.gpt import GPT
from llmscratch.model.rope import RotaryEmbedding
from llmscratch.profiling import time_once

VARIANTS = ("fused", "separate")


class SeparateQKV(nn.Module):
    """``MultiHeadAttention`` (fused kernel) with q, k, v from three Linears holding the rows of its ``qkv``."""

    def __init__(self, attn: MultiHeadAttention):
        super().__init__()
        if not attn.fused:
            raise ValueError("SeparateQKV measures the fused (SDPA) path only")
        self.d_out, self.n_heads, self.n_kv_heads = attn.d_out, attn.n_heads, attn.n_kv_heads
        self.head_dim, self.dropout = attn.head_dim, attn.dropout
        self.q_proj, self.k_proj, self.v_proj = (
            nn.Linear(attn.qkv.in_features, size, bias=attn.qkv.bias is not None) for size in attn.qkv_sizes)
        with torch.no_grad():  # qkv's rows are [queries | keys | values]
            for proj, weight in zip((self.q_proj, self.k_proj, self.v_proj), attn.qkv.weight.split(attn.qkv_sizes)):
                proj.weight.copy_(weight)
            for proj, bias in zip((self.q_proj, self.k_proj, self.v_proj),
                                  () if attn.qkv.bias is None else attn.qkv.bias.split(attn.qkv_sizes)):
                proj.bias.copy_(bias)
        self.out_proj, self.q_norm, self.k_norm = attn.out_proj, attn.q_norm, attn.k_norm

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding | None = None, kv_cache: KVCache | None = None,
                start_pos: int = 0, need_weights: bool = False, *,
                input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """``MultiHeadAttention.forward``'s arguments and result (need_weights unsupported: fused path)."""
        batch_size, seq_len, _ = x.shape
        q = self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(1, 2)  # (B, n_kv, T, hs)
        v = self.v_proj(x).unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(1, 2)  # (B, n_kv, T, hs)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = rope(q, start_pos, positions=input_pos), rope(k, start_pos, positions=input_pos)
        mask = None
        if kv_cache is not None:  # written at x's positions, read whole, masked to the positions up to each query's
            if input_pos is None:
                input_pos = torch.arange(start_pos, start_pos + seq_len, device=x.device)  # (T,)
            k, v = kv_cache.write(k, v, input_pos)  # (B, n_kv, S, hs)
            mask = positions_mask(input_pos, k.size(-2))  # (T, S)
        context = fused_attention(q, k, v, self.dropout if self.training else 0.0, mask)  # (B, nh, T, hs)
        return self.out_proj(context.transpose(1, 2).reshape(batch_size, seq_len, self.d_out))  # (B, T, d_out)


def with_separate_qkv(model: GPT) -> GPT:
    """A copy of model whose attention layers are ``SeparateQKV``: the same weights, three projections."""
    variant = copy.deepcopy(model)
    for block in variant.blocks:
        block.attn = SeparateQKV(block.attn)
    return variant


def same_logits(models: dict[str, GPT], idx: torch.Tensor) -> float:
    """The largest difference between the variants' logits for idx (B, T); asserts they are allclose."""
    with torch.no_grad():
        fused, separate = (models[name](idx) for name in VARIANTS)  # (B, T, V)
    difference = (fused - separate).abs().max().item()
    assert torch.allclose(fused, separate, rtol=1e-4, atol=1e-4), f"logits differ by up to {difference}"
    return difference


def alternating_rounds(candidates: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each candidate a round; the order reverses every other round, so neither always goes first."""
    names, seconds = list(candidates), {name: [] for name in candidates}
    for round_index in range(rounds):
        for name in names if round_index % 2 == 0 else reversed(names):
            seconds[name].append(time_once(candidates[name]))
        print(f"  round {round_index + 1}/{rounds}: " + ", ".join(f"{n} {seconds[n][-1]:.2f} s" for n in names),
              file=sys.stderr, flush=True)
    return seconds


def summary(seconds: dict[str, list[float]], work: int) -> dict:
    """Rates (work per second): median, min and max of each variant, and the per-round ratio separate / fused."""
    rates = {name: sorted(work / s for s in values) for name, values in seconds.items()}
    ratios = sorted(fused / separate for fused, separate in zip(seconds["fused"], seconds["separate"]))
    return {"rates": {name: (median(r), r[0], r[-1]) for name, r in rates.items()},
            "ratio": (median(ratios), ratios[0], ratios[-1]), "runs": len(ratios)}


def measure_training(name: str, args) -> dict:
    """One fp32 eager training step of each variant at bench_train's shape ``name``, in alternating rounds."""
    shape = SHAPES[name]
    generator = torch.Generator().manual_seed(args.seed)
    inputs = torch.randint(shape.vocab_size, (shape.batch_size, shape.context_length), generator=generator)
    targets = torch.roll(inputs, -1, dims=1)
    fused = build("llmscratch", shape, shape.vocab_size, args.seed)
    models = {"fused": fused, "separate": with_separate_qkv(fused)}
    difference = same_logits(models, inputs[:, :64])
    steps = {}
    for variant, model in models.items():
        steps[variant] = make_step("llmscratch", model.train(), torch.float32, False, inputs, targets)
        steps[variant]()  # warm-up: first-call allocations, AdamW state
    print(f"training {name}:", file=sys.stderr, flush=True)
    result = summary(alternating_rounds(steps, args.runs), shape.batch_size * shape.context_length)
    return {**result, "difference": difference, "shape": shape}


def measure_decoding(args) -> dict:
    """Greedy decoding tokens/s of each variant, gpt2-small shape, eager then compiled, in alternating rounds."""
    torch.manual_seed(args.seed)
    fused = GPT(GPTConfig.from_preset("gpt2-small")).eval()
    models = {"fused": fused, "separate": with_separate_qkv(fused).eval()}
    idx = torch.randint(fused.config.vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    results = {"difference": same_logits(models, idx)}
    for mode, compile in {"eager": False, "compiled": True}.items():
        if compile and args.no_compile:
            continue
        decoders = {variant: lambda model=model: generate(model, idx, args.new_tokens, compile=compile)
                    for variant, model in models.items()}
        tokens, first = {}, {}
        for variant, decode in decoders.items():  # warm-up; compiles the decoding step when compiled
            first[variant] = time_once(lambda: tokens.__setitem__(variant, decode()))
        assert torch.equal(tokens["fused"], tokens["separate"]), f"greedy tokens differ ({mode})"
        print(f"decoding, {mode}:", file=sys.stderr, flush=True)
        results[mode] = {**summary(alternating_rounds(decoders, args.runs), args.new_tokens), "first_s": first}
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--configs", nargs="+", choices=sorted(SHAPES), default=None,
        help="bench_train shapes to train (default: 6x384 and gpt2-small; --quick: 6x384)")
    add("--runs", type=int, default=None, help="alternating rounds per measurement (default 4; --quick: 2)")
    add("--prompt-tokens", type=int, default=32, help="decoding prompt length, batch 1 (default 32)")
    add("--new-tokens", type=int, default=None, help="tokens generated per call (default 200; --quick: 50)")
    add("--no-compile", action="store_true", help="skip compile=True decoding (two compilations, about a minute each)")
    add("--quick", action="store_true", help="a look in about a minute: the defaults marked --quick above")
    add_threads_flag(parser)
    add("--seed", type=int, default=0, help="seed of the weights and the batch")
    args = parser.parse_args()
    defaults = {"configs": ["6x384"], "runs": 2, "new_tokens": 50} if args.quick else \
        {"configs": ["6x384", "gpt2-small"], "runs": 4, "new_tokens": 200}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.no_compile = args.no_compile or args.quick
    for name in ("runs", "prompt_tokens", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.prompt_tokens + args.new_tokens > 1024:
        parser.error(f"the prompt and new tokens must fit gpt2-small's 1024 positions; got "
                     f"{args.prompt_tokens} + {args.new_tokens}")
    set_threads(parser, args.threads)
    return args


def main() -> None:
    args = parse_args()
    load_before = load_average()
    training = {name: measure_training(name, args) for name in args.configs}
    decoding = measure_decoding(args)
    print_section(args, training, decoding, load_before, load_average())


def row(label: str, result: dict, unit: str) -> str:
    """A table row: each variant's median (min-max) rate, and the ratio separate / fused (min-max)."""
    cells = [f"{m:,.1f} ({lo:,.1f}-{hi:,.1f})" for m, lo, hi in (result["rates"][v] for v in VARIANTS)]
    ratio, low, high = result["ratio"]
    return f"| {label} | {unit} | {result['runs']} | {cells[0]} | {cells[1]} | {ratio:.3f} ({low:.3f}-{high:.3f}) |"


def print_section(args, training: dict, decoding: dict, load_before: str, load_after: str) -> None:
    print(f"### Fused qkv vs separate q, k, v ({today()})\n")
    print(f"Command: `{' '.join(['python -m benchmarks.bench_qkv', *sys.argv[1:]])}`  ")
    print(f"Machine: {machine_description()}  ")
    print(f"Load average (1, 5, 15 min) before: {load_before}; after: {load_after}  ")
    print(f"Fused: llmscratch `GPT` as it is (one `qkv` Linear, split). Separate: a copy whose attention runs "
          f"three Linears holding `qkv`'s rows (`SeparateQKV` in the script); same logits (largest difference "
          f"{max(r['difference'] for r in [*training.values(), decoding]):.1e}) and greedy tokens (asserted). "
          f"{args.runs} alternating rounds after one warm-up call each; medians, with the range (min-max) in "
          f"brackets. Ratio: separate's rate over fused's, per round (each round's two calls ran back to back).\n")
    print("| what | unit | rounds | fused | separate | ratio separate / fused |")
    print("|---|---|---:|---:|---:|---:|")
    for name, result in training.items():
        shape = result["shape"]
        print(row(f"training step {name} (batch {shape.batch_size} x {shape.context_length}, fp32 eager, AdamW)",
                  result, "tokens/s"))
    for mode in ("eager", "compiled"):
        if mode in decoding:
            label = "`generate`" if mode == "eager" else "`generate(compile=True)`"
            print(row(f"decoding gpt2-small, {label}, KV cache, {args.prompt_tokens} + {args.new_tokens} tokens",
                      decoding[mode], "tokens/s"))
    if "compiled" in decoding:
        first = decoding["compiled"]["first_s"]
        print(f"\nFirst compiled call (compilation included, not in the medians): fused {first['fused']:.0f} s, "
              f"separate {first['separate']:.0f} s.")


if __name__ == "__main__":
    main()
