"""Loading and saving Hugging Face checkpoints, checked against transformers itself (offline)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must never reach for the hub here

import transformers  # noqa: E402  (a test-only dependency, in requirements.txt)
from model_fixtures import randomize  # noqa: E402

from llmscratch.model.config import GPTConfig  # noqa: E402
from llmscratch.model.gpt import GPT
from llmscratch.model.hf_formats import config_from_hf  # noqa: E402
from llmscratch.model.weights import download_gpt2, load_hf, save_hf


def hf_gpt2(tie: bool = True, **shape):
    shape = {"n_embd": 48, "n_head": 4, **shape}
    config = transformers.GPT2Config(vocab_size=311, n_positions=64, n_layer=3, tie_word_embeddings=tie,
                                     bos_token_id=0, eos_token_id=0, attn_implementation="eager", **shape)
    model = transformers.GPT2LMHeadModel(config).eval()
    randomize(model, seed=1, scale=0.05)
    return model


def hf_llama(tie: bool = False, bias: bool = False, **shape):
    shape = {"hidden_size": 64, "intermediate_size": 112, "num_attention_heads": 8, "num_key_value_heads": 2,
             **shape}
    config = transformers.LlamaConfig(
        vocab_size=293, num_hidden_layers=3, max_position_embeddings=96, rope_theta=123_456.0,
        rms_norm_eps=1e-6, tie_word_embeddings=tie, attention_bias=bias, mlp_bias=bias,
        attn_implementation="eager", **shape,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    randomize(model, seed=2, scale=0.05)
    return model


HF_MODELS = {
    "gpt2": hf_gpt2,
    "gpt2-untied": lambda: hf_gpt2(tie=False),
    "gpt2-relu2": lambda: hf_gpt2(activation_function="relu2"),  # pretrain.py --preset gpt2-small, its default MLP
    "llama-gqa-untied": hf_llama,
    "llama-tied-bias": lambda: hf_llama(tie=True, bias=True),
    # Other shapes: 3 heads of 12 with an MLP of 100 (n_inner); multi-query with heads of 20;
    # as many key/value heads as query heads.
    "gpt2-3-heads-n_inner": lambda: hf_gpt2(tie=False, n_embd=36, n_head=3, n_inner=100),
    "llama-mqa": lambda: hf_llama(hidden_size=60, num_attention_heads=3, num_key_value_heads=1,
                                  intermediate_size=100),
    "llama-mha": lambda: hf_llama(num_key_value_heads=8),
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
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_hf(tmp_path)
    hf_gpt2().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_hf(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"n_embd": None}, r"no 'n_embd' entry, which a gpt2 config needs"),
    ({"scale_attn_weights": False}, r"scale_attn_weights=false is not supported"),
    ({"activation_function": "relu"}, r"activation 'relu' is not supported"),
])
def test_unsupported_gpt2_config_is_a_clear_error(change, message):
    config = {key: value for key, value in {**hf_gpt2().config.to_dict(), **change}.items() if value is not None}
    with pytest.raises(ValueError, match=message):
        config_from_hf(config)


def test_sharded_checkpoint_loads(tmp_path):
    reference = hf_llama()
    reference.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1  # really several shards and an index
    ours = load_hf(tmp_path).eval()
    idx = torch.randint(293, (2, 30))
    with torch.no_grad():
        assert (ours(idx) - reference(idx).logits).abs().max().item() <= 1e-4


def test_bfloat16_checkpoints_in_and_out(tmp_path):
    """A bf16 file loads exactly (as fp32 by default, or kept in bf16), and save_hf keeps the dtype."""
    reference = hf_llama().to(torch.bfloat16)
    reference.save_pretrained(tmp_path / "hf")
    as_fp32, as_bf16 = load_hf(tmp_path / "hf"), load_hf(tmp_path / "hf", dtype=torch.bfloat16)
    expected = reference.model.layers[1].self_attn.k_proj.weight
    k_rows = slice(64, 64 + 16)  # the qkv rows after the 8 query heads of 8: keys of 2 heads
    assert as_fp32.blocks[1].attn.qkv.weight.dtype == torch.float32
    assert torch.equal(as_fp32.blocks[1].attn.qkv.weight[k_rows], expected.float())
    assert torch.equal(as_bf16.blocks[1].attn.qkv.weight[k_rows], expected)
    save_hf(as_bf16, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert reloaded.dtype == torch.bfloat16
    assert torch.equal(reloaded.model.layers[1].self_attn.k_proj.weight, expected)


def test_save_hf_replaces_files_whole_or_not_at_all(tmp_path, monkeypatch):
    torch.manual_seed(0)
    first = GPT(GPTConfig.from_preset("llama-tiny", vocab_size=300, context_length=32))
    save_hf(first, tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()

    def failing_save_file(tensors, filename, metadata=None):
        open(filename, "wb").write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr("llmscratch.files.save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_hf(GPT(GPTConfig.from_preset("llama-tiny", vocab_size=300, context_length=32)), tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before  # the previous checkpoint, intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]  # no leftovers


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
