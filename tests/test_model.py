"""The GPT model: configs, presets, parameter and FLOP counts, paths that must agree."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from llmscratch.model.config import PRESETS, GPTConfig
from llmscratch.model.gpt import GPT

TINY_GPT2 = dict(vocab_size=97, context_length=24, d_model=32, n_layers=2, n_heads=4)
TINY_LLAMA = dict(vocab_size=89, context_length=24, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2,
                  d_ff=80, norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False, bias=False,
                  tie_embeddings=False, rope_theta=50_000.0)
TINY = {"gpt2": TINY_GPT2, "llama": TINY_LLAMA}


def make(kind: str, seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY[kind], **overrides})).eval()


@pytest.mark.parametrize("preset, published", [
    ("gpt2-small", 124_439_808), ("gpt2-medium", 354_823_168),
    ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200),
])
def test_gpt2_presets_have_the_published_parameter_counts(preset, published):
    with torch.device("meta"):  # shapes only: no memory for 1.5 billion weights
        model = GPT(GPTConfig.from_preset(preset))
    assert model.num_params() == published
    config = model.config
    embeddings = config.vocab_size * config.d_model + config.context_length * config.d_model
    assert model.num_params(include_embeddings=False) == published - embeddings


def test_tinyllama_preset_has_tinyllamas_parameter_count():
    with torch.device("meta"):
        model = GPT(GPTConfig.from_preset("tinyllama-1.1b"))
    assert model.num_params() == 1_100_048_384  # TinyLlama-1.1B's published size


def test_the_llama3_8b_preset_has_the_published_size():
    with torch.device("meta"):
        model = GPT(GPTConfig.from_preset("llama3-8b"))
    assert model.num_params() == 8_030_261_248  # Meta-Llama-3-8B's parameter count


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_builds_a_valid_config(preset):
    config = GPTConfig.from_preset(preset)
    assert config.d_model % config.n_heads == 0


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_logits_shape_and_tied_head(kind):
    model = make(kind)
    idx = torch.randint(model.config.vocab_size, (3, 11))
    assert model(idx).shape == (3, 11, model.config.vocab_size)
    tied = model.lm_head.weight is model.token_embedding.weight
    assert tied == model.config.tie_embeddings


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_fused_and_explicit_attention_give_the_same_model(kind):
    fused, explicit = make(kind), make(kind, fused_attention=False)
    explicit.load_state_dict(fused.state_dict())
    idx = torch.randint(fused.config.vocab_size, (2, 24))
    with torch.no_grad():
        assert (fused(idx) - explicit(idx)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_model_is_causal(kind):
    model = make(kind)
    idx = torch.randint(model.config.vocab_size, (2, 16))
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % model.config.vocab_size
    with torch.no_grad():
        assert torch.equal(model(idx)[:, :9], model(changed)[:, :9])
        assert not torch.allclose(model(idx)[:, 9:], model(changed)[:, 9:])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("fused", [True, False])
def test_kv_cache_decoding_equals_the_full_forward(kind, fused):
    model = make(kind, fused_attention=fused)
    idx = torch.randint(model.config.vocab_size, (2, 20))
    caches = model.make_kv_caches(batch_size=2, max_seq_len=20)
    with torch.no_grad():
        full = model(idx)
        steps = [model(idx[:, :7], caches, start_pos=0)]  # a prompt prefilled at once
        steps += [model(idx[:, t : t + 1], caches, start_pos=t) for t in range(7, 20)]
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-5


@pytest.mark.parametrize("n_kv_heads", [1, 2, 3, 6])  # multi-query, grouped (ratios 3 and 2), multi-head
def test_every_grouping_of_heads_decodes_like_the_full_forward(n_kv_heads):
    model = make("llama", n_kv_heads=n_kv_heads)
    explicit = make("llama", n_kv_heads=n_kv_heads, fused_attention=False)
    explicit.load_state_dict(model.state_dict())
    idx = torch.randint(model.config.vocab_size, (3, 16))
    caches = model.make_kv_caches(batch_size=3, max_seq_len=16)
    assert caches[0].keys.shape == (3, n_kv_heads, 16, 8)
    with torch.no_grad():
        full = model(idx)
        steps = [model(idx[:, :5], caches, start_pos=0)]
        steps += [model(idx[:, t : t + 1], caches, start_pos=t) for t in range(5, 16)]
        assert (explicit(idx) - full).abs().max().item() <= 1e-5
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_bfloat16_model_decodes_like_its_full_forward(kind):
    """Weights and KV cache in bf16; the two paths round differently, so compare at bf16's precision."""
    model = make(kind).to(torch.bfloat16)
    idx = torch.randint(model.config.vocab_size, (2, 20))
    caches = model.make_kv_caches(batch_size=2, max_seq_len=20)
    assert caches[0].keys.dtype == torch.bfloat16
    with torch.no_grad():
        full = model(idx).float()
        reference = make(kind)(idx)  # the fp32 model
        steps = [model(idx[:, :7], caches, start_pos=0)]
        steps += [model(idx[:, t : t + 1], caches, start_pos=t) for t in range(7, 20)]
    decoded = torch.cat(steps, dim=1).float()
    scale = reference.abs().max().item()
    assert (full - reference).abs().max().item() <= 0.02 * scale
    assert (decoded - reference).abs().max().item() <= 0.02 * scale


