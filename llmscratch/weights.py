"""Model weights from files: Hugging Face checkpoints in and out, and any model the course writes.

A checkpoint folder holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). ``load_hf`` maps each tensor to our names and fails, naming
the tensor, on anything missing, unexpected or mis-shaped; ``save_hf`` writes the reverse.
``load_model_and_tokenizer`` opens every source a chapter produces (a pretraining run folder,
its checkpoint.pt or model.safetensors, a Hugging Face folder) with the tokenizer that fits it.
"""

import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch

from llmscratch.atomic import write_text_atomically
from llmscratch.checkpoint import (EXPORT_FORMAT, check_weights, model_from_checkpoint, read_safetensors,
                                  tokenizer_from_checkpoint, write_safetensors)
from llmscratch.model import GPT, GPTConfig
from llmscratch.tokenizer import BPETokenizer

GPT2_VOCAB_SIZE = 50257

# HF GPT-2 uses Conv1D, whose weight is (in, out): the transpose of nn.Linear's (out, in).
_GPT2_LAYER = {  # ours -> HF, inside block i / h.i; "T" marks a transposed Conv1D weight
    "attn_norm.weight": "ln_1.weight", "attn_norm.bias": "ln_1.bias",
    "attn.qkv.weight": "attn.c_attn.weight T", "attn.qkv.bias": "attn.c_attn.bias",
    "attn.out_proj.weight": "attn.c_proj.weight T", "attn.out_proj.bias": "attn.c_proj.bias",
    "mlp_norm.weight": "ln_2.weight", "mlp_norm.bias": "ln_2.bias",
    "mlp.fc.weight": "mlp.c_fc.weight T", "mlp.fc.bias": "mlp.c_fc.bias",
    "mlp.proj.weight": "mlp.c_proj.weight T", "mlp.proj.bias": "mlp.c_proj.bias",
}
_LLAMA_LAYER = {  # ours -> HF, inside block i / model.layers.i (qkv is handled apart)
    "attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.out_proj.weight": "self_attn.o_proj.weight", "attn.out_proj.bias": "self_attn.o_proj.bias",
    "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.gate.bias": "mlp.gate_proj.bias",
    "mlp.up.weight": "mlp.up_proj.weight", "mlp.up.bias": "mlp.up_proj.bias",
    "mlp.down.weight": "mlp.down_proj.weight", "mlp.down.bias": "mlp.down_proj.bias",
}
# Buffers some GPT-2 checkpoints carry (the causal mask): derived, never needed.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


# --------------------------------------------------------------------------- configs
def config_from_hf(hf: dict) -> GPTConfig:
    """Our GPTConfig for a Hugging Face ``config.json`` of the GPT-2 or Llama family."""
    try:
        return _config_from_hf(hf)
    except KeyError as err:
        raise ValueError(f"the Hugging Face config has no {err.args[0]!r} entry, which a "
                         f"{hf.get('model_type')} config needs") from None


def _config_from_hf(hf: dict) -> GPTConfig:
    family = hf.get("model_type")
    if family == "gpt2":
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
            if hf.get(flag):
                raise ValueError(f"GPT-2 option {flag}=true is not supported")
        if not hf.get("scale_attn_weights", True):
            raise ValueError("GPT-2 option scale_attn_weights=false is not supported: our attention "
                             "always divides the scores by sqrt(head_dim)")
        if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"GPT-2 activation {hf['activation_function']!r} is not supported; "
                             "expected the tanh GELU ('gelu_new')")
        return GPTConfig(
            vocab_size=hf["vocab_size"], context_length=hf["n_positions"], d_model=hf["n_embd"],
            n_layers=hf["n_layer"], n_heads=hf["n_head"], d_ff=hf.get("n_inner"),
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=hf.get("tie_word_embeddings", True),
        )
    if family == "llama":
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"RoPE scaling {rope!r} is not supported; only plain RoPE")
        heads = hf["num_attention_heads"]
        if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
            raise ValueError(f"head_dim={hf['head_dim']} differs from hidden_size / num_attention_heads")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Llama activation {hf['hidden_act']!r} is not supported; expected 'silu'")
        attention_bias = hf.get("attention_bias", False)
        if hf.get("mlp_bias", False) != attention_bias:
            raise ValueError("attention_bias and mlp_bias must be equal (both biases or none)")
        return GPTConfig(
            vocab_size=hf["vocab_size"], context_length=hf["max_position_embeddings"],
            d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
            n_kv_heads=hf.get("num_key_value_heads", heads), d_ff=hf["intermediate_size"],
            norm="rmsnorm", mlp="swiglu", position="rope",
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10_000.0)),
            qkv_bias=attention_bias, bias=attention_bias, norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=hf.get("tie_word_embeddings", False),
        )
    raise ValueError(f"model_type {family!r} is not supported; expected 'gpt2' or 'llama'")


