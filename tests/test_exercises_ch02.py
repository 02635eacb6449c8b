"""Chapter 2's exercise checks: the worked answers pass, plausible wrong answers fail with the right hint."""

import math

import torch
from exercise_suite import ExerciseSuite, solutions

from llmscratch.exercises import ch02
from llmscratch.model.rope import RotaryEmbedding

sol = solutions(ch02)


def verdict(answer, name):
    return ch02.CHAPTER.check(answer, name, quiet=True)


# --------------------------------------------------------------------------- wrong answers
def textbook_gqa(q, k, v, *, repeat=torch.repeat_interleave, scale=True, top_left=False, strict=False,
                 softmax_dim=-1):
    """Grouped-query attention as a first attempt often writes it, each usual slip a switch."""
    group_size = q.size(1) // k.size(1)
    k, v = repeat(k, group_size, 1), repeat(v, group_size, 1)
    scores = q @ k.transpose(-2, -1) / (math.sqrt(q.size(-1)) if scale else 1.0)
    diagonal = (0 if top_left else k.size(2) - q.size(2)) - strict  # strict: a query may not see itself
    mask = torch.ones(q.size(2), k.size(2), dtype=torch.bool).tril(diagonal)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=softmax_dim) @ v


def repeat_heads(t, times, dim):
    return t.repeat(1, times, 1, 1)  # heads 0, 1, 0, 1, ... instead of 0, 0, 1, 1, ...


def swap_pairs(x):
    return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


def maps_variant(model, idx, *, block_input=False, rope=True, restore=True, layer_dim=0):
    """attention_maps with one slip: the block's input instead of its normed input, no RoPE, fused left off, ..."""
    inputs = []
    modules = [block if block_input else block.attn for block in model.blocks]
    hooks = [m.register_forward_pre_hook(lambda module, args: inputs.append(args[0])) for m in modules]
    with torch.no_grad():
        model(idx)
    for hook in hooks:
        hook.remove()
    maps = []
    for block, x in zip(model.blocks, inputs):
        fused, block.attn.fused = block.attn.fused, False
        with torch.no_grad():
            maps.append(block.attn(x, model.rope if rope else None, need_weights=True)[1])
        if restore:
            block.attn.fused = fused
    return torch.stack(maps, dim=layer_dim)


class QKNormVariant(sol.QKNormAttention):
    """QK-norm with one slip, chosen by the class attribute `slip`."""

    slip = ""

    def forward(self, x, rope=None, kv_cache=None, start_pos=0, *, input_pos=None):
        a = self.attention
        q, k, v = a.qkv(x).split(a.qkv_sizes, dim=-1)
        if self.slip == "whole vector":
            q, k = (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) for t in (q, k))
        q, k, v = sol.split_heads(q, a.n_heads), sol.split_heads(k, a.n_kv_heads), sol.split_heads(v, a.n_kv_heads)
        if self.slip == "after rope" and rope is not None:
            q, k, rope = rope(q, start_pos), rope(k, start_pos), None
        if self.slip == "whole vector":
            q, k = q * self.q_norm.weight, k * self.k_norm.weight
        else:
            q, k = self.q_norm(q), k if self.slip == "queries only" else self.k_norm(k)
        if self.slip == "no input_pos":
            input_pos = None
        return sol.attend(a, q, k, v, rope, kv_cache, start_pos, input_pos)


def qk_norm_with(slip):
    return type("QKNormAttention", (QKNormVariant,), {"slip": slip})


class WindowFromChunk(sol.SlidingWindowAttention):
    """Sliding window built from the chunk's own positions 0..T-1, as if nothing were cached."""

    def forward(self, x, rope=None, kv_cache=None, start_pos=0, *, input_pos=None):
        a = self.attention
        q, k, v = (sol.split_heads(t, n) for t, n in zip(a.qkv(x).split(a.qkv_sizes, dim=-1),
                                                          (a.n_heads, a.n_kv_heads, a.n_kv_heads)))
        if rope is not None:
            q, k = rope(q, start_pos), rope(k, start_pos)
        if kv_cache is not None:
            k, v = kv_cache.write(k, v, torch.arange(start_pos, start_pos + x.size(1)))
        distance = torch.arange(x.size(1))[:, None] - torch.arange(k.size(-2))  # wrong once keys are cached
        mask = (distance >= 0) & (distance < self.window)
        context = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return a.out_proj(context.transpose(1, 2).flatten(2))


def window_plus(extra):
    return lambda attention, window: sol.SlidingWindowAttention(attention, None if extra is None else window + extra)


