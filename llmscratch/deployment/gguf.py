"""GGUF files for llama.cpp and Ollama: a Llama-shaped GPT and its byte-level BPE tokenizer in one file.

Two of llama.cpp's architectures hold what the course trains: "llama" (RMSNorm, RoPE, grouped-query attention,
a SwiGLU MLP) and "arcee" (the same with a non-gated up/down MLP through max(0, x)^2: the bundled models' relu2).
Every other shape is refused, by name, before the file is opened. The file is written with the ``gguf`` package
(llama.cpp's own writer) under llama.cpp's tensor names and keys, as its ``convert_hf_to_gguf.py`` writes them:

- RoPE: ours pairs dimension i of a head with i + head_dim/2 (rotate-half, as Hugging Face); llama.cpp's llama and
  arcee pair i with i + 1 (GGML's "normal" RoPE). So the rows of each query and key head are interleaved
  (``interleave_rope_rows``), as the converter does; q.k is unchanged, since queries and keys move alike.
- The tokenizer: tokenizer.ggml.model "gpt2" (byte-level BPE), each token as text in GPT-2's printable alphabet
  for bytes, the merges in the order learned, special tokens as control tokens, and tokenizer.ggml.pre, the name
  of llama.cpp's built-in split pattern that equals ours (``PRE_TOKENIZERS``).
"""

import os
from pathlib import Path

import gguf
import numpy as np
import torch

from llmscratch.files import write_atomically
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.text.hf_tokenizer import byte_level_alphabet
from llmscratch.text.tokenizer import GPT2_SPLIT_PATTERN, BPETokenizer

__all__ = ["DTYPES", "PRE_TOKENIZERS", "gguf_architecture", "gguf_tensors", "gguf_vocabulary",
           "interleave_rope_rows", "pre_tokenizer", "save_gguf", "unlace_rope_rows"]

DTYPES = {"float32": (np.float32, gguf.LlamaFileType.ALL_F32), "float16": (np.float16, gguf.LlamaFileType.MOSTLY_F16)}
ARCHITECTURES = {"swiglu": "llama", "relu2": "arcee"}  # our MLP -> the llama.cpp architecture that has it
_LLAMA3_STYLE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|{numbers}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# (split pattern, whole_chunks) -> llama.cpp's pre-tokenizer that splits the same way. Llama 3's also takes a
# chunk that is a token whole (its ignore_merges, our whole_chunks); the other two merge every chunk.
PRE_TOKENIZERS = {
    (GPT2_SPLIT_PATTERN, False): "gpt-2",
    (_LLAMA3_STYLE.replace("{numbers}", r"\p{N}{1,3}"), True): "llama-bpe",
    (_LLAMA3_STYLE.replace("{numbers}", r"\p{N}"), False): "qwen2",
}


# --------------------------------------------------------------------------- what fits
def gguf_architecture(config: GPTConfig) -> str:
    """The llama.cpp architecture ("llama" or "arcee") that holds this configuration; ValueError naming what
    none of them has."""
    problems = [f"{name}={getattr(config, name)!r}" for name, wanted in
                (("norm", "rmsnorm"), ("position", "rope"), ("bias", False), ("qkv_bias", False),
                 ("qk_norm", False), ("post_norms", False), ("scale_embeddings", False), ("n_experts", None),
                 ("sliding_window", None), ("rope_local_theta", None), ("query_scale", None))
                if getattr(config, name) != wanted]
    if config.mlp not in ARCHITECTURES:
        problems.append(f"mlp={config.mlp!r}")
    if problems:
        raise ValueError(f"no GGUF architecture written here holds this model: it has {', '.join(problems)}; "
                         f"expected a Llama shape (rmsnorm, rope, no biases) with mlp {' or '.join(ARCHITECTURES)}")
    return ARCHITECTURES[config.mlp]


