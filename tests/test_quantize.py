"""llmscratch.quantize: int8 and int4 weights against a float64 numpy reference, and quantized GPTs."""
import copy

import numpy as np
import pytest
import torch
from torch import nn

from llmscratch.generate import generate
from llmscratch.model import GPT, GPTConfig
from llmscratch.quantize import (QuantizedLinear, dequantize_int4, dequantize_int8, quantize, quantize_int4,
                                 quantize_int8)
from tests.model_fixtures import randomize


def reference(weight: torch.Tensor, largest: int, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(q, dequantized) in float64: each group of a row scaled so that its largest |w| maps to ``largest``."""
    w = weight.double().numpy()
    q, out = np.zeros_like(w), np.zeros_like(w)
    for row in range(w.shape[0]):
        for start in range(0, w.shape[1], group_size):
            group = w[row, start : start + group_size]
            scale = np.abs(group).max() / largest
            q[row, start : start + group_size] = np.clip(np.round(group / scale), -largest, largest)
            out[row, start : start + group_size] = q[row, start : start + group_size] * scale
    return q, out


@pytest.mark.parametrize("shape", [(5, 7), (33, 64), (1, 1)])
def test_int8_is_per_row_rounding_to_127_steps(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    q, scales = quantize_int8(weight)
    expected_q, expected = reference(weight, 127, shape[1])
    assert q.dtype == torch.int8 and scales.shape == (shape[0],)
    np.testing.assert_array_equal(q.numpy(), expected_q)
    np.testing.assert_allclose(dequantize_int8(q, scales).double().numpy(), expected, rtol=1e-6, atol=1e-7)
    # no element moves by more than half a step of its row
    assert ((dequantize_int8(q, scales) - weight).abs() <= scales[:, None] / 2 * (1 + 1e-5)).all()


def test_int4_packs_two_values_a_byte_as_written_by_hand():
    weight = torch.tensor([[1.0, -0.4, 0.0, 0.25]])  # one group of 4: scale 1/7
    packed, scales = quantize_int4(weight, group_size=4)
    # q = round(7w) = [7, -3, 0, 2]; stored q + 8 = [15, 5, 8, 10]; byte j = column 2j | column 2j + 1 << 4
    assert packed.dtype == torch.uint8 and packed.tolist() == [[15 | 5 << 4, 8 | 10 << 4]]
    torch.testing.assert_close(scales, torch.tensor([[1 / 7]]))
    torch.testing.assert_close(dequantize_int4(packed, scales), torch.tensor([[1.0, -3 / 7, 0.0, 2 / 7]]))


@pytest.mark.parametrize("group_size", [2, 8, 32, 64])
def test_int4_is_per_group_rounding_to_7_steps(group_size):
    weight = torch.randn(6, 64, generator=torch.Generator().manual_seed(group_size))
    weight[2, 5] = 40.0  # an outlier: it coarsens only its own group
    packed, scales = quantize_int4(weight, group_size)
    assert packed.shape == (6, 32) and scales.shape == (6, 64 // group_size)
    _, expected = reference(weight, 7, group_size)
    np.testing.assert_allclose(dequantize_int4(packed, scales).double().numpy(), expected, rtol=1e-6, atol=1e-6)


def test_a_quantized_linear_multiplies_by_its_dequantized_weight():
    linear = nn.Linear(64, 24, bias=True)
    x = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(0))
    for scheme, largest, group_size in [("int8", 127, 64), ("int4", 7, 16)]:
        layer = QuantizedLinear(linear, scheme, group_size)
        _, dequantized = reference(linear.weight.detach(), largest, group_size)
        expected = x.double() @ torch.from_numpy(dequantized).T + linear.bias.detach().double()
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
        assert not any(True for _ in layer.parameters())  # nothing to train, nothing for an optimizer


def tiny_gpt(llama: bool) -> GPT:
    config = (GPTConfig(vocab_size=97, context_length=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                        norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False, bias=False) if llama else
              GPTConfig(vocab_size=97, context_length=32, d_model=32, n_layers=2, n_heads=4))
    model = GPT(config)
    randomize(model, seed=int(llama), scale=0.3)
    return model.eval()


@pytest.mark.parametrize("llama", [False, True])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_gpt_is_the_gpt_with_its_weights_rounded(llama, scheme):
    model = tiny_gpt(llama)
    before = copy.deepcopy(model.state_dict())
    quantized = quantize(model, scheme, group_size=16)
    block_linears = [name for name, m in model.blocks.named_modules() if isinstance(m, nn.Linear)]
    assert block_linears and all(isinstance(quantized.blocks.get_submodule(n), QuantizedLinear) for n in block_linears)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the original is untouched
    assert type(quantized.lm_head) is nn.Linear and torch.equal(quantized.token_embedding.weight,
                                                                model.token_embedding.weight)
    # The same model with every block weight replaced by its dequantized value gives the same logits and text.
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for name in block_linears:
            rounded.blocks.get_submodule(name).weight.copy_(quantized.blocks.get_submodule(name).weight)
    idx = torch.randint(97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(quantized(idx), rounded(idx), rtol=1e-5, atol=1e-5)
    assert torch.equal(generate(quantized, idx, 12), generate(rounded, idx, 12))


@pytest.mark.parametrize("llama", [False, True])
def test_int8_logits_are_closer_to_the_model_than_int4(llama):
    model, idx = tiny_gpt(llama), torch.randint(97, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        exact = model(idx)
        errors = {scheme: (quantize(model, scheme, group_size=32)(idx) - exact).abs().mean().item()
                  for scheme in ("int8", "int4")}
    # a weight's rounding error is a 254th of its row's range for int8, a 14th of its group's for int4
    assert 0 < errors["int8"] < errors["int4"] / 4, errors


@pytest.mark.parametrize("call, message", [
    (lambda: quantize(tiny_gpt(True), "int3"), "unknown quantization scheme 'int3'"),
    (lambda: quantize(tiny_gpt(True), "int4", group_size=24), "does not divide the layer's 32 input features"),
    (lambda: quantize(tiny_gpt(True), "int4", group_size=3), "even number of at least 2"),
    (lambda: quantize(nn.Linear(4, 4), "int8"), "expected a model with .blocks"),
])
def test_bad_settings_are_named(call, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        call()
