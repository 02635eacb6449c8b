"""RMSNorm: the normalisation of Llama-style blocks, and of each head's queries and keys under QK-norm."""

import torch
from torch import nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """Scale x to unit root-mean-square over its last dimension, then by a learned gain."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 even for bf16 inputs: the mean of squares loses precision in 8 mantissa bits (and
        # float64 stays float64: a float64 model is a reference, all of it in float64).
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., dim)
        return self.weight * normed.to(x.dtype)
