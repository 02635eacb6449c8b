"""Chapter 2's exercises: attention, checked against ``llmscratch.model.attention`` and independent references.

Write it yourself: the causal mask of a chunk appended to a KV cache, splitting a projection into
heads, grouped-query attention, and RoPE with the RoFormer paper's interleaved pairs. Extend the
package: every layer's attention maps of a ``GPT``, then QK-norm and sliding-window attention as
modules that replace a block's attention, with KV-cache decoding still exact.
"""

import copy
import math

import torch
from torch import nn

from llmscratch.exercises.checking import (Chapter, Mismatch, attempt, describe, diagnose, diagnose_nonfinite,
                                           expect_close, expect_equal, fresh_generator, random_bool, random_int,
                                           random_seed)
from llmscratch.exercises.fixtures import build_module, decoded, lm_backward, tiny_gpt, token_ids
from llmscratch.model.attention import MultiHeadAttention, causal_mask, explicit_attention
from llmscratch.model.gpt import GPT
from llmscratch.model.rope import RotaryEmbedding

CHAPTER = Chapter("ch02", "Attention")

WRAPPED_HINT = ("your module changed the MultiHeadAttention it wraps: read its weights (attention.qkv, "
                "attention.out_proj), never replace or modify them")
DECODING_HINTS = {
    "start_pos": "with a KV cache, x's tokens sit at positions start_pos .. start_pos + T - 1: rotate q and k "
                 "there, store k and v at those positions with kv_cache.write(k, v, positions) (it returns the "
                 "whole cache), and hide every key after its query's position",
    "input_pos": "generate's decoding steps pass input_pos, the positions (T,) as a tensor: rotate q and k there, "
                 "store k and v with kv_cache.write(k, v, input_pos) (it returns the whole cache), and hide "
                 "every key after its query's position",
}
NAN_HINT = "your output has NaN: a row of scores was all -inf, so a query saw no key at all; let it see its own"
MODULE_HINT = ("subclass torch.nn.Module (and call super().__init__() first), so that it can replace a block's "
               "attention")


# --------------------------------------------------------------------------- write it yourself
@CHAPTER.exercise("causal_mask", title="The causal mask of a chunk appended to a KV cache", difficulty="warm-up",
                  section="8. Decoding with a KV cache", kind="write it yourself",
                  forbidden=("llmscratch.model.attention.causal_mask",))
def check_causal_mask(answer) -> int:
    cases = [(1, 3), (2, 2), (3, 5), (4, 4), (4, 9)]  # (q_len, kv_len): one new token, a whole sequence, chunks
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(q_len, q_len + random_int(fresh, 0, 8)) for q_len in (random_int(fresh, 1, 8) for _ in range(3))]
    for q_len, kv_len in cases:
        case = f"causal_mask(q_len={q_len}, kv_len={kv_len})"
        got = attempt(answer, q_len, kv_len, case=case)
        expected = causal_mask(q_len, kv_len)
        ones, first_query = torch.ones(q_len, kv_len, dtype=torch.bool), kv_len - q_len
        hint = diagnose(got, {
            "return booleans (dtype torch.bool), not 0/1 numbers: masked_fill and SDPA take a boolean mask":
                lambda: expected.float(),
            "the triangle is aligned top-left: the queries are the LAST q_len of the kv_len positions, so "
            "query i sits at position kv_len - q_len + i": lambda: ones.tril(),
            "True must mark the keys a query MAY look at (its past and itself), not the hidden ones": lambda: ~expected,
            "off by one: a query may look at its own key": lambda: ones.tril(first_query - 1),
            "off by one: the key right after a query is its future, hidden": lambda: ones.tril(first_query + 1),
        }, "row i (the query at position kv_len - q_len + i) is True in columns 0 .. kv_len - q_len + i")
        expect_equal(got, expected, case=case, hint=hint)
    return len(cases)


@CHAPTER.exercise("split_heads", title="Split a projection into heads", difficulty="warm-up",
                  section="4. Multi-head attention", kind="write it yourself")
