"""Rotary position embeddings (RoPE): rotate queries and keys by an angle that grows with position.

Uses the rotate-half convention of Llama and Hugging Face: dimension ``i`` is paired with
dimension ``i + head_dim/2`` (not with its neighbour ``i + 1`` as in the RoFormer paper), so
their query/key weights load without permuting rows.
"""

import torch
from torch import nn

from llmscratch.model.checks import check_rope


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Map each pair (x1, x2) = (x[i], x[i + hs/2]) to (-x2, x1): a 90-degree turn of every pair."""
    x1, x2 = x.chunk(2, dim=-1)  # (..., hs/2) each
    return torch.cat([-x2, x1], dim=-1)  # (..., hs)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for positions 0..max_seq_len-1; call it on queries or keys."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10_000.0, scaling: float = 1.0):
        super().__init__()
        check_rope(head_dim, max_seq_len)
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.scaling = scaling  # linear scaling: every position divided by this, so the angles turn slower
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the tables, e.g. after ``to_empty`` (which gives a model built on "meta" memory, not values)."""
        device = self.cos.device if hasattr(self, "cos") else None
        # float64 for the angles: position * frequency loses digits in float32 at long contexts.
        pair_index = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device)  # (hs/2,)
        inv_freq = self.theta ** (-pair_index / self.head_dim) / self.scaling  # (hs/2,) from 1 down to ~1/theta
        positions = torch.arange(self.max_seq_len, dtype=torch.float64, device=device)  # (T_max,)
        angles = torch.outer(positions, inv_freq)  # (T_max, hs/2)
        angles = torch.cat([angles, angles], dim=-1)  # (T_max, hs): both halves of a pair share an angle
        # Not persistent: the tables are derived from (head_dim, max_seq_len, theta), never loaded.
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, start_pos: int = 0, *, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate x (B, nh, T, hs) as if its T rows sat at positions start_pos..start_pos+T-1.

        ``positions`` (T,), a tensor, replaces ``start_pos``: a compiled decoding step passes its
        position as a tensor so that a new position is new data, not a new graph; (B, T) gives each
        row positions of its own. Nothing is checked here, at every step: the model's door (its config,
        ``generate``) keeps the positions inside the table.
        """
        if positions is None:
            positions = slice(start_pos, start_pos + x.size(-2))
        cos = self.cos[positions].to(x.dtype)  # (T, hs), broadcasts over (B, nh); or (B, T, hs)
        sin = self.sin[positions].to(x.dtype)  # (T, hs) or (B, T, hs)
        if cos.dim() == 3:  # per-row positions: the same angles for every head of a row
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, hs)
        return x * cos + rotate_half(x) * sin  # (B, nh, T, hs)

    def extra_repr(self) -> str:
        scaling = "" if self.scaling == 1 else f", scaling={self.scaling}"
        return f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, theta={self.theta}{scaling}"
