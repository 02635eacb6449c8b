"""The mixture of experts and sliding-window attention, against references written out in float64."""

import math

import pytest
import torch
import torch.nn.functional as F
from model_fixtures import LATER_SHAPES, randomize

from llmscratch.config import ConfigError
from llmscratch.model.attention import MultiHeadAttention, causal_mask, positions_mask
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.model.moe import MoE, balance_loss, route


def moe_layer(n_experts=5, k=2, d=12, d_expert=7, **options) -> MoE:
    torch.manual_seed(0)
    layer = MoE(d, d_expert, n_experts, k, **options)
    randomize(layer, seed=1, scale=0.5)
    return layer


def reference_moe(layer: MoE, x: torch.Tensor, act=F.silu) -> torch.Tensor:
    """Token by token in float64: the softmax over all experts, the k best, their outputs mixed."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    gate, up, down = layer.gate.double(), layer.up.double(), layer.down.double()
    for t, token in enumerate(x.double()):
        probs = torch.softmax(layer.router.weight.double() @ token, dim=0)
        best = sorted(range(layer.n_experts), key=lambda e: -probs[e].item())[:layer.k]
        total = sum(probs[e] for e in best) if layer.norm_topk else 1.0
        for e in best:
            out[t] += probs[e] / total * (down[e] @ (act(gate[e] @ token) * (up[e] @ token)))
    return out


@pytest.mark.parametrize("n_experts, k, tokens, norm_topk", [(5, 2, 13, True), (7, 3, 1, False), (4, 4, 9, True),
                                                             (6, 1, 17, False)])
def test_every_token_goes_through_its_k_experts_and_none_is_dropped(n_experts, k, tokens, norm_topk):
    layer = moe_layer(n_experts, k, norm_topk=norm_topk)
    x = torch.randn(tokens, 12, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = layer(x[None])[0]  # (1, N, d) in, whatever N
    torch.testing.assert_close(got.double(), reference_moe(layer, x), atol=1e-5, rtol=1e-5)


def test_decoding_a_few_tokens_slot_by_slot_equals_dispatching_by_expert():
    layer = moe_layer(8, 2)
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(10))  # 6 slots for 8 experts: slot by slot
    with torch.no_grad():
        few = layer(x)
    by_expert = layer(x).detach()  # with gradients on: the general path
    torch.testing.assert_close(few, by_expert, atol=1e-6, rtol=1e-6)


def test_a_tokens_output_does_not_depend_on_the_rest_of_the_batch():
    layer = moe_layer(6, 2)
    x = torch.randn(3, 11, 12, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        together = layer(x)
        alone = torch.stack([layer(x[i:i + 1])[0] for i in range(3)])
    torch.testing.assert_close(together, alone, atol=1e-6, rtol=1e-6)


def test_an_expert_no_token_chose_gets_a_zero_gradient_not_none():
    """DistributedDataParallel waits for every parameter's gradient: an idle expert must still have one."""
    layer = moe_layer(16, 1)
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(9))  # 3 tokens, 1 expert each: 13+ idle
    layer(x).square().sum().backward()
    chosen = set(route(layer.router(x), 1, True)[1].flatten().tolist())
    for weight in (layer.gate, layer.up, layer.down):
        assert weight.grad is not None
        for expert in range(16):
            assert (weight.grad[expert].abs().sum() > 0) == (expert in chosen)


def test_geglu_experts_and_a_shared_expert():
    layer = moe_layer(4, 2, shared_experts=2, activation="gelu")
    x = torch.randn(9, 12, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference_moe(layer, x, act=lambda z: F.gelu(z, approximate="tanh")) + layer.shared(x).double()
        torch.testing.assert_close(layer(x).double(), expected, atol=1e-5, rtol=1e-5)
    assert layer.shared.down.out_features == 12 and layer.shared.down.in_features == 2 * 7


def test_routing_weights_are_the_top_k_probabilities():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.0, 0.0, 0.0]])
    weights, experts, probs = route(logits, 2, norm_topk=False)
    assert experts[0].tolist() == [1, 2]
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1))
    torch.testing.assert_close(weights[0], probs[0, [1, 2]])
    normed = route(logits, 2, norm_topk=True)[0]
    torch.testing.assert_close(normed.sum(dim=-1), torch.ones(2))


