"""What a run needs to resume exactly where it stopped: every random state, the model config it was made for,
and the sharded checkpoint folder that FSDP and tensor-parallel runs write.

The single-file ``checkpoint.pt`` of a DDP or one-process run is ``llmscratch.model.checkpoint``'s.
With ``parallel`` other than "ddp", ``checkpoint/`` holds the files of torch.distributed.checkpoint (DCP):
each rank writes its own shards of the model and the optimizer state, plus one ``.metadata`` index of where
every piece of every tensor lives, and ``meta.pt``, the small rest: step, random states and data positions
of every rank, configs, tokenizer.

The index describes whole (logical) tensors, not how they were cut: ``get_state_dict`` names every
tensor by its parameter's name, sharded or not, and DCP's reader gives each rank the rows it needs.
So a checkpoint written by 2 processes loads into 1 (an unsharded GPT) and the reverse.

Atomic like ``checkpoint.pt``: all ranks write ``checkpoint.tmp-<step>/``; only after every rank
finished does rank 0 move it into place (through ``checkpoint.old/`` for the moment between the
two renames), so a crash mid-write leaves the last good checkpoint readable.
"""

import contextlib
import dataclasses
import os
import random
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from llmscratch.files import check_zip_checksums
from llmscratch.model.config import GPTConfig
from llmscratch.training import distributed

__all__ = ["META_FILE", "check_model_config", "load_sharded", "load_sharded_renamed", "read_meta", "rng_state",
           "save_sharded", "set_rng_state", "sharded_checkpoint_path"]

META_FILE = "meta.pt"
SHARDED_FORMAT = "llmscratch-sharded-checkpoint"


# --------------------------------------------------------------------------- sharded checkpoints
def _old(directory: Path) -> Path:
    return directory.with_name(directory.name + ".old")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: here that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def sharded_checkpoint_path(directory: str | os.PathLike) -> Path | None:
    """The folder that holds the last complete checkpoint: ``directory``, or its ``.old`` copy when a
    crash came between the two renames of a save; None when there is neither."""
    directory = Path(directory)
    for candidate in (directory, _old(directory)):
        if (candidate / META_FILE).is_file():
            return candidate
    return None


def save_sharded(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                 meta: dict[str, Any], is_main: bool) -> None:
    """Every rank: write the model and optimizer (sharded or not) and rank 0's ``meta`` into ``directory``."""
    directory = Path(directory)
    tmp = directory.with_name(f"{directory.name}.tmp-{meta['step']}")
    if is_main and tmp.exists():
        shutil.rmtree(tmp)  # left by a save of this step that crashed
    distributed.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)  # names -> (D)Tensors, no copies
    with _quiet():
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
    if is_main:
        torch.save({"format": SHARDED_FORMAT, **meta}, tmp / META_FILE)
    distributed.barrier()  # every rank's shards are on disk
    if is_main:
        old = _old(directory)
        if old.exists():
            shutil.rmtree(old)
        if directory.exists():
            os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
        for stale in directory.parent.glob(f"{directory.name}.tmp-*"):  # of steps that crashed mid-save
            shutil.rmtree(stale, ignore_errors=True)
    distributed.barrier()


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``meta.pt`` of a sharded checkpoint, loaded without running pickled code; ValueError if wrong."""
    found = sharded_checkpoint_path(directory)
    if found is None:
        raise ValueError(f"no sharded checkpoint at {directory} (expected a folder with {META_FILE} and DCP's "
                         f"files, written by a run with --parallel fsdp)")
    check_zip_checksums(found / META_FILE)  # DCP's own weight files carry no checksum to check
    try:
        meta = torch.load(found / META_FILE, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated or foreign files raise several types
        raise ValueError(f"{found / META_FILE} is not readable ({type(err).__name__}: {err})") from None
    if not isinstance(meta, dict) or meta.get("format") != SHARDED_FORMAT:
        raise ValueError(f"{found / META_FILE} is not an llmscratch sharded checkpoint")
    if not (found / ".metadata").is_file():
        raise ValueError(f"{found} has {META_FILE} but no DCP index (.metadata): the checkpoint is incomplete")
    return meta


def load_sharded(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank: fill ``model`` and ``optimizer`` (sharded or not, any number of ranks) from ``directory``."""
    found = sharded_checkpoint_path(directory)
    if found is None:
        raise ValueError(f"no sharded checkpoint at {directory}")
    # The current state is the template: its (D)Tensors say which rows each rank reads, in place.
    # (An optimizer that has not stepped yet gets its state made first, by a step with lr 0.)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        with _quiet():
            dcp.load(state, checkpoint_id=found)  # DCP's own reader: tensors and plain data, no pickled code
    except Exception as err:  # missing keys, other shapes, damaged files; raised on every rank alike
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise ValueError(f"the sharded checkpoint in {found} does not load into this model and optimizer "
                         f"({reason})") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_sharded_renamed(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                         rename: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    """Every rank: fill ``model`` and ``optimizer`` from a checkpoint whose tensors are named (and cut)
    another way, e.g. q, k, v fused or split (``parallel.fused_qkv_state``, ``split_qkv_state``).

    ``rename`` maps whole tensors by parameter name to this model's names; it is applied to the
    weights and to each kind of AdamW state (exp_avg, exp_avg_sq, step). Every rank reads all
    tensors whole and cuts its own shards: for a moment the memory of an unsharded run.
    """
    found = sharded_checkpoint_path(directory)
    if found is None:
        raise ValueError(f"no sharded checkpoint at {directory}")
    stored = dcp.FileSystemReader(found).read_metadata().state_dict_metadata
    flat = {key: torch.empty(item.size, dtype=item.properties.dtype) for key, item in stored.items()
            if isinstance(item, TensorStorageMetadata) and key.startswith(("model.", "optimizer.state."))}
    with _quiet():
        dcp.load(flat, checkpoint_id=found)
    model_state = rename({key.removeprefix("model."): value for key, value in flat.items()
                          if key.startswith("model.")})
    by_kind: dict[str, dict[str, torch.Tensor]] = {}  # exp_avg, exp_avg_sq, step -> {parameter: tensor}
    for key, value in flat.items():
        if key.startswith("optimizer.state."):
            name, _, kind = key.removeprefix("optimizer.state.").rpartition(".")
            by_kind.setdefault(kind, {})[name] = value
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for kind, tensors in by_kind.items():
        for name, value in rename(tensors).items():
            moments.setdefault(name, {})[kind] = value
    _, current = get_state_dict(model, optimizer)
    set_state_dict(model, optimizer, model_state_dict=model_state,
                   optim_state_dict={"state": moments, "param_groups": current["param_groups"]},
                   options=StateDictOptions(full_state_dict=True))


# --------------------------------------------------------------------------- random states and the config
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