def family_of(config: GPTConfig) -> str:
    """'gpt2' or 'llama': the Hugging Face family that can hold this configuration."""
    if config.qk_norm:
        raise ValueError("a model with qk_norm=True has query/key norms that neither GPT-2 nor Llama has, so "
                         "no Hugging Face format here holds it (its safetensors export still does)")
    if (config.norm, config.mlp, config.position) == ("layernorm", "gelu", "learned") \
            and config.kv_heads == config.n_heads and config.qkv_bias and config.bias:
        return "gpt2"
    if (config.norm, config.mlp, config.position) == ("rmsnorm", "swiglu", "rope") \
            and config.qkv_bias == config.bias:
        return "llama"
    raise ValueError(f"this configuration is neither GPT-2 nor Llama shaped, so no Hugging Face "
                     f"format holds it: {config}")


def config_to_hf(config: GPTConfig) -> dict:
    """The ``config.json`` transformers needs to rebuild this model."""
    if family_of(config) == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "vocab_size": config.vocab_size, "n_positions": config.context_length,
                "n_embd": config.d_model, "n_layer": config.n_layers, "n_head": config.n_heads,
                "n_inner": config.d_ff, "activation_function": "gelu_new",
                "layer_norm_epsilon": config.norm_eps, "tie_word_embeddings": config.tie_embeddings,
                "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": config.vocab_size, "max_position_embeddings": config.context_length,
            "hidden_size": config.d_model, "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads,
            "head_dim": config.head_dim, "intermediate_size": config.hidden_dim, "hidden_act": "silu",
            "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
            "attention_bias": config.bias, "mlp_bias": config.bias,
            "tie_word_embeddings": config.tie_embeddings, "attention_dropout": config.dropout}