def reference_balance(probs: torch.Tensor, experts: torch.Tensor) -> float:
    n_experts = probs.size(1)
    slots = experts.flatten().tolist()
    return n_experts * sum(slots.count(e) / len(slots) * probs[:, e].mean().item() for e in range(n_experts))


def test_the_balancing_loss_is_one_for_an_even_load_and_grows_as_it_concentrates():
    n, e = 12, 4
    even = torch.full((n, e), 1 / e)
    assert balance_loss(even, torch.arange(n)[:, None] % e).item() == pytest.approx(1.0)
    one = torch.zeros(n, e)
    one[:, 2] = 1.0
    assert balance_loss(one, torch.full((n, 1), 2)).item() == pytest.approx(e)
    probs = torch.softmax(torch.randn(n, e, generator=torch.Generator().manual_seed(5)), dim=-1)
    experts = probs.topk(2, dim=-1).indices
    assert balance_loss(probs, experts).item() == pytest.approx(reference_balance(probs, experts), rel=1e-6)


def test_training_adds_the_balancing_loss_and_counts_the_load():
    config = GPTConfig(**{**LATER_SHAPES["moe"], "context_length": 16, "router_aux_weight": 0.5})
    model = GPT(config)
    idx = torch.randint(config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(6))
    loss = model(idx, targets=idx)
    balance = model.balance_loss()
    with torch.no_grad():
        model.eval()
        plain = model(idx, targets=idx)
    torch.testing.assert_close(loss.detach(), plain + 0.5 * balance.detach())
    loss.backward()
    moe = model.blocks[0].mlp
    assert moe.router.weight.grad.abs().sum() > 0  # the router learns, through the weights and the balancing loss
    assert isinstance(model.blocks[1].mlp, torch.nn.Module) and not isinstance(model.blocks[1].mlp, MoE)
    load = moe.reset_load()
    assert load.sum().item() == 3 * 16 * config.experts_per_token and moe.load is None
    model(idx)  # eval mode: nothing counted
    assert moe.reset_load() is None


def test_a_model_copies_and_pickles_after_a_training_step():
    """The balancing loss held for logging is inside the step's graph; a copy (DPO's reference model, a
    pruned or quantized copy, torch.save of the module) keeps its value without the graph."""
    import copy
    import io

    config = GPTConfig(**{**LATER_SHAPES["moe"], "context_length": 16})
    model = GPT(config)
    idx = torch.randint(config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    model(idx, targets=idx).backward()
    copied = copy.deepcopy(model)
    assert copied.balance_loss().item() == model.balance_loss().item()
    assert model.balance_loss().requires_grad and not copied.balance_loss().requires_grad  # the original keeps its graph
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)  # our own model, just written
    torch.testing.assert_close(loaded(idx), model(idx))


@pytest.mark.parametrize("fields, message", [
    (dict(n_experts=3, experts_per_token=4), "experts_per_token must be at most n_experts=3"),
    (dict(n_experts=1), "n_experts must be at least 2"),
    (dict(n_experts=4, mlp="gelu"), "must be swiglu or geglu in a mixture-of-experts model"),
    (dict(n_experts=4, dense_layers=(2,)), "dense_layers must be layer indices below n_layers=2"),
    (dict(layer_types=("sliding",)), r"layer_types must name one type per layer \(2\)"),
    (dict(layer_types=("full", "local")), "layer_types must be a tuple of"),
    (dict(layer_types=("full", "sliding")), "sliding_window must be set"),
    (dict(sliding_window=0), "sliding_window must be a positive integer"),
])
def test_bad_choices_are_named(fields, message):
    with pytest.raises(ConfigError, match=message):
        GPTConfig.from_preset("llama-tiny", n_layers=2, **fields)


