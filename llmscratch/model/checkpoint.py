"""Our model files: written atomically, loaded safely, portable across wrappers.

Two kinds of file:

* a training checkpoint (``checkpoint.pt``): one ``torch.save`` file of plain containers and
  tensors (model, optimizer, step, random states, data position, configs, tokenizer), so it
  loads with ``weights_only=True`` (no pickled code runs); what else a run needs to resume
  (random states, the sharded folder of an FSDP run) is ``llmscratch.training.resume``;
* a model export (``model.safetensors``): the weights alone (or a quantized model's integers and
  scales), with the model config and the tokenizer in the file's metadata, for sharing and finetuning.

``model_from_checkpoint`` reads either, and both are checked when read (``llmscratch.files``), so
damaged or wrong weights are refused rather than used. Hugging Face folders are ``llmscratch.model.weights``.
"""

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmscratch.files import (JSON_ERRORS, check_weights, check_zip_checksums, read_safetensors, write_atomically,
                              write_safetensors)
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT, unwrap
from llmscratch.model.quantize import SCHEMES, quantize
from llmscratch.text.hf_tokenizer import tokenizer_from_json
from llmscratch.text.sentencepiece import SentencePieceBPE
from llmscratch.text.tokenizer import BPETokenizer

CHECKPOINT_FORMAT = "llmscratch-checkpoint"
EXPORT_FORMAT = "llmscratch-model"
# Prefixes that wrappers add to parameter names: torch.compile and DistributedDataParallel.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip wrapper prefixes (``_orig_mod.``, ``module.``, in any order) from every key."""
    cleaned = {}
    for key, value in state.items():
        while key.startswith(_WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        cleaned[key] = value
    return cleaned


# --------------------------------------------------------------------------- training checkpoints
def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """``torch.save`` a training state (see ``Trainer.state_dict``) atomically."""
    write_atomically(Path(path), lambda tmp: torch.save({"format": CHECKPOINT_FORMAT, **state}, tmp))


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a training checkpoint without running pickled code; a wrong or damaged file is a clear ValueError.

    Every zip entry is checked against its CRC-32 first (torch.load checks none), then the model
    weights with ``check_weights``.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no checkpoint at {path}")
    if _is_safetensors(path):
        raise ValueError(f"{path} is a safetensors file (a model export?), not a training checkpoint; expected "
                         f"the checkpoint.pt of a run (a model export loads with model_from_checkpoint)")
    check_zip_checksums(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises several types for truncated or foreign files
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "weights_only" in str(err):  # its advice (weights_only=False) would run the file's pickled code
            reason = "it holds objects other than tensors and plain containers"
        raise ValueError(f"{path} is not a readable llmscratch checkpoint ({reason}); expected a checkpoint.pt "
                         f"written by save_checkpoint") from None
    if (not isinstance(state, dict) or state.get("format", CHECKPOINT_FORMAT) != CHECKPOINT_FORMAT
            or not isinstance(state.get("model"), dict) or "model_config" not in state):
        raise ValueError(f"{path} is not an llmscratch checkpoint (no 'model' and 'model_config')")
    check_weights(state["model"], path)  # the optimizer's state may hold anything a step left there
    return state


def _is_safetensors(path: Path) -> bool:
    """True when the file starts as safetensors files do: an 8-byte header length, then a JSON object."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") <= path.stat().st_size


def config_from_dict(saved: dict[str, Any], source: str = "the checkpoint") -> GPTConfig:
    """The GPTConfig a checkpoint recorded; unknown fields or bad values are a ValueError."""
    known = {field.name for field in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(saved) - known)
    if unknown:
        raise ValueError(f"{source} has model config fields this llmscratch does not know: {unknown}")
    return GPTConfig(**saved)


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load weights into ``model`` (wrapped or not), naming every key or shape that differs."""
    target = unwrap(model)
    state = clean_state_dict(state)
    expected = target.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
                  for k in sorted(set(state) & set(expected)) if state[k].shape != expected[k].shape]
    if missing or unexpected or mismatched:
        problems = []
        if missing:
            problems.append(f"missing from the checkpoint: {_some(missing)}")
        if unexpected:
            problems.append(f"not in the model: {_some(unexpected)}")
        if mismatched:
            problems.append(f"different shapes: {_some(mismatched)}")
        raise ValueError("the checkpoint does not fit this model; " + "; ".join(problems))
    target.load_state_dict(state)


def _some(items: list[str], shown: int = 8) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


# --------------------------------------------------------------------------- model exports
def export_model(model: nn.Module, path: str | os.PathLike, tokenizer: BPETokenizer | None = None,
                 dtype: torch.dtype | None = None) -> None:
    """Write the weights as safetensors, with the model config and tokenizer in its metadata.

    dtype: store the weights in this precision (bfloat16 halves the file); None keeps theirs.
    ``model_from_checkpoint`` loads them back into a float32 model either way.
    """
    raw = unwrap(model)
    export_state_dict(raw.state_dict(), raw.config, path, tokenizer, dtype, getattr(raw, "quantization", None))


def export_state_dict(state: dict[str, torch.Tensor], config: GPTConfig, path: str | os.PathLike,
                      tokenizer: BPETokenizer | None = None, dtype: torch.dtype | None = None,
                      quantization: dict[str, Any] | None = None) -> None:
    """``export_model`` from a full state dict and its config (e.g. gathered from a sharded model).

    quantization: the settings of a model made by ``llmscratch.model.quantize.quantize`` (its
    ``.quantization``); its integer weights and their scales are stored as they are, whatever ``dtype``.
    """
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"an export's dtype must be a floating point type (e.g. torch.bfloat16), got {dtype}")
    tensors = {name: tensor.detach().to("cpu", dtype if dtype and not _quantized_part(name, quantization)
                                               and tensor.is_floating_point() else tensor.dtype)
               for name, tensor in clean_state_dict(state).items()}
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # the same matrix as the token embedding: stored once
    metadata = {"format": EXPORT_FORMAT, "model_config": json.dumps(config.to_dict())}
    if quantization is not None:
        metadata["quantization"] = json.dumps(quantization)
    if tokenizer is not None:
        metadata["tokenizer"] = tokenizer.to_json()
    write_safetensors(path, tensors, metadata)


