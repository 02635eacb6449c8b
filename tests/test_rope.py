"""RoPE against a float64 reference written from the formula, plus its relative-position property."""

import math

import pytest
import torch

from llmscratch.model.rope import RotaryEmbedding


def reference_rope(x: torch.Tensor, start_pos: int, theta: float) -> torch.Tensor:
    """Turn pair (x[i], x[i + hs/2]) of row t of x (..., T, hs) by (start_pos + t) / theta^(2i/hs); float64."""
    x = x.double()
    half = x.size(-1) // 2
    out = torch.empty_like(x)
    for t in range(x.size(-2)):
        for i in range(half):
            angle = (start_pos + t) * theta ** (-2 * i / x.size(-1))
            a, b = x[..., t, i], x[..., t, i + half]
            out[..., t, i] = a * math.cos(angle) - b * math.sin(angle)
            out[..., t, i + half] = a * math.sin(angle) + b * math.cos(angle)
    return out


@pytest.mark.parametrize("theta", [10_000.0, 500_000.0])
@pytest.mark.parametrize("start_pos", [0, 5, 4_000])
def test_rope_matches_float64_formula(start_pos, theta):
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim=16, max_seq_len=4_096, theta=theta)
    x = torch.randn(2, 3, 7, 16)  # (B, nh, T, hs)
    # Positions near 4,000 would be off by ~1e-4 if the angles were computed in float32.
    expected = reference_rope(x, start_pos, theta)
    torch.testing.assert_close(rope(x, start_pos).double(), expected, atol=1e-5, rtol=0)


def test_rotated_score_depends_only_on_offset():
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim=32, max_seq_len=512)
    q, k = torch.randn(2, 1, 1, 1, 32).double()  # one query and one key, (B=1, nh=1, T=1, hs)

    def score(q_pos: int, k_pos: int) -> float:
        return (rope(q, q_pos) * rope(k, k_pos)).sum().item()

    for q_pos, k_pos in [(7, 3), (3, 7), (10, 10), (100, 0)]:
        for shift in [1, 13, 300]:
            assert score(q_pos + shift, k_pos + shift) == pytest.approx(score(q_pos, k_pos), abs=1e-5)
    # And the score does change with the offset, so the equalities above are not vacuous.
    assert abs(score(7, 3) - score(7, 4)) > 1e-3


def test_tables_are_exact_at_position_zero():
    rope = RotaryEmbedding(head_dim=8, max_seq_len=16)
    assert torch.equal(rope.cos[0], torch.ones(8))
    assert torch.equal(rope.sin[0], torch.zeros(8))
    x = torch.randn(1, 2, 3, 8)
    assert torch.equal(rope(x)[..., 0, :], x[..., 0, :])


@pytest.mark.parametrize("head_dim", [7, 0, -2])
def test_odd_or_empty_head_dim_is_rejected(head_dim):
    with pytest.raises(ValueError, match=f"head_dim={head_dim}"):
        RotaryEmbedding(head_dim=head_dim, max_seq_len=16)


def test_positions_past_the_table_are_an_error():
    """Nothing is checked per step; a position past the table is still an error, never a wrong angle."""
    rope = RotaryEmbedding(head_dim=8, max_seq_len=16)
    with pytest.raises(RuntimeError):
        rope(torch.randn(1, 1, 17, 8))
    with pytest.raises(RuntimeError):
        rope(torch.randn(1, 1, 3, 8), start_pos=14)


def test_head_dim_mismatch_is_an_error():
    rope = RotaryEmbedding(head_dim=8, max_seq_len=16)
    with pytest.raises(RuntimeError):
        rope(torch.randn(1, 1, 3, 6))
