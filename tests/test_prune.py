"""llmscratch.deployment.prune: magnitude pruning against numpy, structured pruning against the masked original model,
Taylor importance against finite differences."""
import copy

import numpy as np
import pytest
import torch
from torch import nn

from llmscratch.deployment.prune import (block_linears, importance, layer_sparsity, least_important, magnitude_prune,
                                         plot_sparsity_sweep, prune_structured, recover)
from llmscratch.model.checkpoint import export_model, model_from_checkpoint, save_checkpoint
from llmscratch.model.config import GPTConfig
from llmscratch.model.generate import generate
from llmscratch.model.gpt import GPT
from llmscratch.model.quantize import quantize
from tests import tiny_training
from tests.model_fixtures import randomize

# GPT-2-style (multi-head, biases, learned positions, GELU; relu2 is the bundled model's MLP) and
# Llama-style (grouped-query attention, SwiGLU, RoPE, QK-norm, untied head).
DESIGNS = {
    "gpt2": dict(d_model=24, n_heads=4, d_ff=40),
    "gpt2-relu2-untied": dict(d_model=24, n_heads=4, d_ff=40, mlp="relu2", tie_embeddings=False),
    "llama": dict(d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, norm="rmsnorm", mlp="swiglu", position="rope",
                  qkv_bias=False, bias=False, qk_norm=True, tie_embeddings=False),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_model(design: str, seed: int = 0, n_layers: int = 2) -> GPT:
    model = GPT(GPTConfig(vocab_size=61, context_length=24, n_layers=n_layers, **DESIGNS[design]))
    randomize(model, seed, 0.3)
    return model.double().eval()


def ids(seed: int, shape=(2, 12)) -> torch.Tensor:
    return torch.randint(61, shape, generator=torch.Generator().manual_seed(seed))


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


# --------------------------------------------------------------------------- unstructured
@pytest.mark.parametrize("sparsity", [0.0, 0.37, 0.9, 1.0])
def test_layer_magnitude_pruning_zeroes_each_matrix_s_smallest_weights(sparsity):
    model = random_model("llama")
    before = state(model)
    pruned = magnitude_prune(model, sparsity)
    for name, layer in block_linears(pruned):
        original = before[name + ".weight"].numpy()
        count = round(sparsity * original.size)
        smallest = np.argsort(np.abs(original).ravel(), kind="stable")[:count]  # the reference
        expected = original.ravel().copy()
        expected[smallest] = 0.0
        np.testing.assert_array_equal(layer.weight.detach().numpy().ravel(), expected, err_msg=name)
        assert (layer.weight == 0).sum().item() == count
    for name, tensor in state(model).items():  # the original is untouched
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)
    kept = {n: t for n, t in pruned.state_dict().items() if not n.endswith(".weight") or "norm" in n
            or "embedding" in n or "lm_head" in n}
    for name, tensor in kept.items():  # biases, norms, embeddings and the head stay as they were
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0, msg=name)


def test_global_magnitude_pruning_uses_one_threshold_for_all_layers():
    model = random_model("gpt2")
    with torch.no_grad():  # one layer of small weights: a global threshold takes most of it
        model.blocks[1].mlp.fc.weight.mul_(0.1)
    pruned = magnitude_prune(model, 0.4, scope="global")
    names = [name for name, _ in block_linears(model)]
    everything = np.concatenate([model.get_submodule(n).weight.detach().numpy().ravel() for n in names])
    threshold = np.sort(np.abs(everything))[round(0.4 * everything.size) - 1]
    report = layer_sparsity(pruned)
    for name in names:
        original = model.get_submodule(name).weight.detach().numpy()
        expected = np.where(np.abs(original) <= threshold, 0.0, original)
        np.testing.assert_array_equal(pruned.get_submodule(name).weight.detach().numpy(), expected, err_msg=name)
        assert report[name] == pytest.approx((expected == 0).mean())
    assert report["all"] == pytest.approx(round(0.4 * everything.size) / everything.size)
    assert report["blocks.1.mlp.fc"] > 0.9 and report["blocks.0.mlp.fc"] < 0.4


