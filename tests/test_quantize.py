"""llmscratch.model.quantize: int8 and int4 weights against a float64 numpy reference, and quantized GPTs."""
import copy
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from llmscratch.files import CHECKSUM_KEY, read_safetensors, write_safetensors
from llmscratch.model.checkpoint import export_model, model_from_checkpoint
from llmscratch.model.config import GPTConfig
from llmscratch.model.generate import generate
from llmscratch.model.gpt import GPT
from llmscratch.model.moe import MoE
from llmscratch.model.quantize import (CHUNK_ROWS, KERNEL_ROWS, SCHEMES, QuantizedExperts, QuantizedLinear,
                                       dequantize_int4, dequantize_int8, dequantized_product, describe,
                                       from_word_order, group_sizes, native_dequantize, native_word_product,
                                       product_path, quantize, quantize_int4, quantize_int8, quantized_share,
                                       to_word_order, word_product)
from tests.model_fixtures import LATER_SHAPES, randomize

ROOT = Path(__file__).resolve().parent.parent


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
    assert isinstance(quantized.lm_head, QuantizedLinear) and quantized.lm_head.scheme == "int8"
    assert torch.equal(quantized.token_embedding.weight, model.token_embedding.weight)  # looked up in float32
    # The same model with every block weight and the head replaced by its dequantized value gives the same
    # logits and text (the head untied: the embedding keeps its float32 rows).
    rounded = copy.deepcopy(model)
    rounded.lm_head = nn.Linear(32, 97, bias=False)
    with torch.no_grad():
        for name in block_linears:
            rounded.blocks.get_submodule(name).weight.copy_(quantized.blocks.get_submodule(name).weight)
        rounded.lm_head.weight.copy_(quantized.lm_head.weight)
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


@pytest.mark.parametrize("first, second", [("int8", "int4"), ("int8", "int8"), ("int4", "int8"), ("int4", "int4")])
def test_a_quantized_model_is_not_quantized_again(tmp_path, first, second):
    # Its layers are no longer nn.Linear: a second pass found none, kept the first's integers and wrote the
    # second's settings, a file that could not be loaded. Refused, whether made here or loaded from a file.
    quantized = quantize(tiny_gpt(True), first, group_size=16)
    export_model(quantized, tmp_path / "q.safetensors")
    for model in (quantized, model_from_checkpoint(tmp_path / "q.safetensors")):
        with pytest.raises(ValueError, match=rf"already quantized \({first} weights.*quantize the float model"):
            quantize(model, second, group_size=16)
    half = tiny_gpt(False)  # a model quantized in part, by hand, with no settings recorded
    half.blocks[0].mlp.fc = QuantizedLinear(half.blocks[0].mlp.fc, first, 16)
    with pytest.raises(ValueError, match="already quantized"):
        quantize(half, second, group_size=16)


def tiny_moe(qwen3: bool = False) -> GPT:
    """LATER_SHAPES' mixture (5 experts of 24, top 2, a shared expert, a dense layer), or Qwen3-30B-A3B's design
    at a tiny size (every layer a mixture of 4 experts of 16, no shared expert)."""
    config = (GPTConfig.from_preset("qwen3-30b-a3b", vocab_size=101, context_length=16, d_model=32, n_layers=3,
                                    n_heads=2, n_kv_heads=1, head_size=16, d_ff=16, n_experts=4, experts_per_token=2)
              if qwen3 else GPTConfig(**{**LATER_SHAPES["moe"], "context_length": 16}))
    model = GPT(config)
    randomize(model, seed=11, scale=0.3)
    return model.eval()


