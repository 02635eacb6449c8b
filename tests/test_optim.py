"""Muon: the Newton-Schulz orthogonalisation against float64 SVD math, one update against a direct float64
computation and against torch.optim.Muon, the AdamW groups against torch.optim.AdamW, and which weights get it."""

import math

import pytest
import torch
from torch import nn

from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.training.config import TrainConfig
from llmscratch.training.optim import MUON_RMS, NEWTON_SCHULZ, Muon, configure_optimizer, muon_parameters, orthogonalize

SHAPES = [(8, 8), (12, 5), (5, 12), (64, 16), (3, 40), (1, 7)]


def newton_schulz64(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """What the iteration computes, from the SVD in float64: U f(S / |G|_F) V^T, f the quintic applied ``steps`` times."""
    u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    a, b, c = NEWTON_SCHULZ
    s = s / matrix.double().norm()
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return u @ torch.diag(s) @ vh


@pytest.mark.parametrize("shape", SHAPES)
def test_orthogonalize_is_the_quintic_on_the_singular_values(shape):
    matrix = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    got = orthogonalize(matrix)
    assert got.shape == matrix.shape and got.dtype == matrix.dtype
    torch.testing.assert_close(got.double(), newton_schulz64(matrix), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("shape", SHAPES)
def test_orthogonalize_pushes_every_singular_value_towards_1(shape):
    # A badly conditioned matrix: singular values spread over four orders of magnitude.
    generator = torch.Generator().manual_seed(7)
    u, _ = torch.linalg.qr(torch.randn(shape[0], shape[0], generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(shape[1], shape[1], generator=generator, dtype=torch.float64))
    k = min(shape)
    spread = torch.logspace(0, -3, k, dtype=torch.float64) if k > 1 else torch.ones(1, dtype=torch.float64)
    matrix = (u[:, :k] @ torch.diag(spread) @ v[:, :k].T).float()
    before = torch.linalg.svdvals(matrix.double())
    after = torch.linalg.svdvals(orthogonalize(matrix).double())
    assert before.max() / before.min() > 100 or k == 1
    # Each of the directions the gradient barely used now moves nearly as much as the main one.
    # (The quintic is tuned for speed, not to converge: it leaves values in about [0.7, 1.2], and a
    # value below ~1e-3 of the largest needs more than five steps.)
    big = before > 1e-2 * before.max()
    assert ((after[big] > 0.6) & (after[big] < 1.25)).all(), (before, after)


def muon_steps64(weight, grads, lr, momentum, weight_decay, nesterov=True):
    """Muon written out in float64: momentum, look-ahead, orthogonalised direction, RMS scale, decoupled decay."""
    w, buffer = weight.double().clone(), torch.zeros_like(weight, dtype=torch.float64)
    for grad in grads:
        grad = grad.double()
        buffer = momentum * buffer + (1 - momentum) * grad
        direction = (1 - momentum) * grad + momentum * buffer if nesterov else buffer
        w = w * (1 - lr * weight_decay)
        w = w - lr * MUON_RMS * math.sqrt(max(w.shape)) * newton_schulz64(direction)
    return w


@pytest.mark.parametrize(("shape", "nesterov"), [((16, 8), True), ((8, 24), True), ((10, 10), False)])
def test_muon_update_matches_a_float64_computation(shape, nesterov):
    generator = torch.Generator().manual_seed(3)
    weight = nn.Parameter(torch.randn(*shape, generator=generator))
    start = weight.detach().clone()
    grads = [torch.randn(*shape, generator=generator) * scale for scale in (1.0, 0.1, 3.0)]
    optimizer = Muon([{"params": [weight], "muon": True}], lr=0.05, weight_decay=0.1, momentum=0.9,
                     nesterov=nesterov)
    for grad in grads:
        weight.grad = grad.clone()
        optimizer.step()
    expected = muon_steps64(start, grads, lr=0.05, momentum=0.9, weight_decay=0.1, nesterov=nesterov)
    torch.testing.assert_close(weight.detach().double(), expected, atol=1e-5, rtol=1e-5)
    # The update's RMS is MUON_RMS * lr (before decay), whatever the gradient's scale.
    update = (weight.detach().double() - start.double() * (1 - 0.05 * 0.1) ** 3)
    assert update.pow(2).mean().sqrt() < 3 * 0.05 * MUON_RMS * 1.3


def test_muon_agrees_with_torch_optim_muon():
    """An independent implementation: torch.optim.Muon with its AdamW-matching scale (it orthogonalises in bfloat16)."""
    generator = torch.Generator().manual_seed(5)
    ours, theirs = (nn.Parameter(w) for w in [torch.randn(24, 40, generator=generator)] * 2)
    theirs = nn.Parameter(ours.detach().clone())
    grads = [torch.randn(24, 40, generator=generator) for _ in range(4)]
    mine = Muon([{"params": [ours], "muon": True}], lr=0.02, weight_decay=0.1, momentum=0.95)
    reference = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    start = ours.detach().clone()
    for grad in grads:
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step()
        reference.step()
    moved_ours, moved_theirs = ours.detach() - start, theirs.detach() - start
    # bfloat16 has 8 bits of mantissa: the two agree to about 1%, and both moved far more than that.
    assert (moved_ours - moved_theirs).norm() < 0.02 * moved_theirs.norm()


def test_adamw_groups_match_torch_adamw():
    generator = torch.Generator().manual_seed(11)
    values = [torch.randn(6, 4, generator=generator), torch.randn(4, generator=generator)]
    ours = [nn.Parameter(v.clone()) for v in values]
    theirs = [nn.Parameter(v.clone()) for v in values]
    settings = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    mine = Muon([{"params": ours[:1], "weight_decay": 0.1}, {"params": ours[1:], "weight_decay": 0.0}], **settings)
    reference = torch.optim.AdamW([{"params": theirs[:1], "weight_decay": 0.1},
                                   {"params": theirs[1:], "weight_decay": 0.0}], foreach=False, **settings)
    for _ in range(5):
        grads = [torch.randn(v.shape, generator=generator) for v in values]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        mine.step()
        reference.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("preset", ["llama-mini", "gpt2-small"])
def test_muon_trains_the_blocks_matrices_and_adamw_the_rest(preset):
    config = GPTConfig.from_preset(preset, n_layers=2, d_model=64, n_heads=4, d_ff=128, vocab_size=300,
                                   context_length=32, **({"n_kv_heads": 2} if preset.startswith("llama") else {}))
    model = GPT(config)
    names = {id(p): name for name, p in model.named_parameters()}
    chosen = {names[id(p)] for p in muon_parameters(model)}
    expected = {name for name, p in model.named_parameters() if name.startswith("blocks.") and p.dim() == 2}
    assert chosen == expected and chosen
    optimizer = configure_optimizer(model, TrainConfig(optimizer="muon"), torch.device("cpu"))
    muon_groups = [g for g in optimizer.param_groups if g["muon"]]
    assert {names[id(p)] for g in muon_groups for p in g["params"]} == expected
    others = {names[id(p)] for g in optimizer.param_groups if not g["muon"] for p in g["params"]}
    assert others == set(names.values()) - expected  # every parameter once: embeddings, head, gains
    assert "token_embedding.weight" in others


def test_muon_refuses_a_vector_group_and_a_bad_momentum():
    with pytest.raises(ValueError, match=r"2-D .*shapes \[\(3,\)\]"):
        Muon([{"params": [nn.Parameter(torch.ones(3))], "muon": True}])
    with pytest.raises(ValueError, match="momentum must be in"):
        Muon([nn.Parameter(torch.ones(3, 3))], momentum=1.0)
    with pytest.raises(ValueError, match="cannot be muon with parallel=fsdp"):
        TrainConfig(optimizer="muon", parallel="fsdp")
