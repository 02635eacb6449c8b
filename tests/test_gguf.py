"""GGUF export (llmscratch.deployment.gguf): the file, read back with the gguf package's own reader, holds the
model's tensors in llama.cpp's names and RoPE layout, its tokenizer and its metadata; other shapes are refused
with nothing written."""

import gguf
import numpy as np
import pytest
import torch

from llmscratch.cli import resolve_model
from llmscratch.deployment.gguf import PRE_TOKENIZERS, save_gguf, unlace_rope_rows
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.model.quantize import quantize
from llmscratch.model.rope import RotaryEmbedding
from llmscratch.model.weights import load_model_and_tokenizer
from llmscratch.text.hf_tokenizer import byte_level_alphabet
from llmscratch.text.tokenizer import BPETokenizer
from tests.model_fixtures import LATER_SHAPES, randomize

pytestmark = pytest.mark.timeout(120)

TEXT = ("Call me Ishmael. Some years ago - never mind how long precisely - having little or no money in my purse, "
        "I thought I would sail about a little and see the watery part of the world. 1851, 2026! Ünïcödé ok?\n\n")
LLAMA3_PATTERN = next(pattern for (pattern, _), name in PRE_TOKENIZERS.items() if name == "llama-bpe")


@pytest.fixture(scope="module")
def base():
    return load_model_and_tokenizer(resolve_model("base")[1])


