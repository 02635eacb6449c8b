"""Checkpoints: written atomically, loaded safely, portable across wrappers.

Two kinds of file:

* a training checkpoint (``checkpoint.pt``): one ``torch.save`` file of plain containers and
  tensors (model, optimizer, step, random states, data position, configs, tokenizer), so it
  loads with ``weights_only=True`` (no pickled code runs);
* a model export (``model.safetensors``): the weights alone, with the model config and the
  tokenizer in the file's metadata, for sharing and finetuning.

Both are written to a temporary file in the same folder and renamed over the old one: a
crash mid-save leaves the previous file intact. ``model_from_checkpoint`` reads either.

Both are checked when read, so damaged or wrong weights are refused rather than used: a
checkpoint.pt against the CRC-32 its zip stores for every entry, a safetensors file we wrote
against the sha256 in its metadata, and the weights of either (and of Hugging Face folders and
LoRA adapters) by ``check_weights``: floating point and finite, as the file stores them.
"""

import dataclasses
import hashlib
import json
import os
import random
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from llmscratch.atomic import write_atomically
from llmscratch.model import GPT, GPTConfig, unwrap
from llmscratch.quantize import quantize
from llmscratch.tokenizer import BPETokenizer

CHECKPOINT_FORMAT = "llmscratch-checkpoint"
EXPORT_FORMAT = "llmscratch-model"
# The metadata entry of the checksum ``write_safetensors`` adds; named for us, so that another
# tool's own "sha256" entry is never mistaken for it.
CHECKSUM_KEY = "llmscratch_sha256"
_DAMAGED = "the file was changed after it was written (disk or copy error)"
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


# --------------------------------------------------------------------------- random state
def rng_state() -> dict[str, Any]:
    """Every random number generator a training step may draw from, as plain data."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": np_pos,
                  "has_gauss": np_has_gauss, "gauss": np_gauss},
        "python": {"version": version, "state": list(py_state), "gauss": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this process's GPU only: one GPU per process
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["gauss"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --------------------------------------------------------------------------- files
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


def check_zip_checksums(path: str | os.PathLike) -> None:
    """ValueError naming the first entry of a ``torch.save`` file whose bytes do not match its CRC-32.

    A file that is not a zip at all is left for ``torch.load`` to name. Entries stored with a CRC
    of 0 are skipped: ``torch.serialization.set_crc32_options(False)`` writes every one so.
    """
    path = Path(path)
    if not zipfile.is_zipfile(path):
        return
    entry = None
    try:
        with zipfile.ZipFile(path) as archive:
            for entry in archive.infolist():
                if entry.CRC == 0:
                    continue
                with archive.open(entry) as data:  # reading to the end compares the CRC-32
                    while data.read(1 << 24):
                        pass
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:
        where = f"entry {entry.filename.partition('/')[2] or entry.filename}" if entry else "its zip directory"
        what = "fails its checksum" if "CRC" in str(err) else f"is unreadable ({err})"
        raise ValueError(f"{path} is damaged: {where} {what}; {_DAMAGED}; use another copy or an earlier "
                         f"checkpoint") from None


def check_weights(tensors: dict[str, Any], source: str | os.PathLike) -> None:
    """ValueError naming the first tensor in ``tensors`` that is not floating point or not finite.

    Run it on the tensors as a file stores them: loading them into a float model, or ``.to(dtype)``,
    would turn integers into floats without a word.
    """
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{source}: {name}: the file holds a {type(tensor).__name__}, expected a tensor")
        if not tensor.is_floating_point():
            raise ValueError(f"{source}: {name}: the file holds {tensor.dtype} values, "
                             f"expected floating point weights")
        if torch.isfinite(tensor.sum()):  # a NaN or inf anywhere makes the sum one; 25x faster than isfinite()
            continue
        nan, infinite = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
        if nan or infinite:  # else the sum only overflowed (a float16 tensor's can)
            counts = " and ".join(f"{n:,} {kind}" for n, kind in ((nan, "NaN"), (infinite, "infinite")) if n)
            raise ValueError(f"{source}: {name}: the file holds non-finite values ({counts} of "
                             f"{tensor.numel():,}): a model with them computes NaN; the run that wrote them "
                             f"diverged, or the file was edited")


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


def check_model_config(saved: dict[str, Any], config: GPTConfig) -> None:
    """ValueError naming every field where a checkpoint's model config differs from ``config``.

    A field the checkpoint does not record (it predates the field) counts as the field's default.
    """
    current = config.to_dict()
    saved = {**{f.name: f.default for f in dataclasses.fields(GPTConfig)}, **saved}
    differs = {key: (current.get(key), saved.get(key)) for key in sorted(set(current) | set(saved))
               if current.get(key) != saved.get(key)}
    if differs:
        listed = ", ".join(f"{key}: model {now!r} vs checkpoint {then!r}" for key, (now, then) in differs.items())
        raise ValueError(f"the checkpoint was made for another model ({listed})")


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

    quantization: the settings of a model made by ``llmscratch.quantize.quantize`` (its
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


# --------------------------------------------------------------------------- safetensors files
def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` (on the CPU) and ``metadata`` as a safetensors file, atomically, with their checksum.

    The checksum (metadata entry ``CHECKSUM_KEY``) covers every other metadata entry and every
    tensor's name, dtype, shape and bytes, so that ``read_safetensors`` finds any bit that changes.
    """
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    metadata = {**metadata, CHECKSUM_KEY: _content_digest(metadata, sorted(tensors.items()))}
    write_atomically(Path(path), lambda tmp: save_file(tensors, tmp, metadata=metadata))


