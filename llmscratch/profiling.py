"""Measuring what a step costs in memory, for the benchmarks and the chapters' bench scripts."""

import contextlib
import os
from collections.abc import Callable, Iterator

import torch


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2: the CPU profiler's C++ side logs two lines per use there."""
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_memory_bytes(step: Callable[[], object], device: str | torch.device | None = None) -> int:
    """Peak bytes PyTorch's allocator held during one call of ``step``, above what it held before.

    device: where ``step`` computes (default: CUDA when there is one, else the CPU). CUDA keeps
    this statistic itself; on CPU, the allocation and free events the profiler records are
    replayed (PyTorch tensors only, not Python objects or the allocator's own caching).
    """
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()  # negative for a free
        peak = max(peak, held)
    return peak