def rounded_moe(model: GPT, largest: int, group_size: int) -> GPT:
    """``model`` with every block matrix (each expert's rows on their own) and the untied head replaced by its
    dequantized float64 reference: the model a quantized one should compute, written without quantize.py."""
    rounded = copy.deepcopy(model).double()
    rounded.lm_head = nn.Linear(model.config.d_model, model.config.vocab_size, bias=False).double()
    rounded.lm_head.weight.data.copy_(model.lm_head.weight.data)
    with torch.no_grad():
        for name, weight in rounded.named_parameters():
            if name.startswith("lm_head"):
                weight.copy_(torch.from_numpy(reference(weight, 127, weight.size(1))[1]))
            elif name.startswith("blocks") and weight.dim() >= 2 and "router" not in name:
                for matrix in weight.reshape(-1, *weight.shape[-2:]):  # one expert at a time
                    matrix.copy_(torch.from_numpy(reference(matrix.float(), largest, group_size)[1]))
    return rounded


@pytest.mark.parametrize("qwen3", [False, True])
@pytest.mark.parametrize("scheme, largest, group_size", [("int8", 127, None), ("int4", 7, 8)])
def test_a_mixture_of_experts_is_the_moe_with_each_experts_rows_rounded(qwen3, scheme, largest, group_size):
    # Its experts are stacked parameters, not nn.Linear: they used to stay float32 under an int8 label.
    model = tiny_moe(qwen3)
    quantized = quantize(model, scheme, group_size=group_size or 64)
    for _, moe in quantized.blocks.named_modules():
        if isinstance(moe, MoE):
            assert all(isinstance(getattr(moe, part), QuantizedExperts) for part in ("gate", "up", "down"))
    rounded = rounded_moe(model, largest, group_size or 10**9)  # int8: one scale for a whole row
    idx = torch.randint(model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(quantized(idx).double(), rounded(idx), rtol=1e-5, atol=1e-5)
    assert torch.equal(generate(quantized, idx, 10), generate(rounded, idx, 10))


@pytest.mark.parametrize("qwen3", [False, True])
def test_int8_logits_of_a_mixture_of_experts_are_within_rounding_of_the_float_model(qwen3):
    model = tiny_moe(qwen3)
    idx = torch.randint(model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        exact, int8 = model(idx), quantize(model, "int8")(idx)
    # Rounding moves a weight by at most half an int8 step, a 254th of its row's largest |w|: at most 1/254 of
    # each product's sum of |w x|. Summed to first order over the matrices a token passes in series (qkv, output,
    # gate or up, down in each block, then the head), with a factor 3 for the largest |w| of a row against its
    # typical one, the logits move by at most that share of their own size.
    in_series = 4 * model.config.n_layers + 1
    bound = 3 * in_series / 254 * exact.abs().mean().item()
    error = (int8 - exact).abs().mean().item()
    assert 0 < error < bound, (error, bound)


def test_the_share_of_matrix_weights_quantized_counts_the_experts():
    model = tiny_moe()
    quantized = quantize(model, "int8")
    left_float = {name for name, weight in quantized.named_parameters() if weight.dim() >= 2}
    assert left_float == {"token_embedding.weight", "blocks.0.mlp.router.weight"}  # looked up, and 5 x 48 scores
    matrices = sum(w.numel() for name, w in model.named_parameters() if w.dim() >= 2 and "embedding" not in name)
    head = model.config.vocab_size * model.config.d_model  # tied in the float model, its own int8 matrix here
    router = model.blocks[0].mlp.router.weight.numel()
    assert quantized_share(quantized) == pytest.approx(1 - router / (matrices + head))
    assert quantized_share(quantized) > 0.99  # the experts are most of it: left in float32 it was 64%
    assert describe(quantized.quantization, quantized) == "int8 weights (99.5% of the matrix weights)"
    assert quantized_share(model) == 0 and quantized_share(quantize(tiny_gpt(True), "int8")) == 1


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_mixture_of_experts_saves_and_loads_with_its_integers_and_scales(tmp_path, scheme):
    quantized = quantize(tiny_moe(), scheme, group_size=8)
    path = tmp_path / "moe.safetensors"
    export_model(quantized, path)
    _, tensors = read_safetensors(path)
    assert tensors["blocks.0.mlp.down.qweight"].shape == ((5, 48, 24) if scheme == "int8" else (5, 48, 12))
    assert tensors["blocks.0.mlp.down.scales"].shape == ((5, 48) if scheme == "int8" else (5, 48, 3))
    loaded = model_from_checkpoint(path).eval()
    assert loaded.quantization == quantized.quantization
    assert loaded.state_dict().keys() == quantized.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[name], t) for name, t in quantized.state_dict().items())
    idx = torch.randint(79, (1, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(loaded(idx), quantized(idx))
    assert torch.equal(generate(loaded, idx, 8), generate(quantized, idx, 8))


def test_an_int4_group_that_does_not_divide_an_experts_inputs_is_named():
    model = GPT(GPTConfig(**{**LATER_SHAPES["moe"], "context_length": 16, "d_expert": 20, "shared_experts": 0}))
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp\.down: int4 group_size 8 does not divide the layer's 20"):
        quantize(model, "int4", group_size=8)
    assert group_sizes(model) == [2, 4]  # the gcd of 48 (attention, the experts' gate and up), 64 (dense) and 20


def test_group_sizes_are_the_even_divisors_every_layer_shares():
    assert group_sizes(tiny_gpt(True)) == [2, 4, 8, 16, 32]  # inputs of 32 (attention, up) and 64 (down)
    model = GPT(GPTConfig(vocab_size=97, context_length=32, d_model=48, n_layers=1, n_heads=4, d_ff=96))
    assert group_sizes(model) == [2, 4, 6, 8, 12, 16, 24, 48]


def test_the_head_can_stay_in_float():
    model = tiny_gpt(True)
    kept = quantize(model, "int4", group_size=16, head=False)
    assert type(kept.lm_head) is nn.Linear and kept.lm_head.weight is kept.token_embedding.weight  # still tied
    assert kept.quantization == {"scheme": "int4", "group_size": 16, "head": False}


# --------------------------------------------------------------------------- the word order and its product
def test_word_order_puts_each_words_values_a_run_apart_as_written_by_hand():
    q = torch.arange(64, dtype=torch.int8).reshape(1, 64)  # two int8 blocks of 8 words x 4 values
    stored = to_word_order(q, 4)
    # word i of a block holds columns i, 8 + i, 16 + i, 24 + i of that block
    assert stored[0, :8].tolist() == [0, 8, 16, 24, 1, 9, 17, 25]
    assert stored[0, 32:36].tolist() == [32, 40, 48, 56]
    assert torch.equal(from_word_order(stored, 4), q)
    assert torch.equal(from_word_order(to_word_order(q, 8), 8), q)


def float64_product(x: torch.Tensor, layer: QuantizedLinear, reference_weight: np.ndarray) -> torch.Tensor:
    return x.double() @ torch.from_numpy(reference_weight).T


@pytest.mark.parametrize("scheme, group_size, in_features", [
    ("int8", None, 64), ("int8", None, 96), ("int4", 64, 128), ("int4", 8, 64), ("int4", 32, 192), ("int4", 128, 256),
    ("int4", 256, 512)])
def test_the_word_product_is_the_float64_product_with_the_dequantized_weight(scheme, group_size, in_features):
    generator = torch.Generator().manual_seed(in_features + (group_size or 0))
    linear = nn.Linear(in_features, 24, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(24, in_features, generator=generator))
    layer = QuantizedLinear(linear, scheme, group_size or 64)
    assert layer.word_order
    _, expected_weight = reference(linear.weight.detach(), SCHEMES[scheme], group_size or in_features)
    x = torch.randn(1, in_features, generator=generator)
    expected = float64_product(x, layer, expected_weight)
    torch.testing.assert_close(word_product(x, layer.qweight, layer.scales, scheme).double(), expected,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.double(), torch.from_numpy(expected_weight), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scheme, group_size, in_features", [("int8", None, 30), ("int4", 6, 30), ("int4", 48, 96)])
def test_a_layer_outside_the_word_order_keeps_its_columns_and_still_multiplies(scheme, group_size, in_features):
    linear = nn.Linear(in_features, 5)
    layer = QuantizedLinear(linear, scheme, group_size or 64)
    assert not layer.word_order
    _, expected_weight = reference(linear.weight.detach(), SCHEMES[scheme], group_size or in_features)
    x = torch.randn(2, in_features)
    torch.testing.assert_close(layer(x).double(), float64_product(x, layer, expected_weight) + linear.bias.double(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme, native", [("int8", True), ("int4", True), ("int4", False)])
def test_compiled_decoding_of_a_quantized_gpt_gives_the_eager_tokens(scheme, native):
    # d_model 64 and d_ff 128 fit the word order: the compiled step multiplies by the stored words.
    config = GPTConfig(vocab_size=97, context_length=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                       norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False, bias=False)
    model = GPT(config)
    randomize(model, seed=5, scale=0.3)
    quantized = quantize(model.eval(), scheme, group_size=64)
    for layer in (m for m in quantized.modules() if isinstance(m, QuantizedLinear)):
        assert layer.word_order
        layer.native = native  # False: as without a C compiler (the traced PyTorch word product)
    idx = torch.randint(97, (1, 7), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        assert torch.equal(generate(quantized, idx, 10, compile=True), generate(quantized, idx, 10))


# --------------------------------------------------------------------------- on a GPU
@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_off_the_cpu_the_path_does_not_depend_on_the_c_compiler(device):
    # The C kernels are CPU code: their presence once sent CUDA to a product that rebuilt float32 weights each call.
    for native, word_order, rows, grad, compiling in itertools.product([True, False], [True, False], [1, 8, 9, 64],
                                                                       [True, False], [True, False]):
        assert product_path(device, native, word_order, rows, grad, compiling) == "dequantize_in_product"


@pytest.mark.parametrize("native, word_order, rows, grad, compiling, path", [
    (True, True, 1, False, False, "kernel"), (True, True, KERNEL_ROWS, False, True, "kernel"),
    (True, True, KERNEL_ROWS + 1, False, False, "chunks"), (True, True, KERNEL_ROWS + 1, False, True, "weight"),
    (True, True, 1, True, False, "weight"), (False, True, 1, False, True, "word_product"),
    (False, True, 1, True, True, "word_product"), (False, True, 2, False, True, "weight"),
    (False, False, 1, False, True, "weight"), (False, True, 1, False, False, "weight"),
])
def test_on_a_cpu_the_paths_are_as_they_were(native, word_order, rows, grad, compiling, path):
    assert product_path("cpu", native, word_order, rows, grad, compiling) == path


@pytest.mark.parametrize("scheme, group_size, in_features", [("int8", None, 64), ("int8", None, 40), ("int4", 8, 64),
                                                             ("int4", 64, 128), ("int4", 16, 48)])
def test_the_gpu_form_is_the_product_with_the_dequantized_weight(scheme, group_size, in_features):
    # Run here on CPU tensors in float64: word-ordered (64, 128) or not (40, 48), int8 by reordering x.
    linear = nn.Linear(in_features, 24, bias=False)
    layer = QuantizedLinear(linear, scheme, group_size or 64)
    assert layer.word_order == (in_features % 64 == 0)
    x = torch.randn(2, 3, in_features, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    largest = SCHEMES[scheme]
    _, expected = reference(linear.weight.detach(), largest, group_size or in_features)
    got = dequantized_product(x, layer.qweight, layer.scales, scheme, layer.group_size, layer.word_order)
    torch.testing.assert_close(got, x @ torch.from_numpy(expected).T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("native", [True, False])
def test_a_layer_off_the_cpu_dequantizes_inside_the_product_with_or_without_a_compiler(native, monkeypatch):
    # On the meta device (no GPU here): a layer whose C kernel was built takes the GPU form all the same.
    from llmscratch.model import quantize as module
    calls = []

    def spy(*args):
        calls.append(args[3])
        return dequantized_product(*args)

    monkeypatch.setattr(module, "dequantized_product", spy)
    for scheme in ("int8", "int4"):
        layer = QuantizedLinear(nn.Linear(64, 24), scheme, 32).to("meta")
        layer.native = native
        for x in (torch.empty(1, 64, device="meta"), torch.empty(3, 5, 64, device="meta")):
            assert layer(x).shape == (*x.shape[:-1], 24)
    assert calls == ["int8", "int8", "int4", "int4"]


@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_on_cuda_compiled_quantized_decoding_gives_the_eager_tokens(scheme):
    config = GPTConfig(vocab_size=97, context_length=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                       norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False, bias=False)
    model = GPT(config)
    randomize(model, seed=5, scale=0.3)
    quantized = quantize(model.eval(), scheme, group_size=64)
    idx = torch.randint(97, (1, 7), generator=torch.Generator().manual_seed(6))
    on_gpu = copy.deepcopy(quantized).to("cuda")
    with torch.inference_mode():
        torch.testing.assert_close(on_gpu(idx.cuda()).cpu(), quantized(idx), rtol=1e-3, atol=1e-3)
        assert torch.equal(generate(on_gpu, idx.cuda(), 10, compile=True), generate(on_gpu, idx.cuda(), 10))


# --------------------------------------------------------------------------- the C kernels
def test_the_c_kernels_are_built_here():
    # Every machine that runs these tests has a C compiler (torch.compile needs one on a CPU); a silent
    # fall back to PyTorch would leave the kernel tests below testing nothing.
    assert QuantizedLinear(nn.Linear(64, 8), "int8").native


KERNEL_CASES = [("int8", None, 32, 1), ("int8", None, 96, 3), ("int4", 8, 64, 8), ("int4", 16, 192, 2),
                ("int4", 32, 128, 1), ("int4", 64, 320, 5), ("int4", 128, 384, 1), ("int4", 192, 384, 4)]


@pytest.mark.parametrize("scheme, group_size, in_features, rows", KERNEL_CASES)
def test_the_c_word_product_is_the_float64_product_with_the_dequantized_weight(scheme, group_size, in_features, rows):
    generator = torch.Generator().manual_seed(in_features + rows)
    out_features = 37  # odd: rows shared unevenly among threads
    linear = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=generator))
    layer = QuantizedLinear(linear, scheme, group_size or 64)
    _, expected_weight = reference(linear.weight.detach(), SCHEMES[scheme], group_size or in_features)
    x = torch.randn(rows, 2 * in_features, generator=generator)[:, ::2]  # not contiguous
    expected = float64_product(x, layer, expected_weight)
    got = native_word_product(x, layer.qweight, layer.scales, scheme, group_size or 0)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # the same through the layer (the operator), the PyTorch reading of it, and a bfloat16 input
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(word_product(x, layer.qweight, layer.scales, scheme).double(), expected,
                               rtol=1e-5, atol=1e-5)
    bf16 = native_word_product(x.bfloat16(), layer.qweight, layer.scales, scheme, group_size or 0)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.double(), float64_product(x.bfloat16().float(), layer, expected_weight),
                               rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("scheme, group_size, in_features, rows", KERNEL_CASES)
def test_the_c_dequantized_weight_is_the_pytorch_one_exactly(scheme, group_size, in_features, rows):
    layer = QuantizedLinear(nn.Linear(in_features, 19), scheme, group_size or 64)
    q = layer.values().float()
    groups = q.reshape(19, -1, group_size or in_features) * layer.scales.reshape(19, -1, 1)
    assert torch.equal(native_dequantize(layer.qweight, layer.scales, scheme, group_size or 0), groups.reshape(19, -1))


def test_threads_share_the_rows_without_changing_a_bit(one_torch_thread):
    layer = QuantizedLinear(nn.Linear(256, 301), "int4", 32)
    x = torch.randn(2, 256)
    alone = native_word_product(x, layer.qweight, layer.scales, "int4", 32)
    torch.set_num_threads(2)
    assert torch.equal(native_word_product(x, layer.qweight, layer.scales, "int4", 32), alone)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_many_rows_go_through_the_weight_in_chunks_and_gradients_reach_x(scheme, monkeypatch):
    out_features = 2 * CHUNK_ROWS + 45  # a last chunk that is not full
    layer = QuantizedLinear(nn.Linear(128, out_features), scheme, 32)
    x = torch.randn(KERNEL_ROWS + 1, 128, requires_grad=True)
    expected = nn.functional.linear(x.detach().double(), layer.weight.double(), layer.bias.double())
    chunked = []
    by_chunks = QuantizedLinear._product_by_chunks
    monkeypatch.setattr(QuantizedLinear, "_product_by_chunks",
                        lambda self, *args: chunked.append(1) or by_chunks(self, *args))
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
    assert chunked == [1]
    layer(x[:2]).sum().backward()  # few rows, but x needs a gradient: the float path
    torch.testing.assert_close(x.grad[:2].double(), layer.weight.double().sum(0).expand(2, -1), rtol=1e-5, atol=1e-5)


def test_operands_the_kernel_would_read_past_are_refused():
    layer = QuantizedLinear(nn.Linear(128, 8), "int4", 32)
    with pytest.raises(ValueError, match="x has 127 features; the layer takes 128"):
        native_word_product(torch.randn(1, 127), layer.qweight, layer.scales, "int4", 32)
    with pytest.raises(ValueError, match=r"not a word-ordered int4 layer.*group_size 64"):
        native_word_product(torch.randn(1, 128), layer.qweight, layer.scales, "int4", 64)
    with pytest.raises(ValueError, match="not a word-ordered int8 layer"):
        native_dequantize(layer.qweight, layer.scales, "int8", 0)
    # a group size that fits the word order but not the row: 192 inputs, groups of 128
    wide = QuantizedLinear(nn.Linear(192, 4), "int4", 64)
    with pytest.raises(ValueError, match="group_size 128"):
        native_word_product(torch.randn(1, 192), wide.qweight, wide.scales[:, :1].contiguous(), "int4", 128)
    with pytest.raises(ValueError, match="CPU tensors"):
        native_word_product(torch.randn(1, 128, device="meta"), layer.qweight, layer.scales, "int4", 32)


def test_the_kernel_writes_float32_whatever_the_default_dtype():
    layer = QuantizedLinear(nn.Linear(64, 8), "int8")
    x = torch.randn(1, 64)
    expected = native_word_product(x, layer.qweight, layer.scales, "int8", 0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert torch.equal(native_word_product(x, layer.qweight, layer.scales, "int8", 0), expected)
        expected_weight = layer.values() * layer.scales[:, None]
        assert torch.equal(native_dequantize(layer.qweight, layer.scales, "int8", 0), expected_weight)
    finally:
        torch.set_default_dtype(default)


KERNEL_FALLBACK = """
import json, warnings, torch
from torch import nn
from llmscratch.model.quantize import QuantizedLinear, native_word_product
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    layer = QuantizedLinear(nn.Linear(64, 8), "int8")
x = torch.randn(1, 64)
with torch.no_grad():
    torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
try:
    native_word_product(x, layer.qweight, layer.scales, "int8", 0)
    refusal = ""
except RuntimeError as err:
    refusal = str(err)
print(json.dumps({"native": layer.native, "warnings": " ".join(str(w.message) for w in caught), "refusal": refusal}))
"""


@pytest.mark.parametrize("environment, warning", [({"LLMSCRATCH_NO_NATIVE": "1"}, ""),
                                                  ({"CC": "false", "PATH": ""}, "no C compiler found")])
def test_without_a_compiler_the_layers_run_in_pytorch_and_say_so(tmp_path, environment, warning):
    env = {"XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT), "HOME": str(tmp_path), **environment}
    done = subprocess.run([sys.executable, "-c", KERNEL_FALLBACK], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["native"] is False and (warning in seen["warnings"] if warning else seen["warnings"] == "")
    assert "C kernel" in seen["refusal"] and "not built here" in seen["refusal"]  # the operator says why
    assert not list(tmp_path.rglob("*.so"))


def test_a_failing_compiler_is_reported_with_its_message(tmp_path):
    fake = tmp_path / "bin" / "cc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'cc: fatal error: no such thing' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = {"XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT), "HOME": str(tmp_path), "CC": str(fake)}
    done = subprocess.run([sys.executable, "-c", KERNEL_FALLBACK], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["native"] is False and "could not build the C kernel" in seen["warnings"]
    assert "no such thing" in seen["warnings"]


# --------------------------------------------------------------------------- saved and loaded
@pytest.mark.parametrize("scheme, head", [("int8", True), ("int4", True), ("int4", False)])
def test_a_quantized_model_saves_and_loads_with_its_integers_and_scales(tmp_path, scheme, head):
    model = tiny_gpt(True)
    quantized = quantize(model, scheme, group_size=16, head=head)
    path, half = tmp_path / "q.safetensors", tmp_path / "bf16.safetensors"
    export_model(quantized, half, dtype=torch.bfloat16)  # floats in bfloat16; the integers and scales as they are
    _, tensors = read_safetensors(half)
    assert tensors["blocks.0.mlp.up.qweight"].dtype == (torch.int8 if scheme == "int8" else torch.uint8)
    assert tensors["blocks.0.mlp.up.scales"].dtype == torch.float32
    assert tensors["token_embedding.weight"].dtype == torch.bfloat16
    assert ("lm_head.qweight" in tensors) == head and "lm_head.weight" not in tensors  # a tied head stored once
    export_model(quantized, path)
    loaded = model_from_checkpoint(path).eval()
    assert loaded.quantization == quantized.quantization
    for name, buffer in quantized.state_dict().items():
        if name.endswith((".qweight", ".scales")):
            assert torch.equal(loaded.state_dict()[name], buffer), name
    idx = torch.randint(97, (1, 9), generator=torch.Generator().manual_seed(7))
    assert torch.equal(generate(loaded, idx, 8), generate(quantized, idx, 8))
    with torch.no_grad():
        assert torch.equal(loaded(idx), quantized(idx))


def test_a_file_whose_integer_weights_became_floats_is_refused(tmp_path):
    quantized = quantize(tiny_gpt(True), "int8")
    path = tmp_path / "q.safetensors"
    export_model(quantized, path)
    metadata, tensors = read_safetensors(path)
    tensors["blocks.1.attn.qkv.qweight"] = tensors["blocks.1.attn.qkv.qweight"].float()
    write_safetensors(path, tensors, {k: v for k, v in metadata.items() if k != CHECKSUM_KEY})
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.qkv\.qweight: the file holds torch\.float32 values, "
                                         r"expected torch\.int8"):
        model_from_checkpoint(path)


def rewrite(path: Path, quantization=None, **tensors: torch.Tensor) -> None:
    """Change a model export's quantization metadata (a string: as it is; else as JSON) or some of its tensors."""
    metadata, stored = read_safetensors(path)
    metadata = {k: v for k, v in metadata.items() if k != CHECKSUM_KEY}
    if quantization is not None:
        metadata["quantization"] = quantization if isinstance(quantization, str) else json.dumps(quantization)
    write_safetensors(path, {**stored, **{k.replace("__", "."): v for k, v in tensors.items()}}, metadata)


INT4 = {"scheme": "int4", "group_size": 16, "head": True}


@pytest.mark.parametrize("quantization, message", [
    ("{int4", r"its metadata 'quantization' is not JSON"),
    ('"int4"', r"its metadata 'quantization' should be a JSON object, got str"),
    ("[1, 2]", r"its metadata 'quantization' should be a JSON object, got list"),
    ("null", r"its metadata 'quantization' should be a JSON object, got NoneType"),
    ({**INT4, "scheme": "int3"}, r"quantization scheme 'int3': expected one of \['int4', 'int8'\]"),
    ({**INT4, "scheme": ["int4"]}, r"quantization scheme \['int4'\]: expected one of"),
    ({**INT4, "scheme": None}, r"quantization scheme None: expected one of"),
    ({**INT4, "group_size": "16"}, r"quantization group_size '16': expected an even integer"),
    ({**INT4, "group_size": -16}, r"quantization group_size -16: expected an even integer"),
    ({**INT4, "group_size": 0}, r"quantization group_size 0: expected an even integer"),
    ({**INT4, "group_size": 16.0}, r"quantization group_size 16\.0: expected an even integer"),
    ({**INT4, "group_size": True}, r"quantization group_size True: expected an even integer"),
    ({**INT4, "group_size": 24}, r"group_size 24 does not divide the layer's 32 input features"),
    ({**INT4, "group_size": 10**9}, r"group_size 1000000000 does not divide"),
    ({**INT4, "scheme": "int8"}, r"quantization group_size 16: expected null for int8"),
    ({**INT4, "head": "yes"}, r"quantization head 'yes': expected true or false"),
    ({**INT4, "head": 1}, r"quantization head 1: expected true or false"),
    ({**INT4, "head": False}, r"quantization metadata .* and its tensors disagree: the file holds lm_head\.qweight"),
    ({"scheme": "int4", "group_size": 16}, r"quantization field\(s\) \['head'\] missing or unknown"),
    ({**INT4, "bits": 4}, r"quantization field\(s\) \['bits'\] missing or unknown"),
])
def test_quantization_metadata_of_the_wrong_type_is_named_with_its_file(tmp_path, quantization, message):
    path = tmp_path / "q.safetensors"
    export_model(quantize(tiny_gpt(True), "int4", group_size=16), path)
    rewrite(path, quantization)
    with pytest.raises(ValueError, match=rf"^{tmp_path}/q\.safetensors: .*{message}") as caught:
        model_from_checkpoint(path)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name, make, message", [
    ("blocks.0.mlp.up.qweight", lambda t: t[:, :-4], r"shape \(64, 12\), expected \(64, 16\)"),
    ("blocks.1.attn.qkv.scales", lambda t: t[:-1], r"shape \(63, 2\), expected \(64, 2\)"),
    ("lm_head.scales", lambda t: t[:, None], r"shape \(97, 1\), expected \(97,\)"),
    ("blocks.0.mlp.down.qweight", lambda t: t.view(torch.int8), r"holds torch\.int8 values, expected torch\.uint8"),
    ("blocks.0.attn.out_proj.scales", lambda t: t.to(torch.int32), r"holds torch\.int32 values, expected floating"),
])
def test_quantized_tensors_of_the_wrong_shape_or_dtype_are_named_with_their_file(tmp_path, name, make, message):
    path = tmp_path / "q.safetensors"
    export_model(quantize(tiny_gpt(True), "int4", group_size=16), path)
    _, stored = read_safetensors(path)
    rewrite(path, **{name.replace(".", "__"): make(stored[name]).contiguous()})
    with pytest.raises(ValueError, match=rf"^{tmp_path}/q\.safetensors: {name.replace('.', '[.]')}: .*{message}"):
        model_from_checkpoint(path)


def test_the_script_writes_a_model_that_other_scripts_load(tmp_path):
    out = tmp_path / "int4.safetensors"
    done = subprocess.run([sys.executable, "ch07-deployment/quantize.py", "--scheme", "int4", "--out", str(out),
                           "--test-mode"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    before, after = (float(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines() if "bits per byte" in line)
    assert abs(after - before) < 0.08, done.stdout
    shown = subprocess.run([sys.executable, "ch03-architecture/generate.py", str(out), "--prompt", "Call me",
                            "--temperature", "0", "--max-new-tokens", "5"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0 and shown.stdout.startswith("Call me"), shown.stderr


def test_a_row_or_group_of_zeros_stays_zero_with_a_normal_scale():
    weight = torch.zeros(2, 16)
    weight[1] = torch.linspace(-1, 1, 16)
    torch.set_flush_denormal(True)  # where denormals flush to 0, a subnormal scale would be 0 / 0
    try:
        for q, scales, back in [(*quantize_int8(weight), dequantize_int8),
                                (*quantize_int4(weight, 8), dequantize_int4)]:
            assert (scales >= torch.finfo(torch.float32).tiny).all()
            assert torch.equal(back(q, scales)[0], torch.zeros(16))
    finally:
        torch.set_flush_denormal(False)