def tiny_llama(**overrides) -> tuple[GPT, BPETokenizer]:
    """A SwiGLU Llama, untied, with grouped-query attention, scaled RoPE and a vocabulary padded past its
    tokenizer's; the tokenizer splits as Llama 3's and starts a text with a BOS."""
    trained = BPETokenizer.train(TEXT * 3, 300, pattern=LLAMA3_PATTERN,
                                 special_tokens=["<|begin_of_text|>", "<|end_of_text|>"])
    tokenizer = BPETokenizer(list(trained.merges), pattern=LLAMA3_PATTERN, special_tokens=trained.special_tokens,
                             whole_chunks=True, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    config = GPTConfig.from_preset("llama-tiny", vocab_size=320, context_length=64, d_model=48, n_layers=2,
                                   n_heads=4, n_kv_heads=2, d_ff=80, tie_embeddings=False, rope_theta=50_000.0,
                                   rope_scaling=2.0, **overrides)
    model = GPT(config)
    randomize(model, seed=3, scale=0.3)
    return model.eval(), tokenizer


def read(path) -> tuple[dict, dict[str, gguf.ReaderTensor]]:
    reader = gguf.GGUFReader(path)
    return ({name: field.contents() for name, field in reader.fields.items()},
            {tensor.name: tensor for tensor in reader.tensors})


def llama_cpp_rope(x: torch.Tensor, theta: float, scaling: float) -> torch.Tensor:
    """GGML's "normal" RoPE, as llama.cpp applies it to llama and arcee: each neighbour pair (2i, 2i + 1) of a
    head turns by position / scaling * theta^(-2i / head_dim). x: (T, nh, hs)."""
    positions = torch.arange(x.shape[0], dtype=torch.float64) / scaling
    angles = torch.outer(positions, theta ** (-torch.arange(0, x.shape[-1], 2, dtype=torch.float64) / x.shape[-1]))
    cos, sin = angles.cos().float()[:, None], angles.sin().float()[:, None]  # (T, 1, hs/2)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def ours_by_name(model: GPT) -> dict[str, torch.Tensor]:
    """Our tensors under llama.cpp's names, q and k as we keep them (rotate-half)."""
    config, state = model.config, model.state_dict()
    ours = {"token_embd.weight": state["token_embedding.weight"], "output_norm.weight": state["final_norm.weight"]}
    if not config.tie_embeddings:
        ours["output.weight"] = state["lm_head.weight"]
    mlp = ({"gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"} if config.mlp == "swiglu"
           else {"fc": "ffn_up", "proj": "ffn_down"})
    for i in range(config.n_layers):
        q, k, v = state[f"blocks.{i}.attn.qkv.weight"].split(
            [config.n_heads * config.head_dim, config.kv_heads * config.head_dim, config.kv_heads * config.head_dim])
        ours.update({f"blk.{i}.attn_q.weight": q, f"blk.{i}.attn_k.weight": k, f"blk.{i}.attn_v.weight": v,
                     f"blk.{i}.attn_norm.weight": state[f"blocks.{i}.attn_norm.weight"],
                     f"blk.{i}.attn_output.weight": state[f"blocks.{i}.attn.out_proj.weight"],
                     f"blk.{i}.ffn_norm.weight": state[f"blocks.{i}.mlp_norm.weight"]})
        ours.update({f"blk.{i}.{theirs}.weight": state[f"blocks.{i}.mlp.{name}.weight"] for name, theirs in mlp.items()})
    return ours


def check_tensors(model: GPT, tensors: dict[str, gguf.ReaderTensor], matrix_dtype) -> None:
    """Every tensor of the model and no other, in llama.cpp's shape and dtype, with the model's values once q and
    k are put back in rotate-half order."""
    config = model.config
    ours = ours_by_name(model)
    assert set(tensors) == set(ours)
    for name, tensor in tensors.items():
        expected = ours[name].float()
        assert tuple(tensor.data.shape) == tuple(expected.shape), name  # (out, in): ne = (in, out) in the file
        assert list(tensor.shape) == list(reversed(expected.shape)), name
        assert tensor.data.dtype == (matrix_dtype if expected.dim() > 1 else np.float32), name
        stored = torch.from_numpy(np.array(tensor.data, dtype=np.float32))
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            assert not torch.equal(stored, expected.to(stored.dtype)), f"{name} was not reordered for llama.cpp"
            stored = unlace_rope_rows(stored, config.n_heads if "attn_q" in name else config.kv_heads)
        tolerance = 0 if matrix_dtype == np.float32 or expected.dim() == 1 else 1e-3 * expected.abs().max().item()
        torch.testing.assert_close(stored, expected, rtol=0, atol=tolerance, msg=name)


def check_vocabulary(fields: dict, tokenizer: BPETokenizer, vocab_size: int) -> None:
    """The tokens as GPT-2's byte alphabet spells them, their types, the merges in order; and a tokenizer rebuilt
    from the file alone encodes a text as ours does."""
    byte_of = byte_level_alphabet()
    tokens, types, merges = (fields[f"tokenizer.ggml.{key}"] for key in ("tokens", "token_type", "merges"))
    assert len(tokens) == len(types) == vocab_size
    specials = {i: token for token, i in tokenizer.special_tokens.items()}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if i in tokenizer.vocab:
            assert (bytes(byte_of[c] for c in token), kind) == (tokenizer.vocab[i], gguf.TokenType.NORMAL), i
        elif i in specials:
            assert (token, kind) == (specials[i], gguf.TokenType.CONTROL), i
        else:
            assert (token, kind) == (f"[PAD{i}]", gguf.TokenType.UNUSED), i
    id_of = {token: i for i, token in enumerate(tokens) if types[i] == gguf.TokenType.NORMAL}
    pairs = [tuple(id_of[part] for part in merge.split(" ")) for merge in merges]
    assert pairs == list(tokenizer.merges)  # in the order learned: merge j makes token 256 + j
    rebuilt = BPETokenizer(pairs, pattern=tokenizer.pattern, special_tokens=tokenizer.special_tokens,
                           byte_order=[byte_of[tokens[i]] for i in range(256)], whole_chunks=tokenizer.whole_chunks)
    assert rebuilt.encode(TEXT) == tokenizer.encode(TEXT)


def check_rope_layout(model: GPT, tensors: dict[str, gguf.ReaderTensor]) -> None:
    """llama.cpp's RoPE on the file's q and k gives the attention scores our RoPE gives on ours (rounded as the
    file's are)."""
    config = model.config
    x = torch.randn(7, config.d_model, generator=torch.Generator().manual_seed(0))  # (T, d)
    rope = RotaryEmbedding(config.head_dim, config.context_length, config.rope_theta, config.rope_scaling)
    stored = {name: torch.from_numpy(np.array(tensor.data)) for name, tensor in tensors.items()}
    ours = {name: tensor.to(stored[name].dtype) for name, tensor in ours_by_name(model).items()}
    scores = []
    for weights, rotate in ((ours, lambda h: rope(h.transpose(0, 1)).transpose(0, 1)),
                            (stored, lambda h: llama_cpp_rope(h, config.rope_theta, config.rope_scaling))):
        q = rotate((x @ weights["blk.0.attn_q.weight"].float().T).view(7, config.n_heads, config.head_dim))
        k = rotate((x @ weights["blk.0.attn_k.weight"].float().T).view(7, config.kv_heads, config.head_dim))
        k = k.repeat_interleave(config.n_heads // config.kv_heads, dim=1)
        scores.append(torch.einsum("qhd,khd->hqk", q, k))  # (nh, T, T)
    torch.testing.assert_close(scores[1], scores[0], rtol=1e-4, atol=1e-3)


def test_the_bundled_base_model_exports_as_arcee(base, tmp_path):
    model, tokenizer = base
    path = tmp_path / "base.gguf"
    save_gguf(model, tokenizer, path)
    fields, tensors = read(path)
    config = model.config
    listed = {f"tokenizer.ggml.{key}" for key in ("tokens", "token_type", "merges")}  # checked below
    assert {key: value for key, value in fields.items() if not key.startswith("GGUF.") and key not in listed} \
        == {"general.architecture": "arcee", "general.name": "base", "general.file_type": gguf.LlamaFileType.ALL_F32,
            "arcee.context_length": 256, "arcee.embedding_length": 256, "arcee.block_count": 6,
            "arcee.feed_forward_length": 1152, "arcee.attention.head_count": 8, "arcee.attention.head_count_kv": 4,
            "arcee.attention.key_length": 32, "arcee.attention.value_length": 32, "arcee.rope.dimension_count": 32,
            "arcee.rope.freq_base": 10_000.0, "arcee.attention.layer_norm_rms_epsilon": pytest.approx(config.norm_eps),
            "arcee.vocab_size": 4096, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
            "tokenizer.ggml.eos_token_id": tokenizer.eot_token, "tokenizer.ggml.add_bos_token": False}
    assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd for the head
    check_tensors(model, tensors, np.float32)
    check_vocabulary(fields, tokenizer, config.vocab_size)
    check_rope_layout(model, tensors)


def test_a_llama_exports_untied_in_float16_with_its_bos_and_padding(tmp_path):
    model, tokenizer = tiny_llama()
    path = tmp_path / "tiny.gguf"
    save_gguf(model, tokenizer, path, dtype="float16", name="tiny llama")
    fields, tensors = read(path)
    assert (fields["general.architecture"], fields["general.name"], fields["general.file_type"]) == \
        ("llama", "tiny llama", gguf.LlamaFileType.MOSTLY_F16)
    assert (fields["llama.attention.head_count"], fields["llama.attention.head_count_kv"],
            fields["llama.feed_forward_length"], fields["llama.vocab_size"]) == (4, 2, 80, 320)
    assert (fields["llama.rope.freq_base"], fields["llama.rope.scaling.type"], fields["llama.rope.scaling.factor"]) \
        == (50_000.0, "linear", 2.0)
    assert (fields["tokenizer.ggml.pre"], fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"],
            fields["tokenizer.ggml.add_bos_token"]) == ("llama-bpe", tokenizer.bos_id, tokenizer.eot_token, True)
    check_tensors(model, tensors, np.float16)
    check_vocabulary(fields, tokenizer, model.config.vocab_size)
    check_rope_layout(model, tensors)


def test_heads_narrower_than_the_width_keep_their_size(tmp_path):
    model, tokenizer = tiny_llama(head_size=8)  # 4 heads of 8 in a width of 48, as prune_structured leaves them
    save_gguf(model, tokenizer, tmp_path / "narrow.gguf")
    fields, tensors = read(tmp_path / "narrow.gguf")
    assert (fields["llama.attention.key_length"], fields["llama.rope.dimension_count"]) == (8, 8)
    check_tensors(model, tensors, np.float32)
    check_rope_layout(model, tensors)


REFUSED = {
    "gpt2": (GPTConfig(vocab_size=320, context_length=32, d_model=32, n_layers=1, n_heads=2), "norm='layernorm'"),
    "gemma": (GPTConfig(**{**LATER_SHAPES["gemma"], "vocab_size": 320}), "qk_norm=True"),
    "moe": (GPTConfig(**{**LATER_SHAPES["moe"], "vocab_size": 320}), "n_experts=5"),
    "gelu llama": (GPTConfig.from_preset("llama-tiny", vocab_size=320, mlp="gelu"), "mlp='gelu'"),
    "biased llama": (GPTConfig.from_preset("llama-tiny", vocab_size=320, bias=True, qkv_bias=True), "bias=True"),
}


@pytest.mark.parametrize("shape", REFUSED)
def test_other_shapes_are_refused_by_name_with_nothing_written(shape, tmp_path):
    config, named = REFUSED[shape]
    _, tokenizer = tiny_llama()
    path = tmp_path / "out" / "model.gguf"
    with pytest.raises(ValueError, match="no GGUF architecture") as refused:
        save_gguf(GPT(config), tokenizer, path)
    assert named in str(refused.value)
    assert not path.exists() and not (path.parent.exists() and any(path.parent.iterdir()))


def test_a_tokenizer_llama_cpp_cannot_split_like_is_refused(tmp_path):
    model, tokenizer = tiny_llama()
    odd = BPETokenizer(list(tokenizer.merges), pattern=r"\p{L}+|\p{N}+|[^\p{L}\p{N}]+",
                       special_tokens=tokenizer.special_tokens)
    same_pattern_other_chunks = BPETokenizer(list(tokenizer.merges), pattern=LLAMA3_PATTERN,
                                             special_tokens=tokenizer.special_tokens, whole_chunks=False)
    for bad in (odd, same_pattern_other_chunks):
        with pytest.raises(ValueError, match="no pre-tokenizer of llama.cpp"):
            save_gguf(model, bad, tmp_path / "model.gguf")
    assert list(tmp_path.iterdir()) == []


def test_a_quantized_model_is_refused_before_writing(tmp_path):
    model, tokenizer = tiny_llama()
    with pytest.raises(ValueError, match="dequantize"):
        save_gguf(quantize(model, "int8"), tokenizer, tmp_path / "model.gguf")
    with pytest.raises(ValueError, match="float32"):
        save_gguf(model, tokenizer, tmp_path / "model.gguf", dtype="q8_0")
    assert list(tmp_path.iterdir()) == []


def test_a_write_that_fails_midway_keeps_the_file_that_was_there(tmp_path, monkeypatch):
    model, tokenizer = tiny_llama()
    path = tmp_path / "model.gguf"
    path.write_bytes(b"the export before")

    def disk_full(writer, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", disk_full)
    with pytest.raises(OSError, match="space"):
        save_gguf(model, tokenizer, path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"] and path.read_bytes() == b"the export before"