def check_split_heads(answer) -> int:
    generator, fresh = torch.Generator().manual_seed(2), fresh_generator()
    cases = [(1, 1, 1, 1, generator), (1, 1, 4, 2, generator), (1, 3, 6, 3, generator), (2, 5, 8, 2, generator),
             (3, 4, 12, 4, generator)]  # (B, T, d, n_heads, where x is drawn from)
    for _ in range(3):  # and cases no table of the fixed ones holds
        n_heads = random_int(fresh, 1, 4)
        cases.append((random_int(fresh, 1, 3), random_int(fresh, 1, 6), n_heads * random_int(fresh, 1, 4), n_heads,
                      fresh))
    for batch, seq_len, d, n_heads, source in cases:
        x = torch.randn(batch, seq_len, d, generator=source)
        head_dim = d // n_heads
        case = f"split_heads(x of shape {(batch, seq_len, d)}, n_heads={n_heads})"
        got = attempt(answer, x.clone(), n_heads, case=case)
        hint = diagnose(got, {
            "you reshaped straight to (B, n_heads, T, head_dim), which cuts the numbers in the wrong order: view "
            "as (B, T, n_heads, head_dim) first, then transpose(1, 2)":
                lambda: x.reshape(batch, n_heads, seq_len, head_dim),
            "the head dimension comes before the sequence: transpose(1, 2) after the view":
                lambda: x.view(batch, seq_len, n_heads, head_dim),
            "head h owns the consecutive dimensions h*head_dim .. (h+1)*head_dim - 1, not every n_heads-th one":
                lambda: x.view(batch, seq_len, head_dim, n_heads).permute(0, 3, 1, 2),
        }, "out[b, h, t] must be x[b, t, h*head_dim:(h+1)*head_dim]")
        expect_equal(got, x.view(batch, seq_len, n_heads, head_dim).transpose(1, 2), case=case, hint=hint)
    return len(cases)


def _attention64(q, k, v, *, kv_head=lambda h, group, n_kv: h // group, scale=None, mask=None, softmax_dim=-1):
    """Causal attention in float64 with each ingredient replaceable: how the usual mistakes compute."""
    q, k, v = q.double(), k.double(), v.double()
    heads = [kv_head(h, q.size(1) // k.size(1), k.size(1)) for h in range(q.size(1))]
    k, v = k[:, heads], v[:, heads]  # (B, nh, S, hs)
    scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.size(-1)) if scale is None else scale)  # (B, nh, T, S)
    mask = causal_mask(q.size(-2), k.size(-2)) if mask is None else mask
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=softmax_dim) @ v  # (B, nh, T, hs)


@CHAPTER.exercise("grouped_query_attention", title="Grouped-query attention over a cache", difficulty="medium",
                  section="5. Grouped-query attention", kind="write it yourself",
                  forbidden=("torch.nn.functional.scaled_dot_product_attention",
                             "llmscratch.model.attention.explicit_attention",
                             "llmscratch.model.attention.fused_attention"))
def check_grouped_query_attention(answer) -> int:
    generator, fresh = torch.Generator().manual_seed(5), fresh_generator()
    cases = [(1, 1, 1, 1, 1, 2), (1, 1, 1, 1, 3, 2), (1, 2, 2, 3, 3, 4), (2, 4, 1, 3, 3, 8), (1, 4, 2, 5, 5, 4),
             (2, 6, 3, 2, 7, 4)]  # (B, n_heads, n_kv_heads, T, S, head_dim)
    cases = [(*sizes, generator) for sizes in cases]  # and where q, k, v are drawn from
    for _ in range(3):  # and cases no table of the fixed ones holds
        n_kv, seq_len = random_int(fresh, 1, 3), random_int(fresh, 1, 5)
        cases.append((random_int(fresh, 1, 2), n_kv * random_int(fresh, 1, 3), n_kv, seq_len,
                      seq_len + random_int(fresh, 0, 4), random_int(fresh, 1, 8), fresh))
    for batch, n_heads, n_kv, seq_len, kv_len, head_dim, source in cases:
        q = torch.randn(batch, n_heads, seq_len, head_dim, generator=source)
        k, v = torch.randn(2, batch, n_kv, kv_len, head_dim, generator=source)
        case = (f"q of shape {tuple(q.shape)}, k and v of shape {tuple(k.shape)} "
                f"(group of {n_heads // n_kv}, {kv_len - seq_len} cached positions)")
        got = attempt(answer, q.clone(), k.clone(), v.clone(), case=case)
        hint = diagnose_nonfinite(got, {
            "divide the scores by sqrt(head_dim): without it the softmax is far too peaked":
                lambda: _attention64(q, k, v, scale=1.0),
            "divide the scores by sqrt(head_dim), not by head_dim": lambda: _attention64(q, k, v, scale=1 / head_dim),
            "take the softmax over the keys (dim=-1), so that each query's weights sum to 1":
                lambda: _attention64(q, k, v, softmax_dim=-2),
            "the mask is aligned top-left: the T queries are the LAST T of the S positions (bottom-right, "
            "as causal_mask does)": lambda: _attention64(q, k, v, mask=causal_mask(kv_len, kv_len)[:seq_len]),
            "query head h reads key/value head h // group_size (consecutive query heads share one): "
            "repeat_interleave, not repeat, which gives h % n_kv_heads":
                lambda: _attention64(q, k, v, kv_head=lambda h, group, n_kv: h % n_kv),
        }, "compare with softmax(q k^T / sqrt(head_dim), masked bottom-right) v, query head h reading "
           "key/value head h // (n_heads // n_kv_heads)", hint=NAN_HINT, nan_only=True)
        expect_close(got, explicit_attention(q.double(), k.double(), v.double())[0], case=case, hint=hint)
    return len(cases)


