"""MultiHeadAttention and KVCache against independent references: SDPA, torch's MHA, full forward passes."""

import pytest
import torch
from torch import nn

from llmscratch.model.attention import KVCache, MultiHeadAttention
from llmscratch.model.rope import RotaryEmbedding

D_MODEL, N_HEADS, HEAD_DIM = 32, 4, 8
# (n_kv_heads, use_rope): multi-head, grouped-query and multi-query, with and without RoPE.
CONFIGS = [(4, False), (4, True), (2, False), (2, True), (1, False), (1, True)]


def make_attention(n_kv_heads: int = N_HEADS, fused: bool = True, **kwargs) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(D_MODEL, D_MODEL, N_HEADS, n_kv_heads, fused=fused, **kwargs).eval()


def rope_or_none(use_rope: bool) -> RotaryEmbedding | None:
    return RotaryEmbedding(HEAD_DIM, max_seq_len=64) if use_rope else None


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("n_kv_heads, use_rope", CONFIGS)
def test_future_tokens_never_change_past_outputs(fused, n_kv_heads, use_rope):
    attention, rope = make_attention(n_kv_heads, fused), rope_or_none(use_rope)
    x = torch.randn(2, 10, D_MODEL)
    for t in [0, 4, 8]:
        changed = x.clone()
        changed[:, t + 1 :] = torch.randn_like(changed[:, t + 1 :])
        before, after = attention(x, rope), attention(changed, rope)
        torch.testing.assert_close(after[:, : t + 1], before[:, : t + 1], atol=1e-6, rtol=0)
        assert not torch.allclose(after[:, t + 1 :], before[:, t + 1 :], atol=1e-3)


@pytest.mark.parametrize("n_kv_heads, use_rope", CONFIGS)
def test_explicit_path_equals_fused_path(n_kv_heads, use_rope):
    attention, rope = make_attention(n_kv_heads, qkv_bias=True, out_bias=True), rope_or_none(use_rope)
    x = torch.randn(3, 13, D_MODEL, requires_grad=True)
    fused_out = attention(x, rope)
    (fused_grad,) = torch.autograd.grad(fused_out.square().sum(), x)
    attention.fused = False
    explicit_out = attention(x, rope)
    (explicit_grad,) = torch.autograd.grad(explicit_out.square().sum(), x)
    assert (explicit_out - fused_out).abs().max() <= 1e-5
    assert (explicit_grad - fused_grad).abs().max() <= 1e-4


@pytest.mark.parametrize("fused", [False, True])
def test_n_kv_heads_equal_to_n_heads_is_torch_multihead_attention(fused):
    ours = make_attention(N_HEADS, fused, qkv_bias=True, out_bias=True)
    reference = nn.MultiheadAttention(D_MODEL, N_HEADS, bias=True, batch_first=True).eval()
    with torch.no_grad():
        # torch stacks its input projection as [queries | keys | values] too.
        reference.in_proj_weight.copy_(ours.qkv.weight)
        reference.in_proj_bias.copy_(ours.qkv.bias)
        reference.out_proj.weight.copy_(ours.out_proj.weight)
        reference.out_proj.bias.copy_(ours.out_proj.bias)
    x = torch.randn(2, 11, D_MODEL)
    future = torch.triu(torch.ones(11, 11, dtype=torch.bool), diagonal=1)  # True: not allowed
    expected, _ = reference(x, x, x, attn_mask=future, need_weights=False)
    torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("use_rope", [False, True])
