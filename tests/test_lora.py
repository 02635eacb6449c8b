"""LoRA: a no-op at the start, merge == unmerged, parameter counts from the rank, adapter files."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmscratch.finetuning.config import LoRAConfig
from llmscratch.finetuning.lora import LoRALinear, apply_lora, load_adapters, lora_layers, merge_lora, save_adapters
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT, count_parameters

TINY = {
    "gpt2": dict(vocab_size=97, context_length=24, d_model=32, n_layers=2, n_heads=4),
    "llama": dict(vocab_size=89, context_length=24, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2,
                  d_ff=80, norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False, bias=False,
                  tie_embeddings=False),
}
KINDS = ["gpt2", "llama", "llama-tied"]


def make(kind: str, seed: int = 0) -> GPT:
    overrides = {"tie_embeddings": True} if kind == "llama-tied" else {}
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY[kind.removesuffix("-tied")], **overrides})).eval()


def tokens(model: GPT, batch: int = 3, length: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def train_a_little(model: GPT, steps: int = 5) -> None:
    """A few Adam steps on random next-token targets: enough to move B away from zero."""
    model.train()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        idx = tokens(model, seed=100 + step)
        loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def predicted_lora_parameters(config: GPTConfig, rank: int) -> int:
    """r * (in + out) per adapted layer, from the config's sizes alone (the default targets)."""
    d, hidden = config.d_model, config.hidden_dim
    kv_width = config.kv_heads * (d // config.n_heads)
    qkv, out_proj = (d, d + 2 * kv_width), (d, d)
    mlp = [(d, hidden), (d, hidden), (hidden, d)] if config.mlp == "swiglu" else [(d, hidden), (hidden, d)]
    per_block = sum(rank * (n_in + n_out) for n_in, n_out in [qkv, out_proj, *mlp])
    return config.n_layers * per_block


@pytest.mark.parametrize("kind", KINDS)
def test_fresh_lora_leaves_the_outputs_unchanged(kind):
    model = make(kind)
    idx = tokens(model)
    with torch.no_grad():
        before = model(idx)
        apply_lora(model, LoRAConfig(rank=4, alpha=8))
        after = model(idx)
    assert torch.equal(before, after)  # B = 0: the update is exactly zero
    assert all(torch.count_nonzero(layer.lora_b) == 0 for layer in lora_layers(model).values())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rank", [1, 4])
def test_trainable_parameters_are_what_the_rank_predicts(kind, rank):
    model = make(kind)
    total_before = count_parameters(model)
    apply_lora(model, LoRAConfig(rank=rank, alpha=2 * rank))
    expected = predicted_lora_parameters(model.config, rank)
    assert count_parameters(model, trainable_only=True) == expected
    assert count_parameters(model) == total_before + expected
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(name.endswith(("lora_a", "lora_b")) for name in trainable)


@pytest.mark.parametrize("kind", KINDS)
def test_only_the_adapters_receive_gradients(kind):
    model = make(kind)
    apply_lora(model, LoRAConfig(rank=2))
    idx = tokens(model)
    model(idx).square().mean().backward()
    for name, param in model.named_parameters():
        if name.endswith("lora_a"):
            assert param.grad is None or torch.count_nonzero(param.grad) == 0  # B = 0 blocks A's gradient
        elif name.endswith("lora_b"):
            assert param.grad is not None and torch.count_nonzero(param.grad) > 0
        else:
            assert param.grad is None, name


@pytest.mark.parametrize("kind", KINDS)
def test_merged_model_matches_the_unmerged_one_after_training(kind):
    model = make(kind).double()
    idx = tokens(model)
    with torch.no_grad():
        base_logits = model(idx)
    apply_lora(model, LoRAConfig(rank=4, alpha=8, dropout=0.1))
    train_a_little(model)
    assert all(torch.count_nonzero(layer.lora_b) > 0 for layer in lora_layers(model).values())
    with torch.no_grad():
        adapted = model(idx)
        merge_lora(model)
        merged = model(idx)
    assert not lora_layers(model)
    assert all(type(m) is nn.Linear for name, m in model.named_modules() if name.endswith(("qkv", "out_proj")))
    assert (adapted - base_logits).abs().max() > 1e-3  # training changed the function ...
    torch.testing.assert_close(merged, adapted, rtol=1e-10, atol=1e-10)  # ... and merging kept it


def test_lora_linear_computes_base_plus_scaled_low_rank_update():
    torch.manual_seed(0)
    base = nn.Linear(6, 5).double()
    layer = LoRALinear(base, rank=3, alpha=12.0)
    with torch.no_grad():
        layer.lora_b.normal_()
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    expected = F.linear(x, base.weight + (12.0 / 3) * layer.lora_b @ layer.lora_a, base.bias)
    torch.testing.assert_close(layer(x), expected)
    torch.testing.assert_close(layer.merged()(x), expected)


def test_merging_a_tied_head_leaves_the_embedding_alone():
    model = make("gpt2").double()
    embedding = model.token_embedding.weight.detach().clone()
    apply_lora(model, LoRAConfig(rank=2, targets=("lm_head",)))
    assert model.lm_head.base.weight is model.token_embedding.weight  # still tied while adapting
    train_a_little(model)
    idx = tokens(model)
    with torch.no_grad():
        adapted = model(idx)
        merge_lora(model)
        merged = model(idx)
    torch.testing.assert_close(merged, adapted, rtol=1e-10, atol=1e-10)
    assert torch.equal(model.token_embedding.weight, embedding)
    assert model.lm_head.weight is not model.token_embedding.weight


@pytest.mark.parametrize("targets", [("lm_head",), ("*.attn.qkv",)])
def test_the_models_own_loss_path_sees_the_adapters(targets):
    """GPT(idx, targets=...) (the training path) equals the loss of its logits, with LoRA anywhere."""
    model = make("llama").double()
    apply_lora(model, LoRAConfig(rank=2, targets=targets))
    train_a_little(model)  # B moves away from zero, so the adapters change the logits
    idx = tokens(model)
    expected = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
    torch.testing.assert_close(model(idx[:, :-1], targets=idx[:, 1:]), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_a_lora_head_gets_the_loss_and_gradients_of_its_full_logits(kind):
    """LoRA on lm_head takes the chunked loss path too: the loss and every gradient of F.cross_entropy on its logits."""
    model = make(kind).double()
    apply_lora(model, LoRAConfig(rank=2, targets=("lm_head", "*.attn.qkv")))
    train_a_little(model)  # B moves away from zero, so the head's adapter changes the logits
    assert isinstance(model.lm_head, LoRALinear)
    idx = tokens(model)
    targets = idx[:, 1:].clone()
    targets[0, :5] = -100  # skipped, as prompt tokens are in finetuning

    def loss_and_grads(loss_of_model):
        model.zero_grad()
        loss = loss_of_model()
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}

    expected_loss, expected = loss_and_grads(lambda: F.cross_entropy(model(idx[:, :-1]).flatten(0, 1),
                                                                     targets.flatten()))
    loss, grads = loss_and_grads(lambda: model(idx[:, :-1], targets=targets))
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=0)
    assert grads.keys() == expected.keys() and "lm_head.lora_b" in grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_adapters_save_and_load_alone(kind, tmp_path):
    model = make(kind)
    apply_lora(model, LoRAConfig(rank=3, alpha=5.0, targets=("*.attn.qkv", "*.mlp.*")))
    train_a_little(model)
    path = tmp_path / "adapters.safetensors"
    save_adapters(model, path)

    fresh = make(kind)  # the same base weights, no adapters
    names = load_adapters(fresh, path)
    assert names == sorted(lora_layers(model))
    idx = tokens(model)
    with torch.no_grad():
        torch.testing.assert_close(fresh(idx), model(idx), rtol=0, atol=0)
    assert count_parameters(fresh, trainable_only=True) == count_parameters(model, trainable_only=True)
    # The file holds the adapters only: far smaller than the model.
    assert path.stat().st_size < 4 * count_parameters(model, trainable_only=True) + 10_000


