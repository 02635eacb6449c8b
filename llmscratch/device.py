"""Where a model runs and in which precision: device names, dtype names, autocast, and which CPU it is.

Every script and module that takes ``--device`` or ``--dtype`` resolves it here.
"""

import contextlib
import os
from pathlib import Path

import torch

__all__ = ["DTYPES", "autocast", "available_memory", "choose_dtype", "cpu_has_amx", "cpu_model", "resolve_device"]

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


def available_memory(device: torch.device | str) -> int | None:
    """Bytes that new tensors on ``device`` can take now, or None where this is unknown.

    CUDA: the GPU's free memory. CPU: Linux's MemAvailable (what can be had without swapping), within a
    container's memory limit where one is set; elsewhere the free pages the system reports.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    free = _meminfo_available()
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):  # not a system that says (macOS has no SC_AVPHYS_PAGES)
            return None
    limit = _cgroup_room()
    return free if limit is None else min(free, limit)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def machine_memory() -> int | None:
    """Bytes of memory this machine has (less where a container's limit is lower), or None where unknown."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return None
    limit = _cgroup_memory()
    return total if limit is None else min(total, limit[0])


def _cgroup_room() -> int | None:
    """A container's memory limit less what it uses, or None where no limit is set."""
    limit = _cgroup_memory()
    return None if limit is None else max(0, limit[0] - limit[1])


def _cgroup_memory() -> tuple[int, int] | None:
    """A container's memory (limit, usage) in bytes (cgroup v2, else v1), or None where no limit is set."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            return int(Path(limit_file).read_text().strip()), int(Path(usage_file).read_text())
        except (OSError, ValueError):  # no such file, or "max": no limit here
            continue
    return None
