"""Loading and saving Hugging Face checkpoints, checked against transformers itself (offline)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must never reach for the hub here

import transformers  # noqa: E402  (a test-only dependency, in requirements.txt)

from llmscratch.model import GPT, GPTConfig  # noqa: E402
from llmscratch.weights import config_from_hf, download_gpt2, load_hf, save_hf  # noqa: E402


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm gains near 1): a mapping mistake cannot hide behind zeros or ones."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            is_gain = param.dim() == 1 and ("norm" in name or "ln" in name) and name.endswith("weight")
            param.copy_(1.0 + 0.1 * noise if is_gain else 0.05 * noise)


def hf_gpt2(tie: bool = True):
    config = transformers.GPT2Config(vocab_size=311, n_positions=64, n_embd=48, n_layer=3, n_head=4,
                                     tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0,
                                     attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config).eval()
    randomize(model, seed=1)
    return model


def hf_llama(tie: bool = False, bias: bool = False):
    config = transformers.LlamaConfig(
        vocab_size=293, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=96,
        rope_theta=123_456.0, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        attention_bias=bias, mlp_bias=bias, attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config).eval()
    randomize(model, seed=2)
    return model


HF_MODELS = {
    "gpt2": hf_gpt2,
    "gpt2-untied": lambda: hf_gpt2(tie=False),
    "llama-gqa-untied": hf_llama,
    "llama-tied-bias": lambda: hf_llama(tie=True, bias=True),
}


def random_batches(vocab_size: int, context_length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    for batch, length in [(1, 1), (2, 17), (3, context_length)]:
        yield torch.randint(vocab_size, (batch, length), generator=generator)


@pytest.mark.parametrize("kind", sorted(HF_MODELS))
def test_load_hf_gives_the_logits_of_transformers(tmp_path, kind):
    reference = HF_MODELS[kind]()
    reference.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    config = ours.config
    for idx in random_batches(config.vocab_size, config.context_length):
        with torch.no_grad():
            expected = reference(idx).logits
            got = ours(idx)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", sorted(HF_MODELS))
def test_save_hf_is_read_by_transformers(tmp_path, kind):
    HF_MODELS[kind]().save_pretrained(tmp_path / "original")
    ours = load_hf(tmp_path / "original").eval()
    save_hf(ours, tmp_path / "ours")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager").eval()
    for idx in random_batches(ours.config.vocab_size, ours.config.context_length, seed=1):
        with torch.no_grad():
            assert (reloaded(idx).logits - ours(idx)).abs().max().item() <= 1e-4


def test_save_hf_of_our_own_llama_preset_round_trips(tmp_path):
    torch.manual_seed(0)
    ours = GPT(GPTConfig.from_preset("llama-tiny", vocab_size=300, context_length=32)).eval()
    save_hf(ours, tmp_path)
    again = load_hf(tmp_path).eval()
    idx = torch.randint(300, (2, 32))
    with torch.no_grad():
        assert torch.equal(again(idx), ours(idx))
    assert again.config == ours.config


def test_gpt2_checkpoint_without_prefix_and_with_mask_buffers_loads(tmp_path):
    """The hub's original GPT-2 files name tensors 'h.0...' and carry 'attn.bias' mask buffers."""
    reference = hf_gpt2()
    reference.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    renamed = {name.removeprefix("transformer."): t for name, t in tensors.items()}
    renamed["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
    save_file(renamed, tmp_path / "model.safetensors")
    ours = load_hf(tmp_path).eval()
    idx = torch.randint(311, (2, 64))
    with torch.no_grad():
        assert (ours(idx) - reference(idx).logits).abs().max().item() <= 1e-4


def rewrite(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"), r"no tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' \(missing\)"),
    (lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}), r"unexpected tensors.*model\.layers\.0\.extra\.weight"),
    (lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(100, 64)}), r"blocks\.2\.mlp\.up\.weight has shape \(100, 64\).*\(112, 64\)"),
])
def test_bad_checkpoint_names_the_tensor(tmp_path, edit, message):
    hf_llama().save_pretrained(tmp_path)
    rewrite(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        load_hf(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "bert"}, "model_type 'bert' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "RoPE scaling"),
    ({"hidden_act": "gelu"}, "activation 'gelu' is not supported"),
])
def test_unsupported_config_is_a_clear_error(tmp_path, change, message):
    hf_llama().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_hf(tmp_path)


def test_not_a_checkpoint_folder(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_hf(tmp_path)


def test_config_from_hf_reads_gqa_theta_and_tying():
    config = config_from_hf(hf_llama().config.to_dict())
    assert (config.n_heads, config.kv_heads, config.rope_theta, config.tie_embeddings) == (8, 2, 123_456.0, False)
    assert config.norm_eps == 1e-6 and config.hidden_dim == 112


def test_download_without_network_is_a_clear_error(tmp_path):
    # Port 9 on loopback (discard) is closed here: the same failure as having no internet.
    with pytest.raises(ConnectionError, match="needs internet access"):
        download_gpt2("gpt2-small", tmp_path, base_url="http://127.0.0.1:9")
    assert not any(tmp_path.iterdir())  # no partial file left behind
    with pytest.raises(ValueError, match="unknown GPT-2 size"):
        download_gpt2("gpt2-huge", tmp_path)