# --------------------------------------------------------------------------- tensors
def hf_to_ours(tensors: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Rename (and transpose or concatenate) HF tensors into our state dict; strict about leftovers."""
    tensors = dict(tensors)
    take = _taker(tensors)
    ours = {}
    if family_of(config) == "gpt2":
        prefix = "transformer." if any(k.startswith("transformer.") for k in tensors) else ""
        ours["token_embedding.weight"] = take(f"{prefix}wte.weight")
        ours["position_embedding.weight"] = take(f"{prefix}wpe.weight")
        ours["final_norm.weight"] = take(f"{prefix}ln_f.weight")
        ours["final_norm.bias"] = take(f"{prefix}ln_f.bias")
        for i in range(config.n_layers):
            for name, hf_name in _GPT2_LAYER.items():
                hf_name, _, transposed = hf_name.partition(" ")
                tensor = take(f"{prefix}h.{i}.{hf_name}")
                ours[f"blocks.{i}.{name}"] = tensor.t() if transposed else tensor
        for name in [k for k in tensors if k.endswith(_IGNORED_SUFFIXES)]:
            del tensors[name]
    else:
        ours["token_embedding.weight"] = take("model.embed_tokens.weight")
        ours["final_norm.weight"] = take("model.norm.weight")
        for i in range(config.n_layers):
            layer = f"model.layers.{i}"
            for name, hf_name in _LLAMA_LAYER.items():
                if name.endswith(".bias") and not config.bias:
                    continue
                ours[f"blocks.{i}.{name}"] = take(f"{layer}.{hf_name}")
            # Our fused qkv projection is q_proj, k_proj and v_proj stacked along the output rows.
            parts = ("weight", "bias") if config.qkv_bias else ("weight",)
            for part in parts:
                ours[f"blocks.{i}.attn.qkv.{part}"] = torch.cat(
                    [take(f"{layer}.self_attn.{p}_proj.{part}") for p in "qkv"])
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # some files store the tied head as well
        ours["lm_head.weight"] = ours["token_embedding.weight"]
    else:
        ours["lm_head.weight"] = take("lm_head.weight")
    if tensors:
        raise ValueError(f"unexpected tensors in the checkpoint: {sorted(tensors)[:10]}")
    return ours


def ours_to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our state dict under transformers' names (the inverse of ``hf_to_ours``)."""
    hf = {}
    if family_of(config) == "gpt2":
        hf["transformer.wte.weight"] = state["token_embedding.weight"]
        hf["transformer.wpe.weight"] = state["position_embedding.weight"]
        hf["transformer.ln_f.weight"] = state["final_norm.weight"]
        hf["transformer.ln_f.bias"] = state["final_norm.bias"]
        for i in range(config.n_layers):
            for name, hf_name in _GPT2_LAYER.items():
                hf_name, _, transposed = hf_name.partition(" ")
                tensor = state[f"blocks.{i}.{name}"]
                hf[f"transformer.h.{i}.{hf_name}"] = tensor.t() if transposed else tensor
    else:
        hf["model.embed_tokens.weight"] = state["token_embedding.weight"]
        hf["model.norm.weight"] = state["final_norm.weight"]
        sizes = (config.n_heads * config.head_dim, config.kv_heads * config.head_dim,
                 config.kv_heads * config.head_dim)
        for i in range(config.n_layers):
            layer = f"model.layers.{i}"
            for name, hf_name in _LLAMA_LAYER.items():
                if f"blocks.{i}.{name}" in state:
                    hf[f"{layer}.{hf_name}"] = state[f"blocks.{i}.{name}"]
            for part in ("weight", "bias") if config.qkv_bias else ("weight",):
                q, k, v = state[f"blocks.{i}.attn.qkv.{part}"].split(sizes)
                for proj, tensor in zip("qkv", (q, k, v)):
                    hf[f"{layer}.self_attn.{proj}_proj.{part}"] = tensor
    if not config.tie_embeddings:
        hf["lm_head.weight"] = state["lm_head.weight"]
    return {name: tensor.contiguous() for name, tensor in hf.items()}


def _taker(tensors: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"the checkpoint has no tensor {name!r} (missing)")
        return tensors.pop(name)
    return take


# --------------------------------------------------------------------------- files
def load_hf(path: str | os.PathLike, dtype: torch.dtype | None = None) -> GPT:
    """Build a GPT from a Hugging Face folder (config.json + safetensors), on the CPU.

    Each shard's weights pass ``check_weights`` as the file stores them, before any cast to ``dtype``.
    """
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} has no config.json: not a Hugging Face checkpoint folder")
    config = config_from_hf(_read_json(folder / "config.json"))
    tensors = {}
    for shard in _shard_files(folder):
        weights = read_safetensors(shard)[1]
        check_weights({name: t for name, t in weights.items() if not name.endswith(_IGNORED_SUFFIXES)}, shard)
        tensors.update(weights)
    state = hf_to_ours(tensors, config)
    model = GPT(config)
    expected = model.state_dict()
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)} in the checkpoint, "
                             f"the config implies {tuple(expected[name].shape)}")
    model.load_state_dict(state, strict=True)
    return model.to(dtype) if dtype is not None else model


def _shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a Hugging Face folder: those its index names, or model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        if not (folder / "model.safetensors").is_file():
            raise ValueError(f"{folder} has no model.safetensors (nor an index of shards)")
        return [folder / "model.safetensors"]
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index} has no 'weight_map' of tensor names to shard files")
    shards = sorted(set(weight_map.values()))
    missing = [shard for shard in shards if not (folder / shard).is_file()]
    if missing:
        raise ValueError(f"{index} names shard file(s) {missing} that are not in {folder}: "
                         "the download or copy is incomplete")
    return [folder / shard for shard in shards]


# --------------------------------------------------------------------------- any model
def load_model_and_tokenizer(path: str | os.PathLike, tokenizer_path: str | os.PathLike | None = None,
                             map_location: str | torch.device = "cpu") -> tuple[GPT, BPETokenizer]:
    """The model and its tokenizer from any source the course writes; ValueError naming a bad file.

    ``path``: a pretraining run folder (its model.safetensors, else its checkpoint.pt), one of
    those two files, or a Hugging Face folder (config.json + safetensors). Our files carry their
    tokenizer; a Hugging Face folder gets GPT-2's. ``tokenizer_path`` (a JSON file saved by
    ``BPETokenizer.save``) replaces either. The tokenizer must fit the model's vocabulary.
    """
    if tokenizer_path is not None and not Path(tokenizer_path).is_file():
        raise ValueError(f"tokenizer {tokenizer_path}: no such file (expected a JSON file saved by BPETokenizer.save)")
    tokenizer = BPETokenizer.load(tokenizer_path) if tokenizer_path is not None else None
    source = _model_source(Path(path))
    if source.is_dir():
        model = load_hf(source)
        tokenizer = tokenizer or _hf_tokenizer(source, model)
    else:
        model = model_from_checkpoint(source)
        tokenizer = tokenizer or tokenizer_from_checkpoint(source)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size:,} tokens but the model only "
                         f"{model.config.vocab_size:,}: they were not made for each other")
    return model.to(map_location), tokenizer


