"""Where a model runs and in which precision: device names, dtype names, autocast, and which CPU it is.

Every script and module that takes ``--device`` or ``--dtype`` resolves it here.
"""

import contextlib
import os
from pathlib import Path

import torch

__all__ = ["DTYPES", "autocast", "choose_dtype", "cpu_has_amx", "cpu_model", "resolve_device"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' is CUDA when available, else CPU; anything else must exist on this machine."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device {name!r} is not a device name; expected auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} was asked for, but this torch sees no CUDA GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {name!r} was asked for, but MPS is not available here")
    elif device.type != "cpu":
        raise ValueError(f"device {name!r} is not supported; expected auto, cpu, cuda, cuda:N or mps")
    return device


def choose_dtype(device: torch.device) -> str:
    """The precision a run uses by default: bf16 on GPUs that have it, fp16 on older GPUs; on a CPU,
    bf16 where it has AMX matrix units, else fp32.

    Measured for ``benchmarks/RESULTS.md`` on 2-core machines: with AMX a training step of the
    main job under bfloat16 autocast takes about two thirds of its float32 time, ending at the same
    validation loss; without AMX (AVX-512 BF16 alone, or none) bfloat16 was slower than float32.
    """
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if device.type == "cpu" and cpu_has_amx():
        return "bfloat16"
    return "float32"


def cpu_has_amx(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> bool:
    """Whether this CPU has Intel's AMX units for bfloat16 matrix products (the ``amx_bf16`` flag of Linux's
    /proc/cpuinfo, Xeon 4th generation on), which oneDNN uses under bfloat16 autocast; False if unknown."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:  # not Linux, or no access: assume none
        return False
    return any(line.startswith("flags") and "amx_bf16" in line.split() for line in text.splitlines())


def autocast(device: torch.device | str, dtype: torch.dtype):
    """Mixed precision for the forward pass (CUDA or CPU); a no-op context in float32."""
    device = torch.device(device)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or 'unknown cpu' elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown cpu"