def test_context_longer_than_the_model_is_refused():
    model = make("gpt2")
    with pytest.raises(ValueError, match=r"positions 0\.\.24 exceed the model's context_length=24"):
        model(torch.zeros(1, 25, dtype=torch.long))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_flops_per_token_matches_a_flop_counter(kind):
    """Our closed-form count against PyTorch's own count of every matmul in one forward.

    The explicit attention path, because the counter sees its two matmuls (it has no formula
    for the CPU's fused attention kernel).
    """
    model = make(kind, fused_attention=False)
    seq_len = 24
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.zeros(1, seq_len, dtype=torch.long))
    assert model.flops_per_token(seq_len, training=False) * seq_len == counter.get_total_flops()
    assert model.flops_per_token(seq_len) == 3 * model.flops_per_token(seq_len, training=False)


def test_residual_projections_get_the_scaled_init():
    model = GPT(GPTConfig(**{**TINY_GPT2, "d_model": 256, "n_layers": 8}))
    scaled = model.blocks[0].attn.out_proj.weight.std().item()
    plain = model.blocks[0].attn.qkv.weight.std().item()
    assert abs(plain - 0.02) < 0.002
    assert abs(scaled - 0.02 / 4) < 0.001  # 0.02 / sqrt(2 * 8 layers)


@pytest.mark.parametrize("fields, message", [
    (dict(d_model=30, n_heads=4), r"d_model=30 is not divisible by n_heads=4"),
    (dict(n_heads=6, n_kv_heads=4, d_model=48), r"n_heads=6 is not divisible by n_kv_heads=4"),
    (dict(d_model=36, n_heads=4, position="rope"), r"RoPE needs an even head size.*9"),
    (dict(norm="batchnorm"), r"norm must be one of .*'batchnorm'"),
    (dict(vocab_size=0), r"vocab_size must be a positive integer, got 0"),
    (dict(dropout=1.5), r"dropout must be in \[0, 1\), got 1.5"),
    (dict(d_ff=0), r"d_ff must be a positive integer, got 0"),
    (dict(n_kv_heads=8), r"n_heads=4 is not divisible by n_kv_heads=8"),  # more kv heads than heads
    (dict(n_kv_heads=0), r"n_kv_heads must be a positive integer, got 0"),
    (dict(mlp="relu"), r"mlp must be one of \['gelu', 'swiglu', 'relu2', 'geglu'\], got 'relu'"),
    (dict(position="alibi"), r"position must be one of \['learned', 'rope'\], got 'alibi'"),
    (dict(context_length=0), r"context_length must be a positive integer, got 0"),
    (dict(rope_theta=0.0), r"rope_theta must be positive, got 0.0"),
    (dict(norm_eps=-1e-5), r"norm_eps must be positive, got -1e-05"),
    (dict(d_model=64.0), r"d_model must be an integer, got 64.0"),
    (dict(n_layers="2"), r"n_layers must be an integer, got '2'"),
    (dict(d_ff=True), r"d_ff must be an integer, got True"),
    (dict(rope_theta=float("nan")), r"rope_theta must be a finite number, got nan"),
    (dict(norm_eps=float("inf")), r"norm_eps must be a finite number, got inf"),
    (dict(dropout="0.1"), r"dropout must be a finite number, got '0.1'"),
    (dict(bias="no"), r"bias must be True or False, got 'no'"),
])
def test_bad_config_is_a_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**TINY_GPT2, **fields})


def test_bad_preset_or_override_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown preset 'gpt5'"):
        GPTConfig.from_preset("gpt5")
    with pytest.raises(ValueError, match=r"unknown GPTConfig fields \['n_layer'\]"):
        GPTConfig.from_preset("gpt2-small", n_layer=3)
