"""Training checkpoints: written atomically, loaded safely, portable across wrappers.

A checkpoint is one ``torch.save`` file of plain containers and tensors, so it loads with
``weights_only=True`` (no pickled code runs). It is written to a temporary file in the same
folder and renamed over the old one: a crash mid-save leaves the previous checkpoint intact.
"""

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from llmscratch.model import GPT, GPTConfig

# Prefixes that wrappers add to parameter names: torch.compile and DistributedDataParallel.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DistributedDataParallel and/or torch.compile wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip wrapper prefixes (``_orig_mod.``, ``module.``) from every key."""
    cleaned = {}
    for key, value in state.items():
        while key.startswith(_WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        cleaned[key] = value
    return cleaned


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
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["gauss"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """``torch.save`` to a temporary file beside ``path``, flush it to disk, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new, never half
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint without running pickled code; a wrong file is a clear ValueError."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises several types for truncated or foreign files
        raise ValueError(f"{path} is not a readable llmscratch checkpoint: {err}") from None
    if not isinstance(state, dict) or "model" not in state or "model_config" not in state:
        raise ValueError(f"{path} is not an llmscratch checkpoint (no 'model' and 'model_config')")
    return state


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
            problems.append(f"missing from the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            problems.append(f"not in the model: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        if mismatched:
            problems.append(f"different shapes: {mismatched[:8]}")
        raise ValueError("the checkpoint does not fit this model; " + "; ".join(problems))
    target.load_state_dict(state)


def model_from_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> GPT:
    """Rebuild the GPT a checkpoint was trained with, with its weights."""
    state = load_checkpoint(path, map_location)
    model = GPT(GPTConfig(**state["model_config"]))
    load_model_state(model, state["model"])
    return model