def pre_tokenizer(tokenizer: BPETokenizer) -> str:
    """llama.cpp's name for the tokenizer's split (``PRE_TOKENIZERS``); ValueError if llama.cpp has none like it
    (TypeError for a tokenizer that is no byte-level BPE)."""
    if not isinstance(tokenizer, BPETokenizer):
        raise TypeError(f"only a byte-level BPE tokenizer (BPETokenizer) goes into a GGUF file here, got "
                        f"{type(tokenizer).__name__}")
    if tokenizer.normalization is not None:
        raise ValueError(f"tokenizer {tokenizer.name!r} puts text in Unicode form {tokenizer.normalization} before "
                         "splitting it, which llama.cpp's byte-level BPE does not")
    name = PRE_TOKENIZERS.get((tokenizer.pattern, tokenizer.whole_chunks))
    if name is None:
        raise ValueError(f"tokenizer {tokenizer.name!r} splits by {tokenizer.pattern!r} (whole_chunks="
                         f"{tokenizer.whole_chunks}), which no pre-tokenizer of llama.cpp does; it knows GPT-2's, "
                         "Llama 3's (whole chunks) and Qwen2's patterns")
    return name


# --------------------------------------------------------------------------- tensors
def interleave_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows from rotate-half pairs (i, i + hs/2) to neighbour pairs (2i, 2i + 1)."""
    rows = weight.shape[0]
    halves = weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])  # (nh, 2, hs/2, ...)
    return halves.transpose(1, 2).reshape(weight.shape)  # row 2i of a head <- row i, row 2i+1 <- row i + hs/2


def unlace_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of ``interleave_rope_rows``: neighbour pairs back to rotate-half pairs."""
    rows = weight.shape[0]
    pairs = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])  # (nh, hs/2, 2, ...)
    return pairs.transpose(1, 2).reshape(weight.shape)


def _layer_names(config: GPTConfig) -> dict[str, str]:
    """Our name -> llama.cpp's, inside block i / blk.i (the fused qkv apart)."""
    names = {"attn_norm.weight": "attn_norm.weight", "attn.out_proj.weight": "attn_output.weight",
             "mlp_norm.weight": "ffn_norm.weight"}
    if config.mlp == "swiglu":
        names.update({"mlp.gate.weight": "ffn_gate.weight", "mlp.up.weight": "ffn_up.weight",
                      "mlp.down.weight": "ffn_down.weight"})
    else:  # relu2: SquaredReLUMLP's fc and proj are the up and down projections
        names.update({"mlp.fc.weight": "ffn_up.weight", "mlp.proj.weight": "ffn_down.weight"})
    return names


