"""What the compiled one-token decoding step computes instead of two library kernels, on a CPU.

Decoding one token for one sequence multiplies one activation row by every weight matrix: a
matrix-vector product, bound by how fast the weights stream from memory. On the CPUs measured
here, the BLAS kernel behind ``F.linear`` runs a one-row product on a single thread, at about
half of what two cores read (benchmarks/RESULTS.md, issue 29). The same product written as a
multiply and a sum over the input dimension, ``(x * W).sum(-1)``, is a reduction that
``torch.compile`` turns into its own vectorised loop over the weight rows, spread over every
thread and fused with the bias. Likewise ``F.scaled_dot_product_attention`` with one query spends
more time starting than computing; the same attention written out fuses with its neighbours.

``OneRowMath`` makes that swap while a compiler traces the decoding step
(``generate.compiled_decode_one_token``). Eagerly the swap would be slower (the product ``x * W``
would be a whole weight-sized tensor), so only the compiled step enters it, and only with more
than one thread; on any other device, or with more than one row or query, it changes nothing.
"""

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def one_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for an x (..., d_in) holding one row: a multiply and a sum over d_in; (..., d_out).

    Summed in float32 at least (in bfloat16, as F.linear does), then rounded once to x's dtype.
    """
    wide = torch.promote_types(x.dtype, torch.float32)
    out = (x.unsqueeze(-2).to(wide) * weight.to(wide)).sum(-1)  # (..., 1, d_in) * (d_out, d_in) -> (..., d_out)
    return (out if bias is None else out + bias).to(x.dtype)


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA of one query per head, q (B, nh, 1, hs), against k, v (B, n_kv, S, hs); (B, nh, 1, hs).

    mask (1, S) or broadcastable: True where the query may look (or added to the scores, if float).
    Query head h reads key/value head h // (nh // n_kv), as ``enable_gqa`` does: the query heads of
    a group become the rows of one product, so no key or value is copied.
    """
    batch_size, n_heads, _, head_dim = q.shape
    n_kv_heads = k.size(1)
    grouped = q.reshape(batch_size, n_kv_heads, n_heads // n_kv_heads, head_dim)  # (B, n_kv, group, hs)
    scores = grouped @ k.transpose(-2, -1) / math.sqrt(head_dim)  # (B, n_kv, group, S)
    scores = scores.reshape(batch_size, n_heads, 1, -1)  # (B, nh, 1, S)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1).reshape(batch_size, n_kv_heads, n_heads // n_kv_heads, -1)
    return (weights @ v).reshape(batch_size, n_heads, 1, head_dim)  # (B, nh, 1, hs)


class OneRowMath(TorchFunctionMode):
    """While active, one-row ``F.linear`` and one-query masked SDPA on a CPU run as plain tensor math.

    Everything else (other devices, several rows, dropout, a causal flag, a custom scale) goes to
    the library function unchanged.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.device.type == "cpu" and x.numel() == x.size(-1):
                return one_row_linear(x, weight, bias)
        elif func is F.scaled_dot_product_attention and len(args) == 3:
            q, k, v = args
            mask = kwargs.get("attn_mask")
            plain = (kwargs.get("dropout_p", 0.0) == 0.0 and not kwargs.get("is_causal", False)
                     and kwargs.get("scale") is None)
            if q.device.type == "cpu" and q.size(-2) == 1 and mask is not None and plain:
                return one_query_attention(q, k, v, mask)
        return func(*args, **kwargs)