def test_zero_sparsity_is_the_identity():
    model, x = random_model("gpt2"), ids(1)
    for scope in ("layer", "global"):
        same = magnitude_prune(model, 0.0, scope)
        assert same is not model
        torch.testing.assert_close(same(x), model(x), rtol=0, atol=0)
        assert layer_sparsity(same)["all"] == 0.0


# --------------------------------------------------------------------------- structured
def masked_reference(model: GPT, heads, neurons) -> GPT:
    """The original model with the removed key/value groups' query heads and the removed neurons silenced:
    their columns of out_proj and of the MLP's last layer set to zero (what prune_structured must equal)."""
    reference = copy.deepcopy(model)
    config = model.config
    group, hs = config.n_heads // config.kv_heads, config.head_dim
    with torch.no_grad():
        for i, block in enumerate(reference.blocks):
            for kv in heads[i] if heads else []:
                block.attn.out_proj.weight[:, kv * group * hs : (kv + 1) * group * hs] = 0.0
            last = block.mlp.down if config.mlp == "swiglu" else block.mlp.proj
            for neuron in neurons[i] if neurons else []:
                last.weight[:, neuron] = 0.0
    return reference


@pytest.mark.parametrize("design", list(DESIGNS))
@pytest.mark.parametrize("which", ["heads", "neurons", "both"])
def test_a_pruned_model_computes_what_the_masked_original_does(design, which):
    model = random_model(design, seed=3)
    before = state(model)
    config = model.config
    heads = [[1], [0]] if which != "neurons" else None  # different groups in each layer
    neurons = [[0, 5, 7, 20], [3, 4, 11, 39]] if which != "heads" else None
    pruned = prune_structured(model, heads=heads, neurons=neurons)
    reference = masked_reference(model, heads, neurons)
    x = ids(4)
    torch.testing.assert_close(pruned(x), reference(x), rtol=1e-10, atol=1e-10)
    # the matrices really shrink, and the new config says so
    n_kv, hidden = config.kv_heads - (1 if heads else 0), config.hidden_dim - (4 if neurons else 0)
    hs, n_q = config.head_dim, n_kv * config.n_heads // config.kv_heads
    assert (pruned.config.kv_heads, pruned.config.n_heads, pruned.config.head_dim) == (n_kv, n_q, hs)
    assert pruned.config.hidden_dim == hidden
    for block in pruned.blocks:
        assert block.attn.qkv.weight.shape == ((n_q + 2 * n_kv) * hs, config.d_model)
        assert block.attn.out_proj.weight.shape == (config.d_model, n_q * hs)
        assert [layer.weight.shape for _, layer in block.mlp.named_children()] == (
            [(hidden, config.d_model)] * (len(list(block.mlp.children())) - 1) + [(config.d_model, hidden)])
    group, d, inputs = config.n_heads // config.kv_heads, config.d_model, 2 if config.mlp == "swiglu" else 1
    per_group = (group + 2) * hs * (d + config.qkv_bias) + group * hs * d  # qkv rows, out_proj columns
    per_neuron = inputs * (d + config.bias) + d  # fc (or gate and up) rows, proj (or down) column
    removed = config.n_layers * ((1 if heads else 0) * per_group + (4 if neurons else 0) * per_neuron)
    assert pruned.num_params() == model.num_params() - removed
    # generation with the KV cache follows the reference's tokens; the original is untouched
    prompt = ids(5, (2, 5))
    expected = generate(reference, prompt, 12, use_cache=False)
    torch.testing.assert_close(generate(pruned, prompt, 12, use_cache=True), expected, rtol=0, atol=0)
    for name, tensor in state(model).items():
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)


