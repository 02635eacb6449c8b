"""Model weights from files: Hugging Face checkpoints in and out, and any model the course writes.

A checkpoint folder holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). ``load_hf`` maps each tensor to our names (``llmscratch.model.hf_formats``:
GPT-2, Llama, Qwen3, Gemma 3, Qwen3-MoE, Mixtral) and fails, naming the tensor, on anything missing,
unexpected or mis-shaped; ``save_hf`` writes the reverse.
``load_model_and_tokenizer`` opens every source a chapter produces (a pretraining run folder,
its checkpoint.pt or model.safetensors, a Hugging Face folder) with the tokenizer that fits it.
"""

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import torch

from llmscratch.files import check_weights, read_json_object, read_safetensors, write_safetensors, write_text_atomically
from llmscratch.model.checkpoint import EXPORT_FORMAT, model_from_checkpoint, tokenizer_from_checkpoint
from llmscratch.model.gpt import GPT
from llmscratch.model.hf_formats import (IGNORED_SUFFIXES, config_from_hf, config_to_hf, hf_to_ours,
                                         language_model_tensors, ours_to_hf)
from llmscratch.text.hf_tokenizer import load_tokenizer, tokenizer_from_hf
from llmscratch.text.sentencepiece import SentencePieceBPE
from llmscratch.text.tokenizer import BPETokenizer

__all__ = ["download_gpt2", "load_hf", "load_model_and_tokenizer", "save_hf"]

GPT2_VOCAB_SIZE = 50257


# --------------------------------------------------------------------------- files
def load_hf(path: str | os.PathLike, dtype: torch.dtype | None = None) -> GPT:
    """Build a GPT from a Hugging Face folder (config.json + safetensors), on the CPU; of a multimodal Gemma 3, its
    language model.

    Each shard's weights pass ``check_weights`` as the file stores them, before any cast to ``dtype``.
    """
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} has no config.json: not a Hugging Face checkpoint folder")
    hf_config = read_json_object(folder / "config.json")
    config = config_from_hf(hf_config)
    tensors = {}
    for shard in _shard_files(folder):
        weights = read_safetensors(shard)[1]
        check_weights({name: t for name, t in weights.items() if not name.endswith(IGNORED_SUFFIXES)}, shard)
        tensors.update(weights)
    state = hf_to_ours(language_model_tensors(hf_config, tensors), config)
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
    weight_map = read_json_object(index).get("weight_map")
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
