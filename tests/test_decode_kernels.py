"""The compiled CPU decoding step's plain math (llmscratch/model/decode_kernels.py) against the library's kernels."""

import re

import pytest
import torch
import torch.nn.functional as F
from model_fixtures import randomize
from torch._inductor.utils import run_and_get_code

import llmscratch.model.decode_kernels as decode_kernels
from llmscratch.model.config import GPTConfig
from llmscratch.model.decode_kernels import OneRowMath, one_query_attention, one_row_linear
from llmscratch.model.generate import compiled_decode_one_token, generate
from llmscratch.model.gpt import GPT


def float64(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(37,), (1, 37), (1, 1, 37), (1, 1, 1, 37)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_one_row_linear_is_f_linear(shape, with_bias):
    x, weight = float64(*shape), float64(53, 37, seed=1)
    bias = float64(53, seed=2) if with_bias else None
    expected = F.linear(x, weight, bias)
    actual = one_row_linear(x, weight, bias)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def test_one_row_linear_sums_bfloat16_in_float32_as_f_linear_does():
    x, weight, bias = (t.bfloat16() for t in (float64(1, 1, 3072), float64(64, 3072, seed=1), float64(64, seed=2)))
    exact = F.linear(x.double(), weight.double(), bias.double())
    actual = one_row_linear(x, weight, bias)
    assert actual.dtype == torch.bfloat16
    # One rounding to bfloat16 at the end (2^-8 of the value), not one per partial sum of 3,072 terms.
    torch.testing.assert_close(actual.double(), exact, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(actual, F.linear(x, weight, bias), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 4), (6, 2), (8, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("batch_size, seq_len", [(1, 1), (1, 9), (3, 17)])
def test_one_query_attention_is_sdpa_with_a_mask(n_heads, n_kv_heads, batch_size, seq_len):
    q = float64(batch_size, n_heads, 1, 16)
    k, v = float64(batch_size, n_kv_heads, seq_len, 16, seed=1), float64(batch_size, n_kv_heads, seq_len, 16, seed=2)
    visible = torch.arange(seq_len) <= seq_len // 2  # a cache filled up to the middle
    additive = torch.zeros(1, seq_len, dtype=torch.float64).masked_fill(~visible, float("-inf")) + 0.3 * float64(
        1, seq_len, seed=3)
    for mask in (visible[None], additive):  # (1, S): booleans, and a float mask added to the scores
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=n_kv_heads != n_heads)
        actual = one_query_attention(q, k, v, mask)
        assert actual.shape == (batch_size, n_heads, 1, 16)
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def test_the_mode_swaps_only_one_row_and_one_masked_query(monkeypatch):
    """Several rows, several queries, no mask, causal, dropout or a scale: the library's kernel, untouched."""
    calls = []
    for name in ("one_row_linear", "one_query_attention"):
        original = getattr(decode_kernels, name)
        monkeypatch.setattr(decode_kernels, name,
                            lambda *args, _name=name, _original=original: calls.append(_name) or _original(*args))
    weight, bias = float64(11, 7, seed=1), float64(11, seed=2)
    q, k, v = float64(1, 4, 1, 8), float64(1, 2, 5, 8, seed=1), float64(1, 2, 5, 8, seed=2)
    mask = torch.ones(1, 5, dtype=torch.bool)
    cases = {  # a call, and whether the mode computes it as plain math
        "one row": (lambda: F.linear(float64(1, 7), weight, bias), True),
        "one row, bias by keyword": (lambda: F.linear(float64(1, 1, 7), weight, bias=bias), True),
        "two rows": (lambda: F.linear(float64(2, 7), weight, bias), False),
        "one masked query": (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), True),
        "two queries": (lambda: F.scaled_dot_product_attention(q.expand(1, 4, 2, 8), k, v,
                                                               attn_mask=mask.expand(2, 5), enable_gqa=True), False),
        "no mask": (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), False),
        "causal": (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), False),
        "a scale": (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5, enable_gqa=True),
                    False),
        "dropout": (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5,
                                                           enable_gqa=True), False),
    }
    for name, (call, swapped) in cases.items():
        calls.clear()
        torch.manual_seed(0)
        expected = call()
        with OneRowMath():
            torch.manual_seed(0)  # the same dropout draws
            actual = call()
        assert bool(calls) == swapped, f"{name}: swapped={bool(calls)}, expected {swapped}"
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12, msg=name)


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_the_plain_math_step_is_chosen_for_several_cpu_threads_only(two_threads):
    several = compiled_decode_one_token()
    assert compiled_decode_one_token(device="cpu") is several
    assert compiled_decode_one_token(device="cuda") is not several  # cuBLAS keeps the products
    torch.set_num_threads(1)
    assert compiled_decode_one_token() is not several  # one thread: BLAS's one-row kernel is as fast
    assert compiled_decode_one_token() is compiled_decode_one_token(device="cuda")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_compiled_batch_one_decoding_traces_plain_math_and_keeps_the_tokens(kind, two_threads):
    """Batch 1, compiled: on two threads no product is left to BLAS (on one, all are); the eager tokens."""
    configs = {
        "gpt2": dict(vocab_size=101, context_length=48, d_model=40, n_layers=3, n_heads=5),
        "llama": dict(vocab_size=83, context_length=48, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, d_ff=72,
                      norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False, bias=False,
                      tie_embeddings=False, qk_norm=True),
    }
    model = GPT(GPTConfig(**configs[kind]))
    randomize(model, seed=3, scale=0.3)
    model.eval()
    idx = torch.randint(model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    products = re.compile(r"extern_kernels\.(addmm|mm)\(")  # the library's matrix products in inductor's code
    torch.set_num_threads(1)
    torch._dynamo.reset()  # trace here, whatever an earlier test compiled
    _, (code,) = run_and_get_code(generate, model, idx, 30, compile=True)
    assert len(products.findall(code)) == len(linears(model))  # one thread: BLAS, one call per weight matrix
    torch.set_num_threads(2)
    compiled, (code,) = run_and_get_code(generate, model, idx, 30, compile=True)
    assert not products.findall(code)  # every product is inductor's own loop
    assert torch.equal(compiled, generate(model, idx, 30))


def linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