def test_a_pruned_model_saves_and_loads_through_its_config(tmp_path):
    model = random_model("llama", seed=6).float()
    pruned = prune_structured(model, heads=[[0], [1]], neurons=[list(range(0, 48, 2))] * 2)
    x = ids(7)
    export_model(pruned, tmp_path / "model.safetensors")
    save_checkpoint(tmp_path / "checkpoint.pt", {"model": pruned.state_dict(), "model_config": pruned.config.to_dict()})
    for path in ("model.safetensors", "checkpoint.pt"):
        loaded = model_from_checkpoint(tmp_path / path).eval()
        assert loaded.config == pruned.config and "head_size=8" in repr(loaded.config)
        torch.testing.assert_close(loaded(x), pruned(x), rtol=0, atol=0)


def test_the_explicit_attention_path_runs_a_pruned_model_too():
    model = random_model("llama", seed=11)
    explicit = GPT(GPTConfig(**{**model.config.to_dict(), "fused_attention": False})).double().eval()
    explicit.load_state_dict(model.state_dict())
    heads, x = [[0], [1]], ids(12)
    torch.testing.assert_close(prune_structured(explicit, heads=heads)(x), prune_structured(model, heads=heads)(x),
                               rtol=1e-10, atol=1e-10)


def test_an_unpruned_config_prints_as_before():
    assert "head_size" not in repr(GPTConfig())
    assert GPTConfig(n_heads=6, head_size=64).head_dim == 64 and GPTConfig().head_dim == 64


# --------------------------------------------------------------------------- importance
def units(model: GPT):
    """(kind, layer, index, linear, columns): each key/value group's query-head columns of out_proj, and each
    neuron's column of the MLP's last layer: the columns a unit's gate scales."""
    config = model.config
    group_width = config.n_heads // config.kv_heads * config.head_dim
    last = "down" if config.mlp == "swiglu" else "proj"
    return ([("heads", i, kv, model.blocks[i].attn.out_proj, slice(kv * group_width, (kv + 1) * group_width))
             for i in range(config.n_layers) for kv in range(config.kv_heads)]
            + [("neurons", i, n, getattr(model.blocks[i].mlp, last), slice(n, n + 1))
               for i in range(config.n_layers) for n in range(config.hidden_dim)])


def empty_scores(config: GPTConfig) -> dict[str, np.ndarray]:
    return {"heads": np.zeros((config.n_layers, config.kv_heads)),
            "neurons": np.zeros((config.n_layers, config.hidden_dim))}


def finite_difference_scores(model: GPT, batches, eps: float = 1e-6) -> dict[str, np.ndarray]:
    """sum over batches of |dL/dg| by central differences, the gate g scaling the unit's columns."""
    scores = empty_scores(model.config)
    with torch.no_grad():
        for inputs, targets in batches:
            for kind, layer, unit, linear, columns in units(model):
                original = linear.weight[:, columns].clone()
                losses = []
                for gate in (1 + eps, 1 - eps):
                    linear.weight[:, columns] = gate * original
                    losses.append(model(inputs, targets=targets).item())
                linear.weight[:, columns] = original
                scores[kind][layer, unit] += abs(losses[0] - losses[1]) / (2 * eps)
    return scores


def weight_gradient_scores(model: GPT, batches) -> dict[str, np.ndarray]:
    """The same by the chain rule through the weights: dL/dg = sum of W * dL/dW over the unit's columns."""
    scores = empty_scores(model.config)
    for inputs, targets in batches:
        found = units(model)
        grads = torch.autograd.grad(model(inputs, targets=targets), [linear.weight for *_, linear, _ in found])
        for (kind, layer, unit, linear, columns), grad in zip(found, grads):
            scores[kind][layer, unit] += abs((linear.weight[:, columns] * grad[:, columns]).sum().item())
    return scores


