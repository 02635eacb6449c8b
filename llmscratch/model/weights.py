"""Model weights from files: Hugging Face checkpoints in and out, and any model the course writes.

A checkpoint folder holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). ``load_hf`` maps each tensor to our names (``llmscratch.model.hf_formats``:
GPT-2, Llama, Arcee, Qwen3, Gemma 3, Qwen3-MoE, Mixtral) and fails, naming the tensor, on anything missing,
unexpected or mis-shaped, and naming config.json's field when a size does not fit the weights or the machine's memory:
all before anything is allocated, with no file outside the folder read. ``save_hf`` writes the reverse
(the course's squared-ReLU Llama as Arcee; a quantized model dequantized).
``load_model_and_tokenizer`` opens every source a chapter produces (a pretraining run folder,
its checkpoint.pt or model.safetensors, a Hugging Face folder) with the tokenizer that fits it.
"""

import dataclasses
import json
import os
import re
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import torch

from llmscratch.device import machine_memory
from llmscratch.files import (check_weights, read_json_object, read_safetensors, read_safetensors_shapes,
                              write_safetensors, write_text_atomically)
from llmscratch.model.checkpoint import EXPORT_FORMAT, model_from_checkpoint, tokenizer_from_checkpoint
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.model.hf_formats import (IGNORED_SUFFIXES, config_from_hf, config_to_hf, hf_to_ours,
                                         language_model_tensors, ours_to_hf, size_fields)
from llmscratch.text.hf_tokenizer import load_tokenizer, tokenizer_from_hf
from llmscratch.text.sentencepiece import SentencePieceBPE
from llmscratch.text.tokenizer import BPETokenizer

__all__ = ["download_gpt2", "load_hf", "load_model_and_tokenizer", "save_hf"]

GPT2_VOCAB_SIZE = 50257


# --------------------------------------------------------------------------- files
def load_hf(path: str | os.PathLike, dtype: torch.dtype | None = None) -> GPT:
    """Build a GPT from a Hugging Face folder (config.json + safetensors), on the CPU; of a multimodal Gemma 3, its
    language model.

    Nothing is allocated before config.json has been checked against the shapes the safetensors headers record
    and the model found to fit in memory; no file outside the folder is read. Each shard's weights pass
    ``check_weights`` as the file stores them, before any cast to ``dtype``.
    """
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} has no config.json: not a Hugging Face checkpoint folder")
    hf_config = read_json_object(config_file)
    config = config_from_hf(hf_config, source=str(config_file))
    shards = _shard_files(folder)
    _check_sizes(hf_config, config, shards, config_file)
    tensors = {}
    for shard in shards:
        weights = read_safetensors(shard)[1]
        check_weights({name: t for name, t in weights.items() if not name.endswith(IGNORED_SUFFIXES)}, shard)
        tensors.update(weights)
    state = hf_to_ours(language_model_tensors(hf_config, tensors), config)
    model = GPT(config)
    model.load_state_dict(state, strict=True)  # every shape was compared in _check_sizes
    return model.to(dtype) if dtype is not None else model


# A layer's tensors in every family's names: model.layers.3.*, transformer.h.3.* (GPT-2), h.3.*
_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def _check_sizes(hf_config: dict, config: GPTConfig, shards: list[Path], config_file: Path) -> None:
    """ValueError naming config.json and its fields unless the model they describe has the shapes the shards'
    headers record and fits in this machine's memory; read from the headers and built on the "meta" device, so
    that nothing is allocated and no tensor is read."""
    fields = size_fields(hf_config)
    meta = {}
    for shard in shards:
        meta.update({name: torch.empty(shape, device="meta") for name, shape in read_safetensors_shapes(shard).items()})
    meta = language_model_tensors(hf_config, meta)
    layers = len({match.group(1) for name in meta if (match := _LAYER.search(name))})
    if layers != config.n_layers:
        named = _named(fields, ("n_layer", "num_hidden_layers"))
        raise ValueError(f"{config_file}: {named} does not fit the weights, which hold {layers} layers")
    with torch.device("meta"):
        model = GPT(config)
    expected = model.state_dict()
    try:
        state = hf_to_ours(meta, config)
    except ValueError as err:
        raise ValueError(f"{config_file.parent}: the weights do not fit config.json ({_named(fields)}): "
                         f"{err}") from None
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            sizes = set(expected[name].shape) - set(tensor.shape)
            named = _named({k: v for k, v in fields.items() if v in sizes} or fields)
            raise ValueError(f"{config_file}: {named} does not fit the weights: tensor {name} has shape "
                             f"{tuple(tensor.shape)} in the checkpoint, the config implies "
                             f"{tuple(expected[name].shape)}")
    _check_memory(model, shards, fields, config_file)


