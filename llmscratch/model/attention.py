"""Causal self-attention: multi-head, grouped-query and multi-query in one module, plus a KV cache.

Two paths compute the same thing. The explicit one writes out scores, mask, softmax and weighted
sum; it is the one to read and the reference the tests hold the other to. The fused one calls
``F.scaled_dot_product_attention``, which picks flash / memory-efficient kernels on CUDA and a
fused kernel on CPU, and never stores the (T, T) weights.

A KV cache holds the keys and values of the positions fed so far, preallocated at a fixed size.
New keys and values are written at their positions (a tensor, ``input_pos``) and attention reads
the whole cache, masked to the positions up to each query's own: the shapes never change from
step to step, so ``torch.compile`` compiles a decoding step once (gpt-fast's design).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmscratch.model.checks import check_attention, check_kv_cache
from llmscratch.model.norm import RMSNorm
from llmscratch.model.rope import RotaryEmbedding


def causal_mask(q_len: int, kv_len: int, device: torch.device | None = None, window: int | None = None) -> torch.Tensor:
    """(q_len, kv_len) booleans, True where a query may look at a key.

    The queries are the last q_len of the kv_len positions (bottom-right aligned), which is the
    case of a chunk appended to a KV cache; with q_len == kv_len it is the usual lower triangle.
    window: a sliding window, each query seeing its own position and the window - 1 before it: a band.
    """
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(diagonal=kv_len - q_len)
    return mask if window is None else mask.triu(diagonal=kv_len - q_len - window + 1)


def positions_mask(input_pos: torch.Tensor, kv_len: int, window: int | None = None) -> torch.Tensor:
    """(T, kv_len) booleans, True where the query at position input_pos[t] may look at key position s.

    A key is visible when it is not after the query: that hides the future inside a chunk and the
    positions of a fixed-size cache that nothing has been written to yet. input_pos (B, T), each
    row at positions of its own (continuous batching), gives (B, 1, T, kv_len): one mask per row,
    shared by the heads. window: only the keys less than window positions back are visible.
    """
    keys = torch.arange(kv_len, device=input_pos.device)  # (kv_len,)
    mask = keys <= input_pos[..., None]  # ([B,] T, kv_len)
    if window is not None:
        mask = mask & (keys > input_pos[..., None] - window)
    return mask if input_pos.dim() == 1 else mask[:, None]  # (T, kv_len) or (B, 1, T, kv_len)


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention written out; returns the context (B, nh, T, hs) and weights (B, nh, T, S).

    q has nh heads, k and v have n_kv heads; query head h reads key/value head h // (nh // n_kv).
    mask (T, S): True where a query may look at a key; default ``causal_mask`` (bottom-right).
    scale: what the scores are multiplied by; default 1 / sqrt(hs).
    """
    group_size = q.size(1) // k.size(1)
    k = k.repeat_interleave(group_size, dim=1)  # (B, nh, S, hs)
    v = v.repeat_interleave(group_size, dim=1)  # (B, nh, S, hs)
    # Dividing by sqrt(hs) keeps the scores' variance near 1 whatever the head size, so the
    # softmax starts out soft instead of nearly one-hot (which would starve the gradients).
    scale = 1 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale  # (B, nh, T, S)
    if mask is None:
        mask = causal_mask(q.size(-2), k.size(-2), q.device)  # (T, S)
    scores = scores.masked_fill(~mask, float("-inf"))  # exp(-inf) = 0: the future gets no weight
    weights = torch.softmax(scores, dim=-1)  # (B, nh, T, S), each row sums to 1
    weights = F.dropout(weights, p=dropout_p)  # identity when dropout_p == 0
    return weights @ v, weights  # (B, nh, T, hs), (B, nh, T, S)


def fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The same causal attention through scaled_dot_product_attention; returns (B, nh, T, hs).

    Without a mask, queries and keys are the same T positions: SDPA's own causal triangle (is_causal)
    is right, and lets it pick its fastest kernel. A cache passes its positions mask instead.
    """
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None, enable_gqa=k.size(1) != q.size(1),
        scale=scale,
    )  # (B, nh, T, hs)


class KVCache:
    """Preallocated keys and values of one attention layer, for decoding a batch token by token.

    A plain object rather than a submodule: the model's parameters and buffers stay fixed from call
    to call (what torch.compile wants), and the caller decides when a cache starts and ends.
    Fill it under ``torch.no_grad()``: it is for inference.
    """

    def __init__(
        self,
        batch_size: int,
        max_seq_len: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        check_kv_cache(batch_size, max_seq_len, n_kv_heads, head_dim)
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # (B_max, n_kv, T_max, hs)
        self.values = torch.zeros(shape, device=device, dtype=dtype)  # (B_max, n_kv, T_max, hs)

    @property
    def batch_size(self) -> int:
        return self.keys.size(0)

    @property
    def max_seq_len(self) -> int:
        return self.keys.size(2)

    def rows(self, start: int, stop: int, length: int | None = None) -> "KVCache":
        """The cache of batch rows start..stop-1 alone (and of its first ``length`` positions), sharing this one's
        memory: a view, not a copy.

        Continuous batching prefills a new sequence into its own row while the others wait, and decodes over
        the positions reached so far rather than the whole context.
        """
        view = object.__new__(KVCache)
        view.keys = self.keys[start:stop, :, :length]  # (stop - start, n_kv, length or T_max, hs)
        view.values = self.values[start:stop, :, :length]
        return view

    def write(
        self, keys: torch.Tensor, values: torch.Tensor, input_pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values (B, n_kv, T, hs) at the positions input_pos (T,); return the whole cache.

        input_pos (B, T) instead gives each row positions of its own (continuous batching: the
        sequences of a batch started at different times). The result (B, n_kv, max_seq_len, hs) has
        the same shape at every step; attention must hide the positions not written yet
        (``positions_mask``). Nothing is checked here, once per layer and token: the cache's sizes
        were checked when it was made, and the caller (``GPT.forward``, ``generate``) keeps the
        positions below max_seq_len and the batch within batch_size.
        """
        batch_size = keys.size(0)
        # Under autocast the projections come out in bf16/fp16; the cache keeps its own dtype (as a slice
        # assignment would), so that the same cache serves eager and autocast steps alike.
        keys, values = keys.to(self.keys.dtype), values.to(self.values.dtype)
        if input_pos.dim() == 1:
            self.keys[:batch_size].index_copy_(2, input_pos, keys)
            self.values[:batch_size].index_copy_(2, input_pos, values)
        else:  # row b's T keys go to positions input_pos[b]: indexed (B, T, n_kv, hs), heads moved behind
            rows = torch.arange(batch_size, device=input_pos.device)[:, None]  # (B, 1)
            self.keys[rows, :, input_pos] = keys.transpose(1, 2)
            self.values[rows, :, input_pos] = values.transpose(1, 2)
        return self.keys[:batch_size], self.values[:batch_size]  # (B, n_kv, T_max, hs)

    def attend(self, keys: torch.Tensor, values: torch.Tensor, input_pos: torch.Tensor,
               window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``write``, then what attention reads: the whole cache (B, n_kv, T_max, hs) twice and the mask of the
        positions each query may see (``positions_mask``). A paged cache (``llmscratch.model.paged``) answers the
        same call with the blocks of each sequence."""
        keys, values = self.write(keys, values, input_pos)
        return keys, values, positions_mask(input_pos, keys.size(-2), window)


class MultiHeadAttention(nn.Module):
    """Causal self-attention with n_heads query heads sharing n_kv_heads key/value heads.

    n_kv_heads == n_heads is multi-head attention (GPT-2), 1 < n_kv_heads < n_heads is grouped-query
    attention (Llama 2 70B, Llama 3), n_kv_heads == 1 is multi-query attention.

    Weight layout: one ``qkv`` Linear whose output rows are [queries | keys | values], of
    n_heads*head_dim, n_kv_heads*head_dim and n_kv_heads*head_dim rows, head after head. Hugging
    Face GPT-2's ``c_attn`` (a Conv1D) is this matrix transposed; Llama's q_proj, k_proj, v_proj
    concatenate into it along dim 0. ``out_proj`` maps the concatenated heads back to d_out.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        qkv_bias: bool = False,
        out_bias: bool = False,
        dropout: float = 0.0,
        fused: bool = True,
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
        head_dim: int | None = None,
        sliding_window: int | None = None,
        scale: float | None = None,
    ):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        # head_dim: each head's width when the heads do not split d_out (a model with heads pruned away
        # keeps their width and has fewer of them); None: d_out // n_heads.
        check_attention(d_in, d_out, n_heads, n_kv_heads, head_dim, dropout)
        self.d_out = d_out
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = d_out // n_heads if head_dim is None else head_dim
        self.dropout = dropout
        self.fused = fused
        self.sliding_window = sliding_window  # each query sees its own position and the window - 1 before it
        self.scale = scale  # the scores' factor; None: 1 / sqrt(head_dim)
        self.qkv_sizes = (n_heads * self.head_dim, n_kv_heads * self.head_dim, n_kv_heads * self.head_dim)
        self.qkv = nn.Linear(d_in, sum(self.qkv_sizes), bias=qkv_bias)
        self.out_proj = nn.Linear(n_heads * self.head_dim, d_out, bias=out_bias)
        # QK-norm: each head's query and key scaled to RMS 1, times gains shared by the heads, so a
        # logit q.k / sqrt(hs) stays within +-sqrt(hs) x gains however large the projections grow.
        self.q_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding | None = None,
        kv_cache: KVCache | None = None,
        start_pos: int = 0,
        need_weights: bool = False,
        *,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend over x (B, T, d_in), whose tokens sit at positions start_pos..start_pos+T-1.

        input_pos: the positions (T,) as a tensor instead of start_pos, what a compiled decoding step
        passes (a new position is then new data, not a new graph); (B, T) for rows at positions of their own.
        rope: rotate queries and keys at those positions (a table the model shares across layers).
        kv_cache: this layer's cache; x's keys and values are written at their positions and x attends
        to what the cache holds, masked to the positions up to its own (``KVCache.attend``, or a paged cache's).
        need_weights: also return the weights (B, nh, T, S), computed by the explicit path whatever
        ``fused`` says (the fused kernel never forms them).
        Returns (B, T, d_out), or (output, weights) when need_weights.
        """
        batch_size, seq_len, _ = x.shape
        q, k, v = self.qkv(x).split(self.qkv_sizes, dim=-1)  # (B, T, nh*hs), (B, T, n_kv*hs) x2
        q = q.view(batch_size, seq_len, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(batch_size, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hs)
        v = v.view(batch_size, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hs)
        if self.q_norm is not None:  # before RoPE, which keeps the norms (a rotation)
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            # Rotating before caching: a cached key keeps the angle of the position it was made at.
            q = rope(q, start_pos, positions=input_pos)
            k = rope(k, start_pos, positions=input_pos)
        window = self.sliding_window
        mask = None  # no cache: queries and keys are x's own tokens, plain causal attention
        if kv_cache is not None:
            if input_pos is None:
                input_pos = torch.arange(start_pos, start_pos + seq_len, device=x.device)  # (T,)
            k, v, mask = kv_cache.attend(k, v, input_pos, window)  # (B, n_kv, S, hs) x2, (T, S) or (B, 1, T, S)
        elif window is not None and window < seq_len:  # a window as long as x hides nothing: stay causal
            mask = causal_mask(seq_len, seq_len, x.device, window)  # (T, T): a band
        dropout_p = self.dropout if self.training else 0.0
        if self.fused and not need_weights:
            context = fused_attention(q, k, v, dropout_p, mask, self.scale)  # (B, nh, T, hs)
        else:
            context, weights = explicit_attention(q, k, v, dropout_p, mask, self.scale)  # (B, nh, T, hs), (B, nh, T, S)
        context = context.transpose(1, 2).reshape(batch_size, seq_len, self.n_heads * self.head_dim)  # (B, T, nh*hs)
        out = self.out_proj(context)  # (B, T, d_out)
        return (out, weights) if need_weights else out

    def extra_repr(self) -> str:
        path = "fused" if self.fused else "explicit"
        return (
            f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
            f"dropout={self.dropout}, {path}"
            + ("" if self.sliding_window is None else f", sliding_window={self.sliding_window}")
            + ("" if self.scale is None else f", scale={self.scale:.4g}")
        )