WRONG = [  # (exercise, wrong answer, the smallest failing input it must report, the hint it must get)
    ("causal_mask", lambda q, kv: torch.ones(q, kv, dtype=torch.bool).tril(), "q_len=1, kv_len=3", "aligned top-left"),
    ("causal_mask", lambda q, kv: ~sol.causal_mask(q, kv), "q_len=1, kv_len=3", "True must mark the keys"),
    ("causal_mask", lambda q, kv: torch.ones(q, kv, dtype=torch.bool).tril(kv - q - 1), "q_len=1, kv_len=3",
     "a query may look at its own key"),
    ("causal_mask", lambda q, kv: sol.causal_mask(q, kv).float(), "q_len=1, kv_len=3", "return booleans"),
    ("split_heads", lambda x, n: x.reshape(x.size(0), n, x.size(1), -1), "shape (1, 3, 6)", "cuts the numbers"),
    ("split_heads", lambda x, n: x.view(x.size(0), x.size(1), n, -1), "shape (1, 1, 4)", "transpose(1, 2) after"),
    ("split_heads", lambda x, n: x.view(x.size(0), x.size(1), -1, n).permute(0, 3, 1, 2), "shape (1, 1, 4)",
     "consecutive dimensions"),
    ("grouped_query_attention", lambda q, k, v: textbook_gqa(q, k, v, repeat=repeat_heads), "group of 2",
     "repeat_interleave, not repeat"),
    ("grouped_query_attention", lambda q, k, v: textbook_gqa(q, k, v, scale=False), "q of shape (1, 1, 1, 2), "
     "k and v of shape (1, 1, 3, 2)", "divide the scores by sqrt(head_dim): without it"),
    ("grouped_query_attention", lambda q, k, v: textbook_gqa(q, k, v, top_left=True), "(1, 1, 3, 2)",
     "aligned top-left"),
    ("grouped_query_attention", lambda q, k, v: textbook_gqa(q, k, v, softmax_dim=-2), "(1, 1, 3, 2)",
     "softmax over the keys"),
    ("grouped_query_attention", lambda q, k, v: textbook_gqa(q, k, v, strict=True),
     "(1, 1, 1, 2), k and v of shape (1, 1, 1, 2)", "a query saw no key at all"),
    ("rope_interleaved", lambda x, start_pos=0, theta=1e4: RotaryEmbedding(x.size(-1), start_pos + x.size(-2), theta)(
        x, start_pos), "shape (1, 1, 3, 4)", "Llama's rotate-half"),
    ("rope_interleaved", lambda x, start_pos=0, theta=1e4: swap_pairs(sol.rope_interleaved(swap_pairs(x), start_pos,
                                                                                           theta)),
     "shape (1, 1, 2, 2)", "the wrong way"),
    ("rope_interleaved", lambda x, start_pos=0, theta=1e4: sol.rope_interleaved(x, start_pos, theta ** 0.5),
     "shape (1, 1, 3, 4)", "counts dimensions"),
    ("rope_interleaved", lambda x, start_pos=0, theta=1e4: sol.rope_interleaved(x, 0, theta), "start_pos=3",
     "left out start_pos"),
    ("attention_maps", lambda model, idx: maps_variant(model, idx, block_input=True),
     "GPT-2 model, idx of shape (2, 5)", "normed input"),
    ("attention_maps", lambda model, idx: maps_variant(model, idx, rope=False),
     "Llama-style model, idx of shape (2, 7)", "model.rope"),
    ("attention_maps", lambda model, idx: maps_variant(model, idx, restore=False), "GPT-2 model, idx of shape (1, 1)",
     "fused flag back"),
    ("attention_maps", lambda model, idx: maps_variant(model, idx, layer_dim=1), "idx of shape (1, 1)", "layers first"),
    ("QKNormAttention", qk_norm_with("whole vector"), "n_heads=4, n_kv_heads=4",
     "each head's query and key on its own"),
    ("QKNormAttention", qk_norm_with("queries only"), "n_heads=4, n_kv_heads=4", "the keys too"),
    ("QKNormAttention", qk_norm_with("after rope"), "with RoPE", "normalise before RoPE"),
    ("QKNormAttention", qk_norm_with("no input_pos"), "decode one at a time with input_pos", "kv_cache.write"),
    ("SlidingWindowAttention", window_plus(1), "window=1, MultiHeadAttention(d=8, n_heads=2, n_kv_heads=2), x of "
     "shape (1, 4, 8)", "you let one more key in"),
    ("SlidingWindowAttention", window_plus(None), "window=1, MultiHeadAttention(d=8, n_heads=2, n_kv_heads=2), x of "
     "shape (1, 4, 8)", "the window is ignored"),
    ("SlidingWindowAttention", WindowFromChunk, "then decode one at a time with start_pos", "kv_cache.write"),
]


class TestChapter2(ExerciseSuite):
    chapter, folder, wrong = ch02, "ch02-attention", WRONG


# --------------------------------------------------------------------------- chapter 2 only
def test_a_wrong_answer_that_is_no_module_or_raises_is_a_verdict_not_a_traceback():
    assert "subclass torch.nn.Module" in verdict(lambda attention, window: "a string", "SlidingWindowAttention").detail
    assert "ZeroDivisionError" in verdict(lambda model, idx: 1 / 0, "attention_maps").detail
