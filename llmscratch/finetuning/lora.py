"""LoRA (Hu et al., 2021): finetune a few low-rank matrices beside frozen linear layers.

A frozen layer ``y = x W^T + b`` gets a trainable update ``(alpha / rank) * x A^T B^T`` with
A (rank, in) random and B (out, rank) zero, so training starts from exactly the base model.
``apply_lora`` wraps chosen ``nn.Linear`` modules of a model and freezes everything else;
``merge_lora`` folds each update into a plain ``nn.Linear`` (no extra cost at inference);
``save_adapters`` / ``load_adapters`` store the A and B matrices alone, in safetensors;
``adapters_disabled`` switches every update off for a while: the base model, without a copy.
"""

import contextlib
import fnmatch
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from llmscratch.files import JSON_ERRORS, check_weights, read_safetensors, write_safetensors
from llmscratch.finetuning.config import LoRAConfig

_FORMAT = "llmscratch-lora"


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update scaled by alpha / rank."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise ValueError(f"LoRALinear wraps an nn.Linear, got {type(base).__name__}")
        LoRAConfig(rank=rank, alpha=alpha, dropout=dropout)  # validates the numbers
        self.base = base
        self.base.requires_grad_(False)
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank  # keeps the update's size steady when the rank changes
        weight = base.weight
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=weight.device, dtype=weight.dtype))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=weight.device, dtype=weight.dtype))
        # A as nn.Linear initialises its weight; B = 0 makes the update zero at the start.
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout)
        self.enabled = True  # False: the base layer alone (see adapters_disabled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return self.base(x)  # (..., out)
        update = self.dropout(x) @ self.lora_a.T @ self.lora_b.T  # (..., in) -> (..., rank) -> (..., out)
        return self.base(x) + self.scaling * update  # (..., out)

    def delta_weight(self) -> torch.Tensor:
        """The update as a full matrix (out, in), in at least float32: what merging adds to the base weight."""
        wide = torch.promote_types(self.lora_a.dtype, torch.float32)
        return self.scaling * (self.lora_b.to(wide) @ self.lora_a.to(wide))  # (out, in)

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` computing the same function (dropout aside), with new storage.

        The base weight is never changed in place: a head tied to the token embedding keeps the
        embedding intact and gets its own merged matrix.
        """
        base = self.base
        linear = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                           device=base.weight.device, dtype=base.weight.dtype)
        with torch.no_grad():
            # Summed in at least float32: a bf16 base would otherwise round the small update away.
            wide = torch.promote_types(base.weight.dtype, torch.float32)
            linear.weight.copy_(base.weight.to(wide) + self.delta_weight())  # (out, in)
            if base.bias is not None:
                linear.bias.copy_(base.bias)
        return linear

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, scaling={self.scaling:g}"


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Every LoRA-wrapped layer of the model, by module name."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with every LoRA update off inside the block (the base model), then as before, even after an error.

    The reference model of preference tuning (``llmscratch.alignment.preference``) is the policy this way: no
    second copy.
    """
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters to disable")
    was_enabled = {name: layer.enabled for name, layer in layers.items()}
    for layer in layers.values():
        layer.enabled = False
    try:
        yield model
    finally:
        for name, layer in layers.items():
            layer.enabled = was_enabled[name]


def apply_lora(model: nn.Module, config: LoRAConfig = LoRAConfig()) -> list[str]:
    """Freeze every parameter, then wrap the ``nn.Linear`` layers whose names match a target.

    Patterns are shell-style globs (``fnmatch``) matched against full module names such as
    ``blocks.0.attn.qkv``. Returns the wrapped names; ValueError if a pattern matches no
    linear layer or the model already has adapters.
    """
    if lora_layers(model):
        raise ValueError("the model already has LoRA adapters; merge_lora it first or load into it")
    chosen = lora_targets(model, config)
    model.requires_grad_(False)
    for name in chosen:
        _replace(model, name, LoRALinear(model.get_submodule(name), config.rank, config.alpha, config.dropout))
    return chosen


def lora_targets(model: nn.Module, config: LoRAConfig) -> list[str]:
    """The names of the ``nn.Linear`` layers ``config.targets`` choose; ValueError if a pattern matches
    none, or if the rank exceeds a chosen layer's smaller side (the update could not use it, and
    the matrices would only cost memory). Changes nothing."""
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    chosen = []
    for pattern in config.targets:
        matches = fnmatch.filter(linears, pattern)
        if not matches:
            shown = ", ".join(list(linears)[:6]) + (" ..." if len(linears) > 6 else "")
            raise ValueError(f"LoRA target {pattern!r} matches no linear layer; the linear layers are: {shown}")
        chosen.extend(m for m in matches if m not in chosen)
    for name in chosen:
        layer = linears[name]
        if config.rank > min(layer.in_features, layer.out_features):
            raise ValueError(f"LoRA rank {config.rank} is more than {name} can use: its weight is "
                             f"{layer.out_features} x {layer.in_features}, so a rank above "
                             f"{min(layer.in_features, layer.out_features)} adds nothing; choose a smaller rank")
    return chosen


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every LoRA layer by its merged ``nn.Linear`` (in place); returns the model."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters to merge")
    for name, layer in layers.items():
        merged = layer.merged()
        merged.requires_grad_(layer.base.weight.requires_grad)  # frozen like the base it replaces
        _replace(model, name, merged)
    return model


def save_adapters(model: nn.Module, path: str | os.PathLike) -> None:
    """Write the A and B matrices of every adapter (and their rank and alpha) to a safetensors file."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters to save")
    tensors = {}
    for name, layer in layers.items():
        tensors[f"{name}.lora_a"] = layer.lora_a.detach().contiguous().cpu()
        tensors[f"{name}.lora_b"] = layer.lora_b.detach().contiguous().cpu()
    shapes = {name: {"rank": layer.rank, "alpha": layer.alpha} for name, layer in layers.items()}
    metadata = {"format": _FORMAT, "layers": json.dumps(shapes, sort_keys=True)}
    write_safetensors(path, tensors, metadata)  # atomic: a crash keeps the old file


def load_adapters(model: nn.Module, path: str | os.PathLike, dropout: float = 0.0) -> list[str]:
    """Load adapters saved by ``save_adapters``, wrapping the same layers first if needed.

    Returns the adapted layer names. The whole file is checked against the model first (layer
    names, rank and alpha, every tensor's presence and shape, then ``check_weights``): a ValueError
    naming the problem leaves the model exactly as it was.
    """
    LoRAConfig(dropout=dropout)  # validates dropout before anything is read
    if not Path(path).is_file():
        raise ValueError(f"no adapter file at {path}")
    metadata, tensors = read_safetensors(path)  # ValueError for a truncated or foreign file
    expected = _adapter_layers(metadata, path)  # name -> (rank, alpha)
    layers = lora_layers(model)
    if layers:  # load into the model's adapters: they must be the file's
        if sorted(layers) != sorted(expected):
            raise ValueError(f"the adapters in {path} are for layers {sorted(expected)}, the model has {sorted(layers)}")
        for name, (_, alpha) in expected.items():
            if layers[name].alpha != alpha:
                raise ValueError(f"{name}: the file's adapter has alpha={alpha}, the model's {layers[name].alpha}")
        shapes = {name: (tuple(layer.lora_a.shape), tuple(layer.lora_b.shape)) for name, layer in layers.items()}
    else:  # wrap the layers the file names, each with its own rank and alpha
        linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        missing = sorted(set(expected) - set(linears))
        if missing:
            raise ValueError(f"the adapters in {path} are for layers {missing}, "
                             "which this model has no linear layer for")
        shapes = {name: ((rank, linears[name].in_features), (linears[name].out_features, rank))
                  for name, (rank, _) in expected.items()}
    _check_adapter_tensors(tensors, expected, shapes, path)

    if not layers:
        model.requires_grad_(False)
        for name, (rank, alpha) in expected.items():
            _replace(model, name, LoRALinear(linears[name], rank, alpha, dropout))
        layers = lora_layers(model)
    with torch.no_grad():
        for name in expected:
            for part in ("lora_a", "lora_b"):
                getattr(layers[name], part).copy_(tensors[f"{name}.{part}"])
    return sorted(expected)


def _adapter_layers(metadata: dict[str, str], path) -> dict[str, tuple[int, float]]:
    """name -> (rank, alpha) from an adapter file's metadata; ValueError naming what is malformed."""
    if metadata.get("format") != _FORMAT:
        raise ValueError(f"{path} is not an llmscratch LoRA adapter file (format {metadata.get('format')!r})")
    try:
        layers = json.loads(metadata["layers"])
    except (KeyError, *JSON_ERRORS) as err:
        raise ValueError(f"{path}: its metadata has no readable 'layers' entry ({err!r}); "
                         "expected the JSON that save_adapters writes") from None
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"{path}: its metadata 'layers' should map layer names to rank and alpha, got {layers!r}")
    expected = {}
    for name, shape in layers.items():
        try:
            config = LoRAConfig(rank=shape["rank"], alpha=shape["alpha"])
        except (TypeError, KeyError, ValueError) as err:
            raise ValueError(f"{path}: layer {name!r} has bad metadata {shape!r} ({err}); "
                             "expected a positive integer rank and a positive alpha") from None
        expected[name] = (config.rank, config.alpha)
    return expected


def _check_adapter_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, float]],
                           shapes: dict[str, tuple[tuple[int, int], tuple[int, int]]], path) -> None:
    """ValueError unless the file holds exactly the A and B matrices of the shapes the model needs, of finite floats."""
    wanted = {f"{name}.{part}" for name in expected for part in ("lora_a", "lora_b")}
    missing, unexpected = sorted(wanted - set(tensors)), sorted(set(tensors) - wanted)
    if missing or unexpected:
        raise ValueError(f"{path} does not hold the tensors its metadata lists: missing {missing[:6]}, "
                         f"unexpected {unexpected[:6]}")
    for name, (rank, _) in expected.items():
        a, b = tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"]
        if a.dim() != 2 or b.dim() != 2 or a.size(0) != rank or b.size(1) != rank:
            raise ValueError(f"{path}: {name}: its metadata says rank={rank}, but its A and B have shapes "
                             f"{tuple(a.shape)} and {tuple(b.shape)}")
        for part, tensor, shape in (("lora_a", a, shapes[name][0]), ("lora_b", b, shapes[name][1])):
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{path}: {name}.{part}: the file has shape {tuple(tensor.shape)}, the model {shape}")
    check_weights(tensors, path)
