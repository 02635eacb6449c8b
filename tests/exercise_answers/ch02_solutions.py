"""Worked answers to chapter 2's exercises, word for word the answer cells of ch02-attention/solutions.ipynb.

Each ``# %%`` line starts one cell (the percent format that editors run as notebook cells);
``python -m llmscratch.exercises ch02 tests/exercise_answers/ch02_solutions.py`` passes every row.
"""

# %% imports
import math

import torch
import torch.nn.functional as F
from torch import nn

from llmscratch.model.norm import RMSNorm


# %% causal_mask
def causal_mask(q_len, kv_len):
    """(q_len, kv_len) booleans, True where a query may look at a key; the queries are the last q_len positions."""
    query_positions = torch.arange(kv_len - q_len, kv_len)  # (q_len,)
    key_positions = torch.arange(kv_len)  # (kv_len,)
    return key_positions <= query_positions[:, None]  # (q_len, kv_len): a key at or before its query

# %% split_heads
def split_heads(x, n_heads):
    """(B, T, n_heads * head_dim) -> (B, n_heads, T, head_dim); head h owns dims h*head_dim .. (h+1)*head_dim - 1."""
    batch, seq_len, d = x.shape
    return x.view(batch, seq_len, n_heads, d // n_heads).transpose(1, 2)  # (B, nh, T, hs)

# %% grouped_query_attention
def grouped_query_attention(q, k, v):
    """Causal attention of q (B, nh, T, hs) over k, v (B, n_kv, S, hs), S >= T; returns (B, nh, T, hs)."""
    batch, n_heads, seq_len, head_dim = q.shape
    n_kv_heads, kv_len = k.size(1), k.size(2)
    q = q.view(batch, n_kv_heads, n_heads // n_kv_heads, seq_len, head_dim)  # (B, n_kv, group, T, hs)
    k, v = k.unsqueeze(2), v.unsqueeze(2)  # (B, n_kv, 1, S, hs): one key/value head per group, not copied
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)  # (B, n_kv, group, T, S)
    scores = scores.masked_fill(~causal_mask(seq_len, kv_len), float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # each query's weights over the keys sum to 1
    return (weights @ v).view(batch, n_heads, seq_len, head_dim)  # (B, nh, T, hs)

# %% rope_interleaved
def rope_interleaved(x, start_pos=0, theta=10_000.0):
    """Turn each pair (x[2i], x[2i+1]) of x (..., T, hs) by (start_pos + t) * theta ** (-2i / hs)."""
    seq_len, head_dim = x.shape[-2:]
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (hs/2,)
    positions = torch.arange(start_pos, start_pos + seq_len, dtype=torch.float64)  # (T,)
    angles = torch.outer(positions, inv_freq)  # (T, hs/2), in float64: exact at large positions
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., 0::2], x[..., 1::2]  # (..., T, hs/2): the two coordinates of every pair
    turned = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)  # (..., T, hs/2, 2)
    return turned.flatten(-2)  # (..., T, hs): each pair back side by side

# %% attention_maps
def attention_maps(model, idx):
    """The attention weights of every layer of model on idx (B, T): (n_layers, B, n_heads, T, T)."""
    inputs = []  # what each block hands its attention: the normed residual stream
    hooks = [block.attn.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
             for block in model.blocks]
    try:
        with torch.no_grad():
            model(idx)
    finally:
        for hook in hooks:
            hook.remove()
    maps = []
    for block, x in zip(model.blocks, inputs):
        fused, block.attn.fused = block.attn.fused, False  # only the explicit path forms the weights
        try:
            with torch.no_grad():
                _, weights = block.attn(x, model.rope, need_weights=True)  # (B, nh, T, T)
        finally:
            block.attn.fused = fused
        maps.append(weights)
    return torch.stack(maps)  # (n_layers, B, nh, T, T)

# %% QKNormAttention
def attend(attention, q, k, v, rope, kv_cache, start_pos, input_pos, window=None):
    """What MultiHeadAttention does after its projection, for q (B, nh, T, hs), k, v (B, n_kv, T, hs).

    Each query sees the keys at or before its own position (only the last `window` of them, if given).
    """
    batch, _, seq_len, _ = q.shape
    positions = input_pos if input_pos is not None else torch.arange(start_pos, start_pos + seq_len)  # (T,)
    if rope is not None:
        q, k = rope(q, positions=positions), rope(k, positions=positions)
    if kv_cache is not None:
        k, v = kv_cache.write(k, v, positions)  # (B, n_kv, S, hs): the whole cache, S = its max_seq_len
    distance = positions[:, None] - torch.arange(k.size(-2))  # (T, S): how far back each key is
    allowed = distance >= 0  # (T, S): no key after its query, so no cache slot not written yet either
    if window is not None:
        allowed = allowed & (distance < window)  # and none more than window - 1 positions back
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)  # (B, nh, T, hs)
    return attention.out_proj(context.transpose(1, 2).reshape(batch, seq_len, -1))  # (B, T, d_out)


class QKNormAttention(nn.Module):
    """A MultiHeadAttention whose queries and keys are RMS-normalised, head by head, before RoPE."""

    def __init__(self, attention, eps=1e-5):
        super().__init__()
        self.attention = attention
        self.q_norm = RMSNorm(attention.head_dim, eps)  # one gain per dimension of a head, shared by the heads
        self.k_norm = RMSNorm(attention.head_dim, eps)

    def forward(self, x, rope=None, kv_cache=None, start_pos=0, *, input_pos=None):
        a = self.attention
        q, k, v = a.qkv(x).split(a.qkv_sizes, dim=-1)  # (B, T, nh*hs), (B, T, n_kv*hs) x2
        q = self.q_norm(split_heads(q, a.n_heads))  # (B, nh, T, hs), every head at RMS 1 times the gains
        k = self.k_norm(split_heads(k, a.n_kv_heads))  # (B, n_kv, T, hs)
        return attend(a, q, k, split_heads(v, a.n_kv_heads), rope, kv_cache, start_pos, input_pos)

# %% SlidingWindowAttention
class SlidingWindowAttention(nn.Module):
    """A MultiHeadAttention in which each query sees only the last `window` positions, its own included."""

    def __init__(self, attention, window):
        super().__init__()
        self.attention, self.window = attention, window

    def forward(self, x, rope=None, kv_cache=None, start_pos=0, *, input_pos=None):
        a = self.attention
        q, k, v = a.qkv(x).split(a.qkv_sizes, dim=-1)  # (B, T, nh*hs), (B, T, n_kv*hs) x2
        q, k, v = split_heads(q, a.n_heads), split_heads(k, a.n_kv_heads), split_heads(v, a.n_kv_heads)
        return attend(a, q, k, v, rope, kv_cache, start_pos, input_pos, window=self.window)
