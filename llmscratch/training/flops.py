"""Peak FLOP/s of the machine, for model FLOPs utilisation (MFU) = achieved / peak.

On CUDA the peak comes from a table of datasheet figures (dense, no sparsity); on a CPU it
is a matrix-multiply ceiling measured on that machine, the best figure cached. Nothing assumes one GPU.
"""

import json
import os
import platform
import time
from pathlib import Path

import torch

from llmscratch.device import cpu_model
from llmscratch.files import write_text_atomically

# Dense datasheet peaks in TFLOP/s, by matmul precision. "fp32" is plain FP32; "tf32" is FP32
# inputs on tensor cores (used when torch allows TF32 matmuls).
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9},  # SXM
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
    "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "T4": {"fp16": 65.0, "fp32": 8.1},
}
_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def gpu_peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """Datasheet peak FLOP/s for a GPU name as CUDA reports it, or None if not in the table."""
    precision = _PRECISION[dtype]
    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        precision = "tf32"
    for name, peaks in GPU_PEAK_TFLOPS.items():  # first match wins: "H100 PCIe" before "H100", "L40S" before "L4"
        if name in device_name and precision in peaks:
            return peaks[precision] * 1e12
    return None


def measure_matmul_flops(dtype: torch.dtype, size: int = 1536, repeats: int = 5, max_seconds: float = 1.0,
                         device: str = "cpu") -> float:
    """FLOP/s of a (size x size) @ (size x size) product: the best of several timed runs.

    Stops early after ``max_seconds`` (a CPU without fast float16 would otherwise take minutes).
    """
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b  # warm-up: thread pools, kernel selection
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        if device != "cpu":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
        if spent > max_seconds:
            break
    return 2 * size**3 / best


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "llmscratch" / "peak_flops.json"


def cpu_peak_flops(dtype: torch.dtype) -> float:
    """This CPU's matmul ceiling for ``dtype``: the best measured so far, cached per CPU, torch and threads.

    A measurement taken while other programs use the cores comes out low (and the MFU too high),
    so each call measures again briefly and the cache keeps the best figure ever seen.
    """
    key = f"{platform.processor() or platform.machine()}|{cpu_model()}|torch {torch.__version__}|" \
          f"threads {torch.get_num_threads()}|{_PRECISION[dtype]}"
    path = _cache_file()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    measured = measure_matmul_flops(dtype)
    if measured > cache.get(key, 0.0):
        cache[key] = measured
        try:
            write_text_atomically(path, json.dumps(cache, indent=1))  # several processes may write at once
        except OSError:
            pass  # a read-only home: nothing is remembered, the figure of this run is used
    return cache[key]


def peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s per process: the override, the GPU table, or the measured CPU ceiling."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu":
        return cpu_peak_flops(dtype)
    return None