def test_grouped_query_equals_multi_head_with_repeated_kv_heads(fused, use_rope):
    n_heads, n_kv_heads = 6, 2
    torch.manual_seed(0)
    grouped = MultiHeadAttention(24, 6 * HEAD_DIM, n_heads, n_kv_heads, qkv_bias=True, fused=fused)
    multi = MultiHeadAttention(24, 6 * HEAD_DIM, n_heads, n_heads, qkv_bias=True, fused=fused)
    q_rows, kv_rows = n_heads * HEAD_DIM, n_kv_heads * HEAD_DIM

    def repeat_heads(rows: torch.Tensor) -> torch.Tensor:
        """Copy each key/value head's rows n_heads // n_kv_heads times, keeping the heads in order."""
        per_head = rows.unflatten(0, (n_kv_heads, HEAD_DIM))  # (n_kv, hs, ...)
        return per_head.repeat_interleave(n_heads // n_kv_heads, dim=0).flatten(0, 1)  # (nh * hs, ...)

    with torch.no_grad():
        for name in ["weight", "bias"]:
            q, k, v = getattr(grouped.qkv, name).split([q_rows, kv_rows, kv_rows])
            getattr(multi.qkv, name).copy_(torch.cat([q, repeat_heads(k), repeat_heads(v)]))
        multi.out_proj.load_state_dict(grouped.out_proj.state_dict())
    rope = rope_or_none(use_rope)
    x = torch.randn(2, 9, 24)
    torch.testing.assert_close(grouped(x, rope), multi(x, rope), atol=1e-5, rtol=0)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("chunks", [[1] * 9, [5, 1, 1, 1, 1], [3, 4, 2], [9]])
def test_decoding_with_kv_cache_equals_full_forward(fused, use_rope, chunks):
    attention, rope = make_attention(n_kv_heads=2, fused=fused), rope_or_none(use_rope)
    x = torch.randn(3, sum(chunks), D_MODEL)
    cache = KVCache(batch_size=4, max_seq_len=16, n_kv_heads=2, head_dim=HEAD_DIM)  # room to spare
    outputs, start_pos = [], 0
    with torch.no_grad():
        expected = attention(x, rope)
        for size in chunks:
            piece = x[:, start_pos : start_pos + size]
            outputs.append(attention(piece, rope, kv_cache=cache, start_pos=start_pos))
            start_pos += size
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("chunks", [[1] * 9, [5, 1, 1, 1, 1], [3, 4, 2]])
def test_decoding_at_position_tensors_equals_full_forward(fused, use_rope, chunks):
    """input_pos: the whole fixed-size cache is read, masked to the filled positions, at every step."""
    attention, rope = make_attention(n_kv_heads=2, fused=fused), rope_or_none(use_rope)
    x = torch.randn(3, sum(chunks), D_MODEL)
    cache = KVCache(batch_size=3, max_seq_len=16, n_kv_heads=2, head_dim=HEAD_DIM)  # unfilled tail
    cache.keys.fill_(1e4)  # whatever sits in the unfilled positions must not count
    cache.values.fill_(1e4)
    outputs, start_pos = [], 0
    with torch.no_grad():
        expected = attention(x, rope)
        for size in chunks:
            input_pos = torch.arange(start_pos, start_pos + size)
            outputs.append(attention(x[:, start_pos : start_pos + size], rope, kv_cache=cache, input_pos=input_pos))
            start_pos += size
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, atol=1e-5, rtol=0)
    with torch.no_grad():  # without a cache, input_pos only says where x sits (RoPE's angles)
        torch.testing.assert_close(attention(x[:, :4], rope, input_pos=torch.arange(3, 7)),
                                   attention(x[:, :4], rope, start_pos=3), atol=0, rtol=0)


@pytest.mark.parametrize("prefill, chunk", [(0, 7), (3, 4), (6, 1)])
def test_explicit_weights_are_causal_rows_summing_to_one(prefill, chunk):
    attention = make_attention(n_kv_heads=2, fused=False)
    cache = KVCache(batch_size=2, max_seq_len=8, n_kv_heads=2, head_dim=HEAD_DIM)
    x = torch.randn(2, prefill + chunk, D_MODEL)
    with torch.no_grad():
        attention(x[:, :prefill], kv_cache=cache)
        _, weights = attention(x[:, prefill:], kv_cache=cache, start_pos=prefill, need_weights=True)
    assert weights.shape == (2, N_HEADS, chunk, 8)  # the whole cache, its unwritten end masked
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(2, N_HEADS, chunk))
    query_pos = torch.arange(prefill, prefill + chunk)[:, None]  # (T, 1)
    key_pos = torch.arange(8)[None, :]  # (1, S)
    assert torch.all(weights[..., key_pos > query_pos] == 0)
    assert torch.all(weights[..., key_pos <= query_pos] > 0)