# --------------------------------------------------------------------------- sliding windows
def band_attention64(q, k, v, window: int, scale: float) -> torch.Tensor:
    """Each query i over keys i - window + 1 .. i, written out in float64."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros_like(q)
    for i in range(q.size(-2)):
        keys = range(max(0, i - window + 1), i + 1)
        scores = torch.stack([(q[..., i, :] * k[..., j, :]).sum(-1) for j in keys], dim=-1) * scale
        weights = torch.softmax(scores, dim=-1)
        out[..., i, :] = sum(weights[..., n, None] * v[..., j, :] for n, j in enumerate(keys))
    return out


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("window, seq_len", [(1, 6), (3, 11), (7, 7), (20, 9)])
def test_sliding_window_attention_sees_the_window_only(fused, window, seq_len):
    torch.manual_seed(7)
    attention = MultiHeadAttention(24, 24, 4, 2, fused=fused, sliding_window=window, scale=0.3).eval()
    x = torch.randn(2, seq_len, 24)
    with torch.no_grad():
        q, k, v = attention.qkv(x).split(attention.qkv_sizes, dim=-1)
        q, k, v = (t.view(2, seq_len, -1, 6).transpose(1, 2) for t in (q, k, v))
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        context = band_attention64(q, k, v, window, 0.3).transpose(1, 2).reshape(2, seq_len, 24)
        expected = context @ attention.out_proj.weight.double().T
        torch.testing.assert_close(attention(x).double(), expected, atol=1e-5, rtol=1e-5)


def test_window_masks_with_and_without_a_cache_agree():
    for q_len, kv_len, window in [(4, 4, 2), (3, 10, 4), (1, 9, 3), (5, 5, 9)]:
        band = causal_mask(q_len, kv_len, window=window)
        from_positions = positions_mask(torch.arange(kv_len - q_len, kv_len), kv_len, window)
        assert torch.equal(band, from_positions)
        for i in range(q_len):
            position = kv_len - q_len + i
            assert band[i].nonzero().flatten().tolist() == list(range(max(0, position - window + 1), position + 1))


def test_sliding_layers_use_their_own_rope_table_and_full_layers_the_scaled_one():
    model = GPT(GPTConfig(**{**LATER_SHAPES["gemma"], "context_length": 16}))
    assert model.rope.theta == 100_000.0 and model.rope.scaling == 2.0
    assert model.rope_local.theta == 10_000.0 and model.rope_local.scaling == 1.0
    positions = torch.arange(16, dtype=torch.float64)
    angle = positions / 2.0 * 100_000.0 ** (-2 / 12)  # the second pair of a head of 12, positions halved
    torch.testing.assert_close(model.rope.cos[:, 1].double(), torch.cos(angle), atol=1e-6, rtol=0)
    assert [block.attn.sliding_window for block in model.blocks] == [5, None, 5]
    assert math.isclose(model.blocks[0].attn.scale, 16 ** -0.5)


def test_flops_per_token_count_the_experts_a_token_goes_through():
    """Against torch's own FLOP counter on a forward pass: every matrix multiply, the routed rows as they ran."""
    from torch.utils.flop_counter import FlopCounterMode

    config = GPTConfig(**{**LATER_SHAPES["moe"], "context_length": 16, "fused_attention": False})  # counted matmuls
    model = GPT(config).eval()
    moe = model.blocks[0].mlp
    expert = moe.gate[0].numel() + moe.up[0].numel() + moe.down[0].numel()
    assert model.num_params() - model.num_params(active=True) == (5 - 2) * expert
    idx = torch.randint(config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(8))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(idx)
    assert counter.get_total_flops() == 3 * 16 * model.flops_per_token(16, training=False)


def test_a_sliding_layer_attends_over_its_window_in_the_flop_count():
    full = GPT(GPTConfig(**{**LATER_SHAPES["gemma"], "context_length": 64, "sliding_window": None,
                            "layer_types": None}))
    gemma = GPT(GPTConfig(**{**LATER_SHAPES["gemma"], "context_length": 64}))
    width = 4 * 12
    assert full.flops_per_token(64, training=False) - gemma.flops_per_token(64, training=False) == \
        2 * 4 * (64 - 5) * width  # two sliding layers, each over 5 keys instead of 64
    assert full.flops_per_token(4) == gemma.flops_per_token(4)  # a window longer than the sequence hides nothing