def test_loading_into_existing_adapters_overwrites_them(tmp_path):
    model = make("gpt2")
    apply_lora(model, LoRAConfig(rank=2))
    train_a_little(model)
    save_adapters(model, tmp_path / "a.safetensors")
    other = make("gpt2")
    apply_lora(other, LoRAConfig(rank=2))
    load_adapters(other, tmp_path / "a.safetensors")
    idx = tokens(model)
    with torch.no_grad():
        assert torch.equal(other(idx), model(idx))


@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=0), "rank"), (dict(rank=2.5), "rank"), (dict(alpha=0), "alpha"),
    (dict(dropout=1.0), "dropout"), (dict(targets="*.attn.qkv"), "targets"), (dict(targets=()), "targets"),
])
def test_bad_configs_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**kwargs)


def test_bad_uses_are_clear_errors(tmp_path):
    model = make("gpt2")
    with pytest.raises(ValueError, match="matches no linear layer"):
        apply_lora(model, LoRAConfig(targets=("*.attn.nothing",)))
    assert all(p.requires_grad for p in model.parameters())  # a failed apply changes nothing
    with pytest.raises(ValueError, match="no LoRA adapters to merge"):
        merge_lora(model)
    with pytest.raises(ValueError, match="no LoRA adapters to save"):
        save_adapters(model, tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="wraps an nn.Linear"):
        LoRALinear(nn.Embedding(3, 4), rank=1, alpha=1)
    apply_lora(model)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model)

    save_adapters(model, tmp_path / "rank8.safetensors")
    smaller = make("gpt2")
    apply_lora(smaller, LoRAConfig(rank=2, alpha=16.0))
    with pytest.raises(ValueError, match="shape"):
        load_adapters(smaller, tmp_path / "rank8.safetensors")
    llama = make("llama")  # no fc/proj layers: the file does not fit
    with pytest.raises(ValueError, match="no linear layer"):
        load_adapters(llama, tmp_path / "rank8.safetensors")
    assert not lora_layers(llama)
    with pytest.raises(ValueError, match="no adapter file"):
        load_adapters(llama, tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_adapters(llama, tmp_path / "junk.safetensors")