@pytest.mark.parametrize("design", list(DESIGNS))
def test_taylor_importance_is_the_gradient_of_the_loss_by_each_unit_s_gate(design):
    model = random_model(design, seed=8)
    batches = [(ids(s), ids(s + 100)) for s in (9, 10)]
    heads, neurons = importance(model, batches)
    expected = weight_gradient_scores(model, batches)
    np.testing.assert_allclose(heads.numpy(), expected["heads"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(neurons.numpy(), expected["neurons"], rtol=1e-9, atol=1e-12)
    if model.config.norm == "layernorm":  # float64 throughout (RMSNorm computes in float32): differences are exact
        expected = finite_difference_scores(model, batches)
        np.testing.assert_allclose(heads.numpy(), expected["heads"], rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(neurons.numpy(), expected["neurons"], rtol=1e-6, atol=1e-9)
    assert not any(p.grad is not None for p in model.parameters())  # only the gates got gradients
    assert not model.blocks[0].attn.out_proj._forward_pre_hooks  # the hooks are gone


def test_least_important_lists_each_layer_s_lowest_scores():
    scores = torch.tensor([[0.5, 0.1, 0.9, 0.2], [0.0, 3.0, 2.0, 1.0]])
    assert least_important(scores, 2) == [[1, 3], [0, 3]]
    assert least_important(scores, 0) == [[], []]
    with pytest.raises(ValueError, match=r"count must be in \[0, 4\)"):
        least_important(scores, 4)


def test_recover_finetunes_a_copy_with_the_trainer():
    train, val = tiny_training.tokens()
    torch.manual_seed(0)
    model = GPT(tiny_training.model_config())
    pruned = prune_structured(model, heads=[[1], [0]], neurons=[list(range(32))] * 2)
    before = state(pruned)
    tuned, summary = recover(pruned, tiny_training.tokenizer(), train, val, steps=6, batch_size=4, lr=3e-3,
                             final_eval_tokens=512, eval_tokens=256, peak_tflops=1.0)
    assert tuned is not pruned and tuned.config == pruned.config and summary["steps"] == 6
    assert np.isfinite(summary["val_bits_per_byte"])
    assert any(not torch.equal(t, before[n]) for n, t in tuned.state_dict().items())
    for name, tensor in state(pruned).items():
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)


def test_the_sweep_figure_has_one_curve_per_label():
    fig = plot_sparsity_sweep([0.0, 0.5, 0.9], {"per layer": [2.0, 2.1, 4.0], "global": [2.0, 2.2, 5.0]}, dense=2.0)
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.lines] == ["per layer", "global", "unpruned"]
    assert list(ax.lines[0].get_xdata()) == [0.0, 50.0, 90.0]


# --------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("call, message", [
    (lambda m: magnitude_prune(m, 1.5), r"sparsity must be a fraction in \[0, 1\], got 1.5"),
    (lambda m: magnitude_prune(m, -0.1), "sparsity must be"),
    (lambda m: magnitude_prune(m, 0.5, scope="row"), r"scope must be one of \['layer', 'global'\], got 'row'"),
    (lambda m: magnitude_prune(nn.Linear(2, 2), 0.5), "expected a model with .blocks"),
    (lambda m: magnitude_prune(quantize(m.float(), "int8"), 0.5), "blocks.0.attn.qkv is a QuantizedLinear"),
    (lambda m: prune_structured(nn.Linear(2, 2)), "expected a GPT"),
    (lambda m: prune_structured(m, heads=[[0]]), r"heads: expected one list per layer \(2\), got 1"),
    (lambda m: prune_structured(m, heads=[[0], []]), "every layer must lose as many"),
    (lambda m: prune_structured(m, heads=[[0, 0], [0, 1]]), "layer 0 must list distinct indices"),
    (lambda m: prune_structured(m, neurons=[[48], [0]]), r"neurons: layer 0 must list distinct indices in \[0, 48\)"),
    (lambda m: prune_structured(m, heads=[[0, 1], [0, 1]]), "removing 2 of 2 leaves none"),
    (lambda m: importance(quantize(m.float(), "int8"), []), "not an nn.Linear"),
    (lambda m: recover(m, None, None, None, steps=0), "steps must be a positive number"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call(random_model("llama"))


def test_a_mixture_of_experts_is_refused_with_the_reason():
    config = GPTConfig.from_preset("llama-tiny", vocab_size=64, context_length=16, n_experts=4)
    with pytest.raises(ValueError, match="pruning a mixture of experts is not supported"):
        magnitude_prune(GPT(config), 0.5)