def _content_digest(metadata: dict[str, str], tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 of the metadata (less the checksum) and of each (name, tensor), taken in name order.

    Each item is a line of JSON, then the tensor's bytes (as many as its dtype and shape say), so
    no two different contents give the same stream.
    """
    digest = hashlib.sha256()
    entries = {key: value for key, value in sorted(metadata.items()) if key != CHECKSUM_KEY}
    digest.update(json.dumps(entries).encode() + b"\n")
    for name, tensor in tensors:
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode() + b"\n")
        # As bytes: bfloat16 has no numpy dtype, and bytes are what a flipped bit changes.
        digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def read_safetensors(path: str | os.PathLike, tensors: bool = True) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The metadata and tensors (on the CPU; none if ``tensors`` is false) of a safetensors file.

    A missing, truncated or foreign file is a ValueError naming it: opening checks that the
    header is whole and that the file covers every tensor it lists. Read with its tensors, a
    file that carries a checksum (``write_safetensors``) is checked against it; files without
    one (Hugging Face downloads, older exports) load as they are. The metadata alone (``tensors``
    false) is a quick look, unchecked: the checksum needs every tensor's bytes.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no safetensors file at {path}")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            loaded = {name: f.get_tensor(name) for name in sorted(f.keys())} if tensors else {}
    except (SafetensorError, OSError) as err:  # e.g. "incomplete metadata, file not fully covered"
        raise ValueError(f"{path} is not a readable safetensors file (truncated, corrupt, or not a safetensors "
                         f"file at all: {err}); "
                         "copy or download it again") from None
    checksum = metadata.get(CHECKSUM_KEY) if tensors else None
    if checksum is not None and checksum != _content_digest(metadata, loaded.items()):  # loaded: in name order
        raise ValueError(f"{path} is damaged: its tensors or metadata no longer match the checksum written with "
                         f"them ({CHECKSUM_KEY}); {_DAMAGED}; use another copy or write it again")
    return metadata, loaded


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
        quantization = json.loads(metadata["quantization"]) if "quantization" in metadata else None
        check_weights({k: v for k, v in tensors.items() if not (quantization and k.endswith(".qweight"))}, path)
        config = config_from_dict(json.loads(metadata["model_config"]), str(path))
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


def quantized_like(model: GPT, quantization: dict[str, Any], tensors: dict[str, torch.Tensor],
                   source: str | os.PathLike) -> GPT:
    """``model`` quantized with a file's settings, its integer weights' dtypes checked against the file's."""
    settings = {key: quantization.get(key) for key in ("scheme", "group_size", "head")}
    try:
        model = quantize(model, settings["scheme"], settings["group_size"] or 64, bool(settings["head"]))
    except ValueError as err:
        raise ValueError(f"{source}: its quantization {quantization} does not fit its model: {err}") from None
    for name, buffer in model.state_dict().items():
        if name.endswith(".qweight") and name in tensors and tensors[name].dtype != buffer.dtype:
            raise ValueError(f"{source}: {name}: the file holds {tensors[name].dtype} values, expected {buffer.dtype} "
                             f"({settings['scheme']} weights)")
    return model


def tokenizer_from_checkpoint(path: str | os.PathLike) -> BPETokenizer:
    """The tokenizer saved with a training checkpoint (checkpoint.pt or a sharded checkpoint/ folder) or a
    model export."""
    path = Path(path)
    if path.is_dir():
        from llmscratch.sharded_checkpoint import read_meta  # torch.distributed.checkpoint: only when needed

        text = read_meta(path).get("tokenizer")
    elif path.suffix == ".safetensors":
        if not path.is_file():
            raise ValueError(f"no model export at {path}")
        text = _read_export(path)[0].get("tokenizer")  # with the tensors: the checksum that covers it needs them
    else:
        text = load_checkpoint(path).get("tokenizer")
    if text is None:
        raise ValueError(f"{path} was saved without a tokenizer")
    return BPETokenizer.from_json(text, source=f"the tokenizer in {path}")
