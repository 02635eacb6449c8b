"""Weight-only quantization: int8 per output channel, int4 in groups along the input features.

A weight matrix (out_features, in_features) is stored as small integers and a float scale per row
(int8) or per group of ``group_size`` inputs of a row (int4, two values packed in a byte), and turned
back into floats, ``q * scale``, when the layer runs. Both schemes are symmetric: 0 stays exactly 0.
The activations and everything outside the blocks' linear layers (embeddings, norms, the output
head) stay in full precision.
"""
import copy

import torch
import torch.nn.functional as F
from torch import nn

SCHEMES = {"int8": 127, "int4": 7}  # the largest |q| of each: a row's (or group's) largest |w| maps to it


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): int8 (out, in) in [-127, 127] and float32 (out,), with weight ~ q * scales[:, None]."""
    weight = weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / SCHEMES["int8"]  # (out,)
    q = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight (out, in) that int8 ``q`` and its row scales stand for."""
    return q.float() * scales[:, None]


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scales): uint8 (out, in / 2), two 4-bit values a byte, and float32 (out, in / group_size).

    Each group of ``group_size`` consecutive inputs of a row gets its own scale, so one outlier spoils
    only its group. q in [-7, 7] is stored as q + 8; column 2j in the low half of byte j, 2j + 1 in the high.
    """
    out_features, in_features = weight.shape
    _check_int4_shape(in_features, group_size)
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    scales = groups.abs().amax(dim=2).clamp(min=torch.finfo(torch.float32).tiny) / SCHEMES["int4"]  # (out, n_groups)
    q = torch.round(groups / scales[..., None]).clamp(-7, 7).reshape(out_features, in_features)
    stored = (q + 8).to(torch.uint8)  # 1 .. 15
    return stored[:, 0::2] | (stored[:, 1::2] << 4), scales


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight (out, in) that packed int4 values and their group scales stand for."""
    out_features, half = packed.shape
    q = torch.stack([packed & 0x0F, packed >> 4], dim=2).reshape(out_features, 2 * half).float() - 8  # (out, in)
    group_size = 2 * half // scales.shape[1]
    return (q.reshape(out_features, -1, group_size) * scales[..., None]).reshape(out_features, 2 * half)


def _check_int4_shape(in_features: int, group_size: int) -> None:
    if group_size < 2 or group_size % 2:
        raise ValueError(f"int4 group_size must be an even number of at least 2 (two values a byte), got {group_size}")
    if in_features % group_size:
        raise ValueError(f"int4 group_size {group_size} does not divide the layer's {in_features} input features; "
                         f"choose one that does (e.g. {_divisor(in_features)})")


def _divisor(n: int) -> int:
    """The largest even divisor of n up to 128 (a usable group size), or 2."""
    return max((g for g in range(2, min(n, 128) + 1, 2) if n % g == 0), default=2)


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is stored as int8 or packed int4 with float scales (no gradients)."""

    def __init__(self, linear: nn.Linear, scheme: str, group_size: int = 64):
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"unknown quantization scheme {scheme!r}; expected one of {sorted(SCHEMES)}")
        self.in_features, self.out_features, self.scheme = linear.in_features, linear.out_features, scheme
        self.group_size = group_size if scheme == "int4" else None
        q, scales = quantize_int8(linear.weight) if scheme == "int8" else quantize_int4(linear.weight, group_size)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized float32 weight (out, in): what the layer multiplies by."""
        if self.scheme == "int8":
            return dequantize_int8(self.qweight, self.scales)
        return dequantize_int4(self.qweight, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme}{group}"


def quantize(model: nn.Module, scheme: str, group_size: int = 64) -> nn.Module:
    """A copy of ``model`` whose blocks' linear layers are ``QuantizedLinear``; the original is untouched.

    Embeddings, norms and the output head (tied to the embedding in the course's models) stay as
    they are. For int4, group_size must divide every such layer's input features.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; expected one of {sorted(SCHEMES)}")
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError(f"expected a model with .blocks (a GPT), got {type(model).__name__}")
    linears = [(name, module) for name, module in blocks.named_modules() if type(module) is nn.Linear]
    if scheme == "int4":
        for name, module in linears:  # every layer checked before anything is built
            try:
                _check_int4_shape(module.in_features, group_size)
            except ValueError as err:
                raise ValueError(f"blocks.{name}: {err}") from None
    quantized = copy.deepcopy(model)
    for name, _ in linears:
        parent_name, _, child = name.rpartition(".")
        parent = quantized.blocks.get_submodule(parent_name)
        setattr(parent, child, QuantizedLinear(getattr(parent, child), scheme, group_size))
    return quantized.eval()