def _model_source(path: Path) -> Path:
    """The Hugging Face folder, or our checkpoint.pt or model.safetensors, that ``path`` stands for."""
    if path.is_dir() and not (path / "config.json").is_file():  # a training run's folder
        # The last is a spam classifier's (ch05): found only for model_from_checkpoint to say what it is.
        names = ("model.safetensors", "checkpoint.pt", "classifier.pt")
        found = [path / name for name in names if (path / name).is_file()]
        if not found:
            raise ValueError(f"{path} holds no model.safetensors or checkpoint.pt (a training run) and no "
                             f"config.json (a Hugging Face checkpoint)")
        path = found[0]  # the export (weights only) loads faster than the checkpoint
    if path.is_file() and path.suffix == ".safetensors":
        metadata = read_safetensors(path, tensors=False)[0]  # names a truncated file before anything reads it
        if metadata.get("format") != EXPORT_FORMAT and (path.parent / "config.json").is_file():
            return path.parent  # the weights of a Hugging Face folder: the folder has their config
    return path


def _hf_tokenizer(folder: Path, model: GPT) -> BPETokenizer:
    """GPT-2's tokenizer, for a model of the GPT-2 family or with GPT-2's vocabulary size."""
    vocab_size = model.config.vocab_size
    if model.config.position == "learned":
        if vocab_size < GPT2_VOCAB_SIZE:
            raise ValueError(f"{folder}: a Hugging Face GPT-2 model is read with GPT-2's vocabulary "
                             f"({GPT2_VOCAB_SIZE:,} tokens), but it has only {vocab_size:,}; pass --tokenizer")
        return BPETokenizer.gpt2()
    if vocab_size == GPT2_VOCAB_SIZE:  # e.g. ch04's pretrain.py --tokenizer gpt2 --preset llama-small
        return BPETokenizer.gpt2()
    raise ValueError(f"{folder} is a Llama-family checkpoint with {vocab_size:,} tokens; llmscratch ships "
                     "no tokenizer for it: pass --tokenizer")


def save_hf(model: GPT, path: str | os.PathLike) -> None:
    """Write ``config.json`` and ``model.safetensors`` that transformers' from_pretrained reads.

    Each file is written whole or not at all (a temporary file renamed into place).
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    hf_config = config_to_hf(model.config)
    hf_config["torch_dtype"] = str(model.token_embedding.weight.dtype).removeprefix("torch.")
    tensors = ours_to_hf({k: v.detach().cpu() for k, v in model.state_dict().items()}, model.config)
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})  # transformers ignores the checksum
    text = json.dumps(hf_config, indent=2) + "\n"
    write_text_atomically(folder / "config.json", text)


def _read_json(path: Path) -> dict:
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(content, dict):
        raise ValueError(f"{path} should hold a JSON object, got {type(content).__name__}")
    return content


GPT2_HUB_NAMES = {"gpt2-small": "openai-community/gpt2", "gpt2-medium": "openai-community/gpt2-medium",
                  "gpt2-large": "openai-community/gpt2-large", "gpt2-xl": "openai-community/gpt2-xl"}


def download_gpt2(name: str, folder: str | os.PathLike,
                  base_url: str = "https://huggingface.co") -> Path:
    """Fetch OpenAI's GPT-2 weights from the Hugging Face hub (needs the internet; never automatic)."""
    if name not in GPT2_HUB_NAMES:
        raise ValueError(f"unknown GPT-2 size {name!r}; choose one of {sorted(GPT2_HUB_NAMES)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for filename in ("config.json", "model.safetensors"):
        url = f"{base_url}/{GPT2_HUB_NAMES[name]}/resolve/main/{filename}"
        target = folder / filename
        partial = target.with_suffix(target.suffix + ".part")
        try:
            with urllib.request.urlopen(url, timeout=30) as response, open(partial, "wb") as out:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
        except (urllib.error.URLError, OSError) as err:
            partial.unlink(missing_ok=True)
            raise ConnectionError(
                f"could not download {url} ({err}). This needs internet access to the Hugging Face "
                f"hub; offline, use a checkpoint you already have (load_hf) or our own pretraining."
            ) from None
        partial.replace(target)
    return folder