# --------------------------------------------------------------------------- reading either
def _read_export(path: Path, tensors: bool = True) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    metadata, tensors = read_safetensors(path, tensors)
    if metadata.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{path} is not an llmscratch model export (its metadata has no format {EXPORT_FORMAT!r})")
    return metadata, tensors


def model_from_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> GPT:
    """Rebuild the GPT a training checkpoint (.pt) or model export (.safetensors) holds."""
    path = Path(path)
    if path.suffix == ".safetensors":
        if not path.is_file():
            raise ValueError(f"no model export at {path}")
        metadata, tensors = _read_export(path)
        quantization = _metadata_object(metadata, "quantization", path) if "quantization" in metadata else None
        check_weights({k: v for k, v in tensors.items() if not (quantization and k.endswith(".qweight"))}, path)
        config = config_from_dict(_metadata_object(metadata, "model_config", path), str(path))
        model = GPT(config)
        if quantization is not None:  # the quantized layers' shapes and dtypes, then the file's values in them
            model = quantized_like(model, quantization, tensors, path)
        if config.tie_embeddings and "token_embedding.weight" in tensors and "lm_head.weight" in model.state_dict():
            tensors["lm_head.weight"] = tensors["token_embedding.weight"]
        load_model_state(model, tensors)
        return model.to(map_location)
    state = load_checkpoint(path, map_location)
    if "labels" in state:  # Classifier.save's file: its head scores labels, not the next token
        raise ValueError(f"{path} is a text classifier (labels {', '.join(map(str, state['labels']))}) saved by "
                         f"ch05-finetuning/finetune_classifier.py: it scores texts and has no language-model head; "
                         f"give a language model (a model.safetensors or checkpoint.pt of pretrain.py or "
                         f"finetune_instructions.py, or a Hugging Face folder)")
    model = GPT(config_from_dict(state["model_config"], str(path)))
    load_model_state(model, state["model"])
    return model.to(map_location)


def _quantized_part(name: str, quantization: dict[str, Any] | None) -> bool:
    """Whether a tensor of a quantized model's state is one of its integer weights or their scales."""
    return quantization is not None and name.rpartition(".")[2] in ("qweight", "scales")