def gguf_tensors(model: GPT, dtype: str = "float32") -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's names, in its layout: matrices in ``dtype``, norm gains in float32
    (as llama.cpp keeps them); a tied output head is left out (llama.cpp reuses token_embd)."""
    config = model.config
    gguf_architecture(config)
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    layer = ["attn.qkv.weight", *_layer_names(config)]
    expected = {"token_embedding.weight", "final_norm.weight", "lm_head.weight",
                *(f"blocks.{i}.{name}" for i in range(config.n_layers) for name in layer)}
    odd = sorted(set(state) ^ expected) or [name for name in expected if not state[name].is_floating_point()]
    if odd:
        raise ValueError(f"the model's weights are not a plain {config.mlp} Llama's (a quantized or adapted model?): "
                         f"{odd[:6]} differ; merge or dequantize it first")
    tensors = {"token_embd.weight": state["token_embedding.weight"], "output_norm.weight": state["final_norm.weight"]}
    if not config.tie_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    sizes = (config.n_heads * config.head_dim, config.kv_heads * config.head_dim, config.kv_heads * config.head_dim)
    for i in range(config.n_layers):
        q, k, v = state[f"blocks.{i}.attn.qkv.weight"].split(sizes)
        tensors[f"blk.{i}.attn_q.weight"] = interleave_rope_rows(q, config.n_heads)
        tensors[f"blk.{i}.attn_k.weight"] = interleave_rope_rows(k, config.kv_heads)
        tensors[f"blk.{i}.attn_v.weight"] = v
        tensors.update({f"blk.{i}.{theirs}": state[f"blocks.{i}.{ours}"] for ours, theirs in _layer_names(config).items()})
    matrix_type = DTYPES[dtype][0]
    return {name: t.float().numpy().astype(matrix_type if t.dim() > 1 else np.float32) for name, t in tensors.items()}


# --------------------------------------------------------------------------- tokenizer
def gguf_vocabulary(tokenizer: BPETokenizer, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) as llama.cpp's converter writes a byte-level BPE: each token's bytes in GPT-2's
    printable alphabet, special tokens as themselves; ids the tokenizer does not use (a vocabulary padded for
    speed) as "[PAD<id>]", unused. Merges are "left right", in the order learned."""
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size:,} tokens but the model only {vocab_size:,}: "
                         "they were not made for each other")
    char_of = {byte: char for char, byte in byte_level_alphabet().items()}

    def text(token: bytes) -> str:
        return "".join(char_of[b] for b in token)

    specials = {i: token for token, i in tokenizer.special_tokens.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in tokenizer.vocab:
            tokens.append(text(tokenizer.vocab[i]))
            types.append(gguf.TokenType.NORMAL)
        elif i in specials:  # added text (Qwen3's "<think>") is matched in text like a word; the others are control
            tokens.append(specials[i])
            types.append(gguf.TokenType.USER_DEFINED if specials[i] in tokenizer.added_text else gguf.TokenType.CONTROL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [f"{text(tokenizer.vocab[left])} {text(tokenizer.vocab[right])}"
              for (left, right), _ in sorted(tokenizer.merges.items(), key=lambda item: item[1])]
    return tokens, [int(t) for t in types], merges


# --------------------------------------------------------------------------- the file
def save_gguf(model: GPT, tokenizer: BPETokenizer, path: str | os.PathLike, dtype: str = "float32",
              name: str | None = None) -> None:
    """Write ``model`` and ``tokenizer`` as one GGUF file that llama.cpp (and Ollama) run.

    ``dtype``: "float32" or "float16" for the matrices (norm gains stay float32). Every check comes before the
    file is opened, and the file is written whole or not at all: a refused model leaves nothing behind.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one a GGUF is written in here; expected one of {list(DTYPES)}")
    config = model.config
    architecture = gguf_architecture(config)
    pre = pre_tokenizer(tokenizer)
    tokens, types, merges = gguf_vocabulary(tokenizer, config.vocab_size)
    tensors = gguf_tensors(model, dtype)

    def write(tmp: str) -> None:
        writer = gguf.GGUFWriter(tmp, architecture)
        writer.add_name(name or Path(path).stem)
        writer.add_file_type(DTYPES[dtype][1])
        _add_hyperparameters(writer, config)
        writer.add_tokenizer_model("gpt2")  # byte-level BPE, whatever the model
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        if tokenizer.bos_id is not None:
            writer.add_bos_token_id(tokenizer.bos_id)
        if tokenizer.eot_token is not None:
            writer.add_eos_token_id(tokenizer.eot_token)
        writer.add_add_bos_token(tokenizer.bos_id is not None)  # as our generate: a BOS only where there is one
        for tensor_name, tensor in tensors.items():
            writer.add_tensor(tensor_name, tensor)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    write_atomically(path, write)


def _add_hyperparameters(writer: gguf.GGUFWriter, config: GPTConfig) -> None:
    writer.add_context_length(config.context_length)
    writer.add_embedding_length(config.d_model)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length(config.hidden_dim)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.kv_heads)
    writer.add_key_length(config.head_dim)  # a head may be narrower than d_model / n_heads (pruned heads)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    if config.rope_scaling != 1:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_scaling)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