def _check_memory(model: GPT, shards: list[Path], fields: dict[str, int], config_file: Path) -> None:
    """ValueError unless the model (built on "meta"), in float32, and the weights read beside it fit in memory.

    The weights' shapes pin every parameter; what they do not pin are the tables sized by the context length
    (RoPE's cos and sin), which a config.json claiming 10**10 positions would make terabytes long.
    """
    available = machine_memory()
    parameters = sum(p.numel() * 4 for p in model.parameters())
    tables = sum(b.numel() * b.element_size() for b in model.buffers())
    stored = sum(shard.stat().st_size for shard in shards)
    if available is None or parameters + tables + stored <= available:
        return
    gib = 1 << 30
    raise ValueError(f"{config_file}: this model needs about {(parameters + tables + stored) / gib:,.1f} GiB of "
                     f"memory to load ({parameters / gib:,.1f} GiB of weights in float32, {stored / gib:,.1f} GiB "
                     f"read from its files, {tables / gib:,.1f} GiB of position tables for "
                     f"{_named(fields, ('n_positions', 'max_position_embeddings'))}), more than this machine's "
                     f"{available / gib:,.1f} GiB")


def _named(fields: dict[str, int], names: tuple[str, ...] | None = None) -> str:
    """``name=value`` of the size fields called ``names`` (as the file spells them), or of them all."""
    chosen = {k: v for k, v in fields.items() if names is None or k.rpartition(".")[2] in names}
    return ", ".join(f"{k}={v}" for k, v in chosen.items()) or "its sizes"


def _shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a Hugging Face folder: those its index names, or model.safetensors; each one a file
    of the folder, checked before anything reads it."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        if not (folder / "model.safetensors").is_file():
            raise ValueError(f"{folder} has no model.safetensors (nor an index of shards)")
        _check_inside(folder, "model.safetensors", f"{folder / 'model.safetensors'}")
        return [folder / "model.safetensors"]
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no 'weight_map' of tensor names to shard files")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard.endswith(".safetensors") or "\0" in shard:
            raise ValueError(f"{index}: weight_map entry {tensor!r} is {shard!r}, expected the name of a "
                             f".safetensors file in {folder}")
        if Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise ValueError(f"{index}: weight_map entry {tensor!r} names {shard!r}, a path out of {folder}; a "
                             "shard must be a file in the folder")
    shards = sorted(set(weight_map.values()))
    missing = [shard for shard in shards if not (folder / shard).is_file()]
    if missing:
        raise ValueError(f"{index} names shard file(s) {missing} that are not in {folder}: "
                         "the download or copy is incomplete")
    for shard in shards:
        _check_inside(folder, shard, f"{index}: weight_map's {shard!r}")
    return [folder / shard for shard in shards]


def _check_inside(folder: Path, name: str, where: str) -> None:
    """ValueError unless ``folder / name`` is a file of the folder once links are followed. The one link out
    allowed is the Hugging Face hub cache's: snapshots/<revision>/<file> -> ../../blobs/<hash>."""
    target, inside = (folder / name).resolve(), folder.resolve()
    hub_blob = inside.parent.name == "snapshots" and target.parent == inside.parent.parent / "blobs"
    if not target.is_relative_to(inside) and not hub_blob:
        raise ValueError(f"{where} links to {target}, outside {folder}; a shard must be a file in the folder")


# --------------------------------------------------------------------------- any model
def load_model_and_tokenizer(path: str | os.PathLike, tokenizer_path: str | os.PathLike | None = None,
                             map_location: str | torch.device = "cpu") -> tuple[GPT, BPETokenizer]:
    """The model and its tokenizer from any source the course writes; ValueError naming a bad file.

    ``path``: a pretraining run folder (its model.safetensors, else its checkpoint.pt), one of
    those two files, or a Hugging Face folder (config.json + safetensors). Our files carry their
    tokenizer; a Hugging Face folder its tokenizer.json, else GPT-2's. ``tokenizer_path`` (a JSON file saved by
    ``BPETokenizer.save``, or a Hugging Face tokenizer.json) replaces either. The tokenizer must fit the model's
    vocabulary.
    """
    if tokenizer_path is not None and not Path(tokenizer_path).is_file():
        raise ValueError(f"tokenizer {tokenizer_path}: no such file (expected a JSON file saved by BPETokenizer.save, "
                         "or a Hugging Face tokenizer.json)")
    tokenizer = None if tokenizer_path is None else load_tokenizer(tokenizer_path)
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