def _metadata_object(metadata: dict[str, str], key: str, path: Path) -> dict[str, Any]:
    """The JSON object a model export's metadata entry ``key`` holds; ValueError naming the file and the entry."""
    if key not in metadata:
        raise ValueError(f"{path}: its metadata has no {key!r} entry (every model export records one)")
    try:
        value = json.loads(metadata[key])
    except JSON_ERRORS as err:
        raise ValueError(f"{path}: its metadata {key!r} is not JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: its metadata {key!r} should be a JSON object, got {type(value).__name__}")
    return value


def check_quantization(quantization: dict[str, Any], source: str | os.PathLike) -> None:
    """ValueError naming the field of a file's quantization settings (``quantize``'s ``.quantization``) that
    is missing, unknown or of the wrong type; whether a group size fits the model is ``quantize``'s check."""
    fields = {"scheme", "group_size", "head"}
    if problem := sorted(set(quantization) ^ fields):
        raise ValueError(f"{source}: quantization field(s) {problem} missing or unknown; expected {sorted(fields)}")
    scheme, group_size, head = (quantization[key] for key in ("scheme", "group_size", "head"))
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise ValueError(f"{source}: quantization scheme {scheme!r}: expected one of {sorted(SCHEMES)}")
    if scheme == "int4" and (type(group_size) is not int or group_size < 2 or group_size % 2):
        raise ValueError(f"{source}: quantization group_size {group_size!r}: expected an even integer of at least 2 "
                         f"(int4 inputs per scale)")
    if scheme != "int4" and group_size is not None:
        raise ValueError(f"{source}: quantization group_size {group_size!r}: expected null for {scheme} (one scale "
                         f"per row)")
    if not isinstance(head, bool):
        raise ValueError(f"{source}: quantization head {head!r}: expected true or false")


def quantized_like(model: GPT, quantization: dict[str, Any], tensors: dict[str, torch.Tensor],
                   source: str | os.PathLike) -> GPT:
    """``model`` quantized with a file's settings, its integer weights and scales checked against the file's."""
    check_quantization(quantization, source)
    try:
        model = quantize(model, quantization["scheme"], quantization["group_size"] or 64, quantization["head"])
    except ValueError as err:
        raise ValueError(f"{source}: its quantization {quantization} does not fit its model: {err}") from None
    state = model.state_dict()
    made = {name for name in state if _quantized_part(name, quantization)}
    held = {name for name in tensors if _quantized_part(name, quantization)}
    if made != held:  # the metadata says one thing ("head": false), the tensors another (lm_head.qweight)
        odd = sorted(held - made) or sorted(made - held)
        raise ValueError(f"{source}: its quantization metadata {quantization} and its tensors disagree: "
                         f"{'the file holds' if held - made else 'the file lacks'} {', '.join(odd[:4])}"
                         f"{' ...' if len(odd) > 4 else ''}")
    for name, buffer in state.items():
        if name not in made:
            continue
        stored = tensors[name]
        if name.endswith(".qweight") and stored.dtype != buffer.dtype:
            raise ValueError(f"{source}: {name}: the file holds {stored.dtype} values, expected {buffer.dtype} "
                             f"({quantization['scheme']} weights)")
        if stored.shape != buffer.shape:
            raise ValueError(f"{source}: {name}: the file holds shape {tuple(stored.shape)}, expected "
                             f"{tuple(buffer.shape)} ({quantization['scheme']} of this model)")
    return model


def tokenizer_from_checkpoint(path: str | os.PathLike) -> "BPETokenizer | SentencePieceBPE":
    """The tokenizer saved with a training checkpoint (checkpoint.pt) or a model export (its sharded form, a
    checkpoint/ folder: ``llmscratch.training.resume.read_meta``)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        if not path.is_file():
            raise ValueError(f"no model export at {path}")
        text = _read_export(path)[0].get("tokenizer")  # with the tensors: the checksum that covers it needs them
    else:
        text = load_checkpoint(path).get("tokenizer")
    if text is None:
        raise ValueError(f"{path} was saved without a tokenizer")
    return tokenizer_from_json(text, source=f"the tokenizer in {path}")