def _rope64(x, start_pos, theta, *, neighbours=True, turn=1.0, exponent_step=2):
    """RoPE as complex multiplication in float64: the pair (a, b) is a + ib, turned by e^(i * position * freq)."""
    head_dim = x.size(-1)
    pairs = x.double().unflatten(-1, (head_dim // 2, 2)) if neighbours else torch.stack(x.double().chunk(2, -1), -1)
    inv_freq = theta ** (-exponent_step * torch.arange(head_dim // 2, dtype=torch.float64) / head_dim)  # (hs/2,)
    positions = torch.arange(start_pos, start_pos + x.size(-2), dtype=torch.float64)  # (T,)
    angles = turn * torch.outer(positions, inv_freq)  # (T, hs/2)
    turns = torch.polar(torch.ones_like(angles), angles)  # (T, hs/2): e^(i * angle)
    turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * turns)  # (..., T, hs/2, 2)
    return turned.flatten(-2) if neighbours else torch.cat(turned.unbind(-1), dim=-1)  # (..., T, hs)


@CHAPTER.exercise("rope_interleaved", title="RoPE with interleaved pairs (the RoFormer convention)",
                  difficulty="medium", section="6. Rotary position embeddings (RoPE)", kind="write it yourself")
def check_rope_interleaved(answer) -> int:
    generator, fresh = torch.Generator().manual_seed(6), fresh_generator()
    cases = [((1, 1, 1, 2), 0, 1e4), ((1, 1, 2, 2), 0, 1e4), ((1, 1, 3, 4), 0, 1e4), ((2, 2, 5, 8), 3, 1e4),
             ((1, 3, 4, 6), 11, 500.0), ((2, 1, 1, 16), 40, 1e4)]  # (shape of x, start_pos, theta)
    cases = [(*case, generator) for case in cases]  # and where x is drawn from
    cases += [((random_int(fresh, 1, 2), random_int(fresh, 1, 3), random_int(fresh, 1, 6), 2 * random_int(fresh, 1, 8)),
               random_int(fresh, 0, 40), float(random_int(fresh, 100, 20_000)), fresh) for _ in range(3)]
    for shape, start_pos, theta, source in cases:
        x = torch.randn(shape, generator=source)
        case = f"rope_interleaved(x of shape {shape}, start_pos={start_pos}, theta={theta:g})"
        got = attempt(answer, x.clone(), start_pos=start_pos, theta=theta, case=case)
        hint = diagnose(got, {
            "that is Llama's rotate-half pairing (i, i + head_dim/2); here pair i is (2i, 2i+1), neighbours":
                lambda: _rope64(x, start_pos, theta, neighbours=False),
            "the pairs turn the wrong way: (a, b) becomes (a cos - b sin, a sin + b cos)":
                lambda: _rope64(x, start_pos, theta, turn=-1.0),
            "pair i turns at theta ** (-2i / head_dim): the exponent counts dimensions (0, 2, 4, ...), not pairs":
                lambda: _rope64(x, start_pos, theta, exponent_step=1),
            "row t of x sits at position start_pos + t: you left out start_pos": lambda: _rope64(x, 0, theta),
            "positions start at start_pos (with start_pos=0 the first row is not turned at all)":
                lambda: _rope64(x, start_pos + 1, theta),
        }, "pair (x[2i], x[2i+1]) of row t turns by the angle (start_pos + t) * theta ** (-2i / head_dim)")
        expect_close(got, _rope64(x, start_pos, theta), case=case, hint=hint)
    # The package's RoPE is the same rotation with the pairs laid out as halves: de-interleave, rotate, re-interleave.
    x = torch.randn(2, 2, 6, 8, generator=generator)
    halves = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])  # dims 0, 2, 4, 6 then 1, 3, 5, 7
    case = "x of shape (2, 2, 6, 8), start_pos=4, against llmscratch.model.rope.RotaryEmbedding on de-interleaved x"
    got = attempt(answer, x.clone(), start_pos=4, theta=1e4, case=case)
    expected = torch.empty_like(x)
    expected[..., halves] = RotaryEmbedding(8, 16)(x[..., halves], 4)
    expect_close(got, expected, case=case, hint="pair (x[2i], x[2i+1]) must turn as the package turns (x[i], x[i + 4])")
    return len(cases) + 1


# --------------------------------------------------------------------------- extend the package
def _tiny_gpt(llama: bool, n_layers: int = 2, seed: int = 0) -> GPT:
    """``fixtures.tiny_gpt``, its attention's projections larger."""
    model = tiny_gpt(llama, seed, n_layers=n_layers)
    with torch.no_grad():  # larger than GPT-2's init, so that the attention weights are far from uniform
        for block in model.blocks:
            block.attn.qkv.weight.normal_(0.0, 0.4)
    return model


def _walk_maps(model: GPT, idx, *, normed=True, rope=True, positions=True, advance=True) -> torch.Tensor:
    """Every layer's attention weights, block by block on a copy: (n_layers, B, nh, T, T)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        x = first = model.token_embedding(idx) + (model.position_embedding(torch.arange(idx.size(1)))
                                                  if positions and model.position_embedding is not None else 0)
        maps = []
        for block in model.blocks:
            block.attn.fused = False
            _, weights = block.attn(block.attn_norm(x) if normed else x, model.rope if rope else None,
                                    need_weights=True)  # (B, nh, T, T)
            maps.append(weights)
            x = block(x, model.rope, None, 0) if advance else first
    return torch.stack(maps)


@CHAPTER.exercise("attention_maps", title="Every layer's attention weights of a GPT", difficulty="medium",
                  section="9. Attention weights of a real sentence", kind="extend the package")
def check_attention_maps(answer) -> int:
    generator, fresh = torch.Generator().manual_seed(9), fresh_generator()
    cases = [(False, 1, 1), (False, 2, 5), (True, 1, 1), (True, 2, 7)]  # (Llama-style?, B, T)
    cases = [(*case, 2, 0, generator) for case in cases]  # and layers, the weights' seed, where idx is drawn from
    cases += [(random_bool(fresh), random_int(fresh, 1, 2), random_int(fresh, 1, 8), random_int(fresh, 1, 2),
               random_seed(fresh), fresh) for _ in range(2)]  # cases no table of the fixed ones holds
    for llama, batch, seq_len, n_layers, seed, source in cases:
        model, idx = _tiny_gpt(llama, n_layers, seed), token_ids((batch, seq_len), source)
        fused = [block.attn.fused for block in model.blocks]
        case = (f"a {n_layers}-layer {'Llama-style' if llama else 'GPT-2'} model"
                f"{'' if seed == 0 else f' (weights seeded {seed})'}, idx of shape {(batch, seq_len)}")
        got = attempt(answer, model, idx, case=case)
        expected = _walk_maps(model, idx)
        hint = diagnose(got, {
            "stack the layers first: (n_layers, B, n_heads, T, T)": lambda: expected.transpose(0, 1),
            "attention reads the block's normed input, block.attn_norm(x), not x itself":
                lambda: _walk_maps(model, idx, normed=False),
            "pass the model's RoPE table (model.rope) to the attention: without it the Llama-style maps ignore "
            "positions": lambda: _walk_maps(model, idx, rope=False),
            "add the position embeddings to the token embeddings (GPT-2 learns one per position)":
                lambda: _walk_maps(model, idx, positions=False),
            "each layer attends over the output of the layer before it, not the embeddings":
                lambda: _walk_maps(model, idx, advance=False),
        }, "layer l's maps are what block l's attention computes, with need_weights=True, during model(idx)")
        expect_close(got, expected, case=case, hint=hint)
        expect_equal([block.attn.fused for block in model.blocks], fused, case=case,
                     hint="put each attention's fused flag back as you found it: the model must run as before")
    return len(cases)


def _build(answer, *args, case: str) -> nn.Module:
    return build_module(answer, *args, case=case, hint=MODULE_HINT, shown=lambda module: f"a {type(module).__name__}")


def _attention_case(index: int, d: int, n_heads: int, n_kv: int, batch: int, seq_len: int, rope: bool,
                    qkv_bias: bool = False):
    """A random MultiHeadAttention, an optional RoPE table, an input x and a label for the case."""
    torch.manual_seed(100 + index)
    attention = MultiHeadAttention(d, d, n_heads, n_kv, qkv_bias=qkv_bias).eval()
    table = RotaryEmbedding(d // n_heads, 16) if rope else None
    x = torch.randn(batch, seq_len, d)
    label = (f"MultiHeadAttention(d={d}, n_heads={n_heads}, n_kv_heads={n_kv}), x of shape {(batch, seq_len, d)}"
             f"{', with RoPE' if rope else ''}")
    return attention, table, x, label


def _fresh_attention_sizes(generator: torch.Generator) -> tuple[int, int, int, int, int, bool]:
    """Random (d, n_heads, n_kv_heads, B, T, RoPE?) of a small MultiHeadAttention: a case no fixed table holds."""
    n_kv = random_int(generator, 1, 2)
    n_heads = n_kv * random_int(generator, 1, 3)
    return (n_heads * 2 * random_int(generator, 1, 3), n_heads, n_kv, random_int(generator, 1, 2),
            random_int(generator, 1, 6), random_bool(generator))


def _project(attention, x):
    """q (B, nh, T, hs), k and v (B, n_kv, T, hs), as MultiHeadAttention projects them."""
    parts = attention.qkv(x).split(attention.qkv_sizes, dim=-1)
    return [t.unflatten(-1, (-1, attention.head_dim)).transpose(1, 2) for t in parts]


def _finish(attention, q, k, v, rope, mask=None):
    """Rotate q and k, attend (explicitly, mask default causal), project out: (B, T, d_out)."""
    if rope is not None:
        q, k = rope(q), rope(k)
    context, _ = explicit_attention(q, k, v, mask=mask)  # (B, nh, T, hs)
    return attention.out_proj(context.transpose(1, 2).flatten(2))


def _check_decoding(model: GPT, idx, prefill_len: int, label: str) -> int:
    """Cached decoding, with positions as ints and as a tensor (generate's way), must give the full pass's logits."""
    with torch.no_grad():
        full = attempt(model, idx, case=f"{label}: one full pass")  # (B, T, V)
        for way, hint in DECODING_HINTS.items():
            case = f"{label}: prefill {prefill_len} tokens, then decode one at a time with {way}"
            got = attempt(decoded, model, idx, prefill_len, tensor_positions=way == "input_pos", case=case)
            expect_close(got, full, case=case, hint=hint)
    return len(DECODING_HINTS)


def _qk_norm64(attention, x, rope, gains, *, per_head=True, keys=True, before_rope=True, mean=True):
    """QK-norm's output for gains (q_gain, k_gain), each usual mistake a switch."""
    def norm(t, gain):  # t (B, heads, T, hs)
        over = t.transpose(1, 2).flatten(2) if not per_head else t  # (B, T, heads*hs): all heads at once
        square = over.pow(2).mean(-1, keepdim=True) if mean else over.pow(2).sum(-1, keepdim=True)
        scale = square.unsqueeze(1) if not per_head else square  # (B, 1, T, 1) or (B, heads, T, 1)
        return gain * t * torch.rsqrt(scale + 1e-5)

    with torch.no_grad():
        q, k, v = _project(attention, x)
        if not before_rope and rope is not None:
            q, k, rope = rope(q), rope(k), None
        q, k = norm(q, gains[0]), norm(k, gains[1]) if keys else k
        return _finish(attention, q, k, v, rope)


def _set_gains(module, head_dim: int, generator, case: str) -> list[torch.Tensor]:
    """Random gains in q_norm.weight and k_norm.weight (checked to start at ones); returns them."""
    gains = []
    for name in ("q_norm", "k_norm"):
        weight = getattr(getattr(module, name, None), "weight", None)
        if not (isinstance(weight, torch.Tensor) and weight.shape == (head_dim,) and (weight == 1).all()):
            raise Mismatch(case, f"{name}.weight: ones of shape ({head_dim},)", describe(weight),
                           f"give your module {name}, e.g. RMSNorm(head_dim): one gain per dimension of a head, "
                           "shared by all heads, starting at 1")
        with torch.no_grad():
            weight.copy_(1 + 0.5 * torch.randn(head_dim, generator=generator))
        gains.append(weight.detach().clone())
    return gains


@CHAPTER.exercise("QKNormAttention", title="QK-norm: RMS-normalise each head's queries and keys", difficulty="hard",
                  section="7. The package version", kind="extend the package")
def check_qk_norm_attention(answer) -> int:
    generator, fresh = torch.Generator().manual_seed(7), fresh_generator()
    cases = [(8, 2, 2, 1, 1, False), (16, 4, 4, 2, 5, True), (16, 4, 1, 1, 6, True), (24, 6, 2, 2, 3, False)]
    # each case's weights' seed first, then the sizes, a bias on qkv?, and where the gains are drawn from
    cases = [(index, *sizes, index == 3, generator) for index, sizes in enumerate(cases)]
    cases += [(random_seed(fresh), *_fresh_attention_sizes(fresh), random_bool(fresh), fresh)
              for _ in range(2)]  # cases no table of the fixed ones holds
    for index, d, n_heads, n_kv, batch, seq_len, rope, qkv_bias, source in cases:
        attention, table, x, case = _attention_case(index, d, n_heads, n_kv, batch, seq_len, rope, qkv_bias=qkv_bias)
        before = attention(x, table)
        module = _build(answer, attention, case=case)
        gains = _set_gains(module, d // n_heads, source, case)
        expected_count = sum(p.numel() for p in attention.parameters()) + 2 * (d // n_heads)
        expect_equal(sum(p.numel() for p in module.parameters()), expected_count, case=case, hint=(
            "your module's parameters must be the wrapped attention's and the two gains: keep `attention`, "
            "q_norm and k_norm as submodules (attributes of an nn.Module) so that they train"))
        got = attempt(module, x, table, case=case)
        hint = diagnose(got, {
            "normalise each head's query and key on its own (over head_dim), not all heads at once (OLMo 2 style)":
                lambda: _qk_norm64(attention, x, table, gains, per_head=False),
            "normalise the keys too (k_norm), not only the queries":
                lambda: _qk_norm64(attention, x, table, gains, keys=False),
            "normalise before RoPE: the gains scale the dimensions of the projection, then the pairs turn":
                lambda: _qk_norm64(attention, x, table, gains, before_rope=False),
            "RMS divides by sqrt(mean of squares), not by the length sqrt(sum of squares)":
                lambda: _qk_norm64(attention, x, table, gains, mean=False),
            "multiply the normalised q and k by the gains q_norm.weight and k_norm.weight":
                lambda: _qk_norm64(attention, x, table, [torch.ones_like(gains[0])] * 2),
        }, "q and k of each head: t * rsqrt(mean(t**2 over head_dim) + eps) * gain, before RoPE")
        expect_close(got, _qk_norm64(attention, x, table, gains), case=case, hint=hint)
        expect_close(attempt(attention, x, table, case=case), before, case=case, hint=WRAPPED_HINT)
    model, idx = _tiny_gpt(llama=True), token_ids((2, 9), generator)
    for block in model.blocks:
        block.attn = _build(answer, block.attn, case="QKNormAttention(block.attn) in a Llama-style GPT")
        _set_gains(block.attn, model.config.head_dim, generator, "QKNormAttention(block.attn) in a Llama-style GPT")
    passed = _check_decoding(model, idx, prefill_len=4, label="a 2-layer Llama-style GPT with QKNormAttention")
    case = "the same GPT: model(idx, targets=...).backward()"
    attempt(lm_backward, model, idx, case=case)
    for block in model.blocks:
        grad = block.attn.q_norm.weight.grad
        if grad is None or not grad.abs().sum() > 0:
            raise Mismatch(case, "a gradient on q_norm.weight in every block", describe(grad),
                           "the gains must be Parameters used in the forward pass, so that training moves them")
    return len(cases) + passed + 1


def _window64(attention, x, rope, window: int, *, causal=True):
    """Sliding-window attention's output: query i sees keys i - window + 1 .. i (both ways if not causal)."""
    distance = torch.arange(x.size(1))[:, None] - torch.arange(x.size(1))  # (T, T): how far back each key is
    mask = (distance >= 0 if causal else distance > -window) & (distance < window)
    with torch.no_grad():
        return _finish(attention, *_project(attention, x), rope, mask=mask)


@CHAPTER.exercise("SlidingWindowAttention", title="Sliding-window attention that plugs into GPT", difficulty="hard",
                  section="8. Decoding with a KV cache", kind="extend the package")
def check_sliding_window_attention(answer) -> int:
    cases = [(8, 2, 2, 1, 1, 1, False), (8, 2, 2, 1, 4, 1, False), (16, 4, 4, 2, 5, 2, True), (16, 4, 1, 1, 7, 3, True),
             (16, 4, 2, 2, 6, 6, True), (16, 4, 2, 1, 5, 50, False)]  # (d, nh, n_kv, B, T, window, RoPE?)
    cases = list(enumerate(cases))  # each case's index seeds its weights
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    for _ in range(2):
        d, n_heads, n_kv, batch, seq_len, rope = _fresh_attention_sizes(fresh)
        cases.append((random_seed(fresh),
                      (d, n_heads, n_kv, batch, seq_len, random_int(fresh, 1, seq_len + 2), rope)))
    for index, (d, n_heads, n_kv, batch, seq_len, window, rope) in cases:
        attention, table, x, label = _attention_case(index, d, n_heads, n_kv, batch, seq_len, rope)
        case = f"window={window}, {label}"
        before = attention(x, table)
        got = attempt(_build(answer, attention, window, case=case), x, table, case=case)
        hint = diagnose_nonfinite(got, {
            "a window of w covers the query's own position and the w - 1 before it: you let one more key in":
                lambda: _window64(attention, x, table, window + 1),
            "a window of w covers the query's own position and the w - 1 before it: you kept one key too few":
                lambda: _window64(attention, x, table, window - 1),
            "the window is still causal: no query sees a key after its own position":
                lambda: _window64(attention, x, table, window, causal=False),
            "the window is ignored: hide the keys more than window - 1 positions back": lambda: before,
        }, "query i sees keys i - window + 1 .. i (those that exist)", hint=NAN_HINT, nan_only=True)
        expect_close(got, _window64(attention, x, table, window), case=case, hint=hint)
        expect_close(attempt(attention, x, table, case=case), before, case=case, hint=WRAPPED_HINT)
    generator = torch.Generator().manual_seed(8)
    model, idx = _tiny_gpt(llama=True, n_layers=1), token_ids((1, 8), generator)
    label = "a 1-layer GPT with SlidingWindowAttention(block.attn, window=3)"
    model.blocks[0].attn = _build(answer, model.blocks[0].attn, 3, case=label)
    with torch.no_grad():
        last = attempt(model, idx, case=label)[:, -1]  # (1, V): position 7 reads positions 5, 6, 7
        for pos, seen in ((4, False), (5, True)):
            changed = idx.clone()
            changed[0, pos] = (changed[0, pos] + 1) % 64
            case = f"{label}: logits at position 7 after changing the token at position {pos}"
            got = attempt(model, changed, case=case)[:, -1]
            if seen and torch.allclose(got, last):
                raise Mismatch(case, "different logits", "the same logits", "position 7 must still see position 5")
            if not seen:
                expect_close(got, last, case=case, hint="position 7 must not see position 4: window 3 reads 5, 6, 7")
    model = _tiny_gpt(llama=True, seed=1)
    for block in model.blocks:
        block.attn = _build(answer, block.attn, 3, case="SlidingWindowAttention(block.attn, 3) in a Llama-style GPT")
    passed = _check_decoding(model, token_ids((2, 9), generator), prefill_len=4,
                             label="a 2-layer Llama-style GPT with SlidingWindowAttention(block.attn, window=3)")
    return len(cases) + 2 + passed