def _hf_tokenizer(folder: Path, model: GPT) -> "BPETokenizer | SentencePieceBPE":
    """The folder's own tokenizer.json (llmscratch.text.hf_tokenizer); without one, GPT-2's tokenizer, for a
    model of the GPT-2 family or with GPT-2's vocabulary size."""
    if (folder / "tokenizer.json").is_file():
        return tokenizer_from_hf(folder / "tokenizer.json")
    if (folder / "tokenizer.json").exists() or (folder / "tokenizer.json").is_symlink():
        what = "a folder" if (folder / "tokenizer.json").is_dir() else "a link to nothing"
        raise ValueError(f"{folder / 'tokenizer.json'} is {what}, not a tokenizer file")
    vocab_size = model.config.vocab_size
    if model.config.position == "learned":
        if vocab_size < GPT2_VOCAB_SIZE:
            raise ValueError(f"{folder}: a Hugging Face GPT-2 model is read with GPT-2's vocabulary "
                             f"({GPT2_VOCAB_SIZE:,} tokens), but it has only {vocab_size:,}; pass --tokenizer")
        return BPETokenizer.gpt2()
    if vocab_size == GPT2_VOCAB_SIZE:  # e.g. ch04's pretrain.py --tokenizer gpt2 --preset llama-small
        return BPETokenizer.gpt2()
    raise ValueError(f"{folder} is a Llama-family checkpoint with {vocab_size:,} tokens and no tokenizer.json; "
                     "llmscratch ships no tokenizer for it: pass --tokenizer")


def save_hf(model: GPT, path: str | os.PathLike) -> None:
    """Write ``config.json`` and ``model.safetensors`` that transformers' from_pretrained reads.

    The model's shape is mapped to the Hugging Face family that holds it (``hf_formats.family_of``: the squared-ReLU
    Llama the course trains is Arcee's) before anything is written: a shape with no home is a ValueError naming
    what none has, and leaves no folder behind. A quantized model (``llmscratch.model.quantize``) is written
    dequantized, as float32 weights; its quantized head, no longer the embedding's copy, apart from it. Each file
    is written whole or not at all (a temporary file renamed into place); a folder this call made is removed
    again if writing fails.
    """
    folder = Path(path)
    config, state = _float_state(model)
    hf_config = config_to_hf(config)
    hf_config["torch_dtype"] = str(state["token_embedding.weight"].dtype).removeprefix("torch.")
    tensors = ours_to_hf(state, config)
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})  # transformers ignores the checksum
        write_text_atomically(folder / "config.json", json.dumps(hf_config, indent=2) + "\n")
    except BaseException:
        if made:
            shutil.rmtree(folder, ignore_errors=True)
        raise


def _float_state(model: GPT) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The config to export and the weights under a float GPT's names, on the CPU: a quantized layer's ``weight``
    is its dequantized matrix. A head that the config ties to the embedding but that holds other values (quantized
    or LoRA-merged apart from it) is written untied. ValueError for a layer that holds no plain weight."""
    adapters = sorted({name.rpartition(".")[0] for name in model.state_dict() if name.endswith(".lora_a")})
    if adapters:
        raise ValueError(f"the model has LoRA adapters ({', '.join(adapters[:3])}{' ...' if len(adapters) > 3 else ''}"
                         f"): merge them into its weights first (llmscratch.finetuning.lora.merge_lora)")
    with torch.device("meta"):
        names = GPT(model.config).state_dict()
    state = {}
    for name in names:
        owner, _, leaf = name.rpartition(".")
        tensor = getattr(model.get_submodule(owner), leaf, None)
        if tensor is None:
            raise ValueError(f"the model's {owner} ({type(model.get_submodule(owner)).__name__}) holds no {leaf} "
                             f"tensor, which a GPT of its config has: nothing to export for it")
        state[name] = tensor.detach().cpu()
    config = model.config
    if config.tie_embeddings and not torch.equal(state["lm_head.weight"], state["token_embedding.weight"]):
        config = dataclasses.replace(config, tie_embeddings=False)
    return config, state


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