def test_dropout_zeroes_and_rescales_weights_only_in_training():
    attention = make_attention(fused=False, dropout=0.5)
    x = torch.randn(2, 12, D_MODEL)
    _, eval_weights = attention(x, need_weights=True)
    attention.train()
    torch.manual_seed(1)
    _, train_weights = attention(x, need_weights=True)
    dropped = train_weights == 0
    assert dropped[eval_weights > 0].any()
    torch.testing.assert_close(train_weights[~dropped], 2 * eval_weights[~dropped])


def test_fused_path_applies_dropout_only_in_training():
    attention = make_attention(fused=True, dropout=0.5)
    x = torch.randn(2, 12, D_MODEL)
    torch.testing.assert_close(attention(x), attention(x), atol=0, rtol=0)
    without_dropout = attention(x)
    attention.train()
    assert not torch.allclose(attention(x), without_dropout, atol=1e-3)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: MultiHeadAttention(32, 30, 4), r"d_out=30 is not divisible by n_heads=4"),
        (lambda: MultiHeadAttention(32, 32, 4, 3), r"n_heads=4 is not divisible by n_kv_heads=3"),
        (lambda: MultiHeadAttention(32, 32, 4, 0), r"n_kv_heads=0"),
        (lambda: MultiHeadAttention(32, 32, 4, dropout=1.0), r"dropout=1.0"),
        (lambda: KVCache(0, 8, 2, 8), r"batch_size=0"),
    ],
)
def test_bad_configuration_is_rejected(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_odd_head_dim_with_rope_is_rejected():
    attention = MultiHeadAttention(30, 30, 2)  # head_dim 15 is fine without RoPE...
    attention(torch.randn(1, 3, 30))
    with pytest.raises(ValueError, match=r"head_dim=15"):  # ...but has no pairs to rotate
        RotaryEmbedding(attention.head_dim, max_seq_len=16)
    with pytest.raises(RuntimeError):  # a table of another width: nothing checked per step, still no silent result
        attention(torch.randn(1, 3, 30), rope=RotaryEmbedding(16, max_seq_len=16))


def test_sequence_longer_than_rope_table_is_an_error():
    """RoPE checks nothing per step (the model's door, its config and ``generate``, keeps positions in the table);
    a position past the table still fails, it is never rotated by a wrong angle."""
    attention, rope = make_attention(), RotaryEmbedding(HEAD_DIM, max_seq_len=8)
    with pytest.raises(RuntimeError):
        attention(torch.randn(1, 9, D_MODEL), rope)
    with pytest.raises(RuntimeError):
        attention(torch.randn(1, 3, D_MODEL), rope, start_pos=6)


@pytest.mark.parametrize("batch, seq_len, start_pos, n_kv_heads", [
    (1, 9, 0, N_HEADS),  # longer than the cache
    (1, 2, 7, N_HEADS),  # past its end
    (3, 4, 0, N_HEADS),  # a larger batch than it holds
    (1, 4, 0, 2),  # another number of key/value heads
])
def test_what_does_not_fit_the_cache_fails_loudly(batch, seq_len, start_pos, n_kv_heads):
    """The cache checks nothing per step (its callers size it); a misfit is still an error, never a wrong answer."""
    attention = make_attention(n_kv_heads=n_kv_heads)
    cache = KVCache(batch_size=2, max_seq_len=8, n_kv_heads=N_HEADS, head_dim=HEAD_DIM)
    with torch.no_grad(), pytest.raises((IndexError, RuntimeError), match="index_copy_"):
        attention(torch.randn(batch, seq_len, D_MODEL), kv_cache=cache, start_pos=start_pos)


def test_need_weights_on_fused_path_uses_the_explicit_path():
    attention = make_attention(fused=True)
    x = torch.randn(1, 4, D_MODEL)
    out, weights = attention(x, need_weights=True)
    attention.fused = False
    expected_out, expected_weights = attention(x, need_weights=True)
    torch.testing.assert_close(weights, expected_weights, atol=0, rtol=0)
    torch.testing.assert_close(out, expected_out, atol=0, rtol=0)
