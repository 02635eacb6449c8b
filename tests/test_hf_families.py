"""Arcee (the course's squared-ReLU Llama), Qwen3, Gemma 3 (text), Qwen3-MoE and Mixtral: our GPT against transformers' own random-weight models (offline).

Shapes no preset has: heads whose width is not d_model / n_heads, windows shorter than the prompt,
expert counts that divide neither the tokens nor k, a dense layer among the MoE ones.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must never reach for the hub here

import transformers  # noqa: E402  (a test-only dependency, in requirements.txt)
from model_fixtures import randomize  # noqa: E402

from llmscratch.model.config import GPTConfig  # noqa: E402
from llmscratch.model.generate import generate  # noqa: E402
from llmscratch.model.gpt import GPT
from llmscratch.model.hf_formats import config_from_hf, family_of  # noqa: E402
from llmscratch.model.weights import load_hf, save_hf  # noqa: E402

TOLERANCE = 1e-4  # max |logit difference| in float32


def hf_arcee(**changes):
    fields = dict(vocab_size=293, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=None,
                  eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 20_000.0})
    return _random(transformers.ArceeConfig(**{**fields, **changes}), transformers.ArceeForCausalLM, seed=8)


def hf_qwen3(tie: bool = True, **changes):
    fields = dict(vocab_size=301, hidden_size=48, intermediate_size=88, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=10, max_position_embeddings=80, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 54_321.0}, tie_word_embeddings=tie)
    return _random(transformers.Qwen3Config(**{**fields, **changes}), transformers.Qwen3ForCausalLM, seed=3)


def hf_gemma3(**changes):
    fields = dict(vocab_size=307, hidden_size=40, intermediate_size=72, num_hidden_layers=5, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=14, query_pre_attn_scalar=24, sliding_window=5,
                  layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                               "full_attention"], max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100_000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    return _random(transformers.Gemma3TextConfig(**{**fields, **changes}), transformers.Gemma3ForCausalLM, seed=4)


def hf_qwen3_moe(**changes):
    fields = dict(vocab_size=283, hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=5,
                  num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=72,
                  rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, tie_word_embeddings=False)
    return _random(transformers.Qwen3MoeConfig(**{**fields, **changes}), transformers.Qwen3MoeForCausalLM, seed=5)


def hf_mixtral(**changes):
    fields = dict(vocab_size=289, hidden_size=60, intermediate_size=36, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=3, num_local_experts=7, num_experts_per_tok=3, max_position_embeddings=64,
                  sliding_window=9, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    return _random(transformers.MixtralConfig(**{**fields, **changes}), transformers.MixtralForCausalLM, seed=6)


def _random(config, model_class, seed: int):
    config._attn_implementation = "eager"
    model = model_class(config).eval()
    randomize(model, seed=seed, scale=0.2)  # 0.2: greedy decoding does not settle on one token
    return model


HF_MODELS = {
    "arcee-relu2-gqa": hf_arcee,
    "arcee-gelu-biases-tied": lambda: hf_arcee(hidden_act="gelu_pytorch_tanh", attention_bias=True, mlp_bias=True,
                                               tie_word_embeddings=True),
    "qwen3-tied-wide-heads": hf_qwen3,
    "qwen3-untied-mha": lambda: hf_qwen3(tie=False, num_key_value_heads=6, head_dim=8),
    "qwen3-sliding-top-layers": lambda: hf_qwen3(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    "qwen3-sliding-linear-rope": lambda: hf_qwen3(use_sliding_window=True, sliding_window=4, max_window_layers=2,
                                                  rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 54_321.0}),
    "gemma3-window-5-linear-rope": hf_gemma3,
    "gemma3-gqa-scalar-head": lambda: hf_gemma3(num_key_value_heads=2, query_pre_attn_scalar=14, sliding_window=3,
                                                tie_word_embeddings=False),
    "qwen3-moe-5-experts-top-2": hf_qwen3_moe,
    "qwen3-moe-unnormalised-top-3": lambda: hf_qwen3_moe(norm_topk_prob=False, num_experts_per_tok=3,
                                                         mlp_only_layers=[]),
    "mixtral-7-experts-top-3-window-9": hf_mixtral,
}


def batches(vocab_size: int, context_length: int, seed: int = 0):
    """One token; 17 (past every window here); the whole context."""
    generator = torch.Generator().manual_seed(seed)
    for batch, length in [(1, 1), (3, 17), (2, context_length)]:
        yield torch.randint(vocab_size, (batch, length), generator=generator)


@pytest.fixture(scope="module", params=sorted(HF_MODELS))
def pair(request, tmp_path_factory):
    """(transformers' model, ours loaded from its save_pretrained folder, the folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    reference = HF_MODELS[request.param]()
    reference.save_pretrained(folder)
    return reference, load_hf(folder).eval(), folder


def test_logits_equal_transformers(pair):
    reference, ours, _ = pair
    for idx in batches(ours.config.vocab_size, ours.config.context_length):
        with torch.no_grad():
            expected, got = reference(idx).logits, ours(idx)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() <= TOLERANCE


def test_greedy_generation_with_the_cache_equals_transformers(pair):
    reference, ours, _ = pair
    idx = torch.randint(ours.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    new = ours.config.context_length - 7 - 1  # decoding far past every sliding window
    with torch.no_grad():
        expected = reference.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=new, do_sample=False,
                                      pad_token_id=0, eos_token_id=None)
    got = generate(ours, idx, new, temperature=0.0)
    assert torch.equal(got, expected)
    assert len(set(got[0, 7:].tolist())) > 3  # a model stuck on one token would hide a wrong cache


def test_save_hf_round_trips_through_transformers(pair, tmp_path):
    _, ours, folder = pair
    save_hf(ours, tmp_path)
    assert config_from_hf(transformers.AutoConfig.from_pretrained(tmp_path).to_dict()) == ours.config
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    again = load_hf(tmp_path).eval()
    for idx in batches(ours.config.vocab_size, ours.config.context_length, seed=2):
        with torch.no_grad():
            assert (reloaded(idx).logits - ours(idx)).abs().max().item() <= TOLERANCE
            assert (again(idx) - ours(idx)).abs().max().item() <= TOLERANCE


def test_families_are_recognised():
    families = {name: family_of(config_from_hf(model().config.to_dict())) for name, model in
                {"arcee": hf_arcee, "qwen3": hf_qwen3, "gemma3_text": hf_gemma3, "qwen3_moe": hf_qwen3_moe, "mixtral": hf_mixtral}.items()}
    assert families == {name: name for name in families}


@pytest.mark.parametrize("change, message", [
    (dict(post_norms=False), "lacks post_norms"),
    (dict(bias=True, qkv_bias=True), "has biases"),
    (dict(shared_experts=1), "shared experts"),
])
def test_a_config_no_family_holds_is_named(change, message):
    gemma = config_from_hf(hf_gemma3().config.to_dict())
    moe = config_from_hf(hf_qwen3_moe().config.to_dict())
    config = GPTConfig(**{**(moe if "shared_experts" in change else gemma).to_dict(), **change})
    with pytest.raises(ValueError, match=message):
        family_of(config)


def test_the_language_model_of_a_multimodal_gemma3_loads(tmp_path):
    """Gemma 3 4B and larger are image-and-text models: their language model is read, the vision tower left out."""
    text = dict(vocab_size=307, hidden_size=40, intermediate_size=72, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=14, sliding_window=5, sliding_window_pattern=3,
                max_position_embeddings=64, rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    reference = _random(transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4),
                        transformers.Gemma3ForConditionalGeneration, seed=7)
    reference.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    assert family_of(ours.config) == "gemma3_text" and ours.config.rope_scaling == 8.0
    for idx in batches(ours.config.vocab_size, ours.config.context_length):
        with torch.no_grad():
            assert (ours(idx) - reference(input_ids=idx).logits).abs().max().item() <= TOLERANCE
    with pytest.raises(ValueError, match="needs its 'text_config'"):
        config_from_hf({"model_type": "gemma3"})


def test_our_own_moe_and_gemma_shapes_save_and_load(tmp_path):
    torch.manual_seed(0)
    for i, config in enumerate([
        GPTConfig.from_preset("llama-tiny", vocab_size=200, context_length=24, qk_norm=True, n_experts=4,
                              experts_per_token=1, d_expert=40),
        GPTConfig.from_preset("llama-tiny", vocab_size=200, context_length=24, qk_norm=True, mlp="geglu",
                              post_norms=True, scale_embeddings=True, sliding_window=4,
                              layer_types=("sliding", "full", "sliding", "sliding"), rope_local_theta=500.0),
    ]):
        ours = GPT(config).eval()
        randomize(ours, seed=i, scale=0.1)
        save_hf(ours, tmp_path / str(i))
        again = load_hf(tmp_path / str(i)).eval()
        idx = torch.randint(200, (2, 24))
        with torch.no_grad():
            assert (again(idx) - ours(idx)).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("preset, family, total, active, non_embedding", [
    ("qwen3-0.6b", "qwen3", 0.6, 0.6, 0.44),  # Qwen3's model cards: 0.6B, 0.44B without embeddings
    ("gemma3-1b", "gemma3_text", 1.0, 1.0, None),  # Gemma 3's report: 1B
    ("qwen3-30b-a3b", "qwen3_moe", 30.5, 3.3, None),  # 30.5B in all, 3.3B activated
])
def test_presets_have_the_published_sizes(preset, family, total, active, non_embedding):
    with torch.device("meta"):
        model = GPT(GPTConfig.from_preset(preset))
    assert family_of(model.config) == family
    billions = model.num_params() / 1e9, model.num_params(active=True) / 1e9
    assert abs(billions[0] - total) < 0.06 and abs(billions[1] - active) < 0.06  # as published, to one decimal
    if non_embedding:
        assert abs(model.num_params(include_embeddings=False) / 1e9 - non_embedding) < 0.006


def test_experts_load_from_the_stacked_tensors_transformers_keeps_in_memory(tmp_path):
    """transformers 5 holds a layer's experts as (E, 2 d_expert, d) gate_up and (E, d, d_expert) down tensors; a
    file written that way loads as the hub's one-matrix-per-expert file does."""
    from safetensors.torch import load_file

    from llmscratch.model.hf_formats import hf_to_ours

    hf_qwen3_moe().save_pretrained(tmp_path)
    per_expert = load_file(tmp_path / "model.safetensors")
    config = config_from_hf(transformers.AutoConfig.from_pretrained(tmp_path).to_dict())
    stacked = {name: t for name, t in per_expert.items() if ".experts." not in name}
    for layer in (0, 2):  # layer 1 is dense
        prefix = f"model.layers.{layer}.mlp.experts"

        def expert_tensors(kind):
            return torch.stack([per_expert[f"{prefix}.{e}.{kind}_proj.weight"] for e in range(config.n_experts)])

        stacked[f"{prefix}.gate_up_proj"] = torch.cat([expert_tensors("gate"), expert_tensors("up")], dim=1)
        stacked[f"{prefix}.down_proj"] = expert_tensors("down")
    expected = hf_to_ours(per_expert, config)
    got = hf_to_ours(stacked, config)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
