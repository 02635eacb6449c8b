"""Shared helpers for the benchmarks: what machine this is, and robust timing."""

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable

from llmscratch.flops import cpu_model


def machine_description() -> str:
    """CPU model, core count, Python and torch versions, in one line."""
    cpu = cpu_model()
    try:
        import torch

        torch_version = torch.__version__
        threads = torch.get_num_threads()
    except ImportError:
        torch_version, threads = "absent", "?"
    return (f"{cpu}, {os.cpu_count()} cores (torch threads {threads}), "
            f"Python {platform.python_version()}, torch {torch_version}")


def today() -> str:
    return datetime.date.today().isoformat()


def time_once(fn: Callable[[], object]) -> float:
    """Wall-clock seconds of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved_medians(candidates: dict[str, Callable[[], float]], runs: int) -> dict[str, list[float]]:
    """Run each candidate once per round, ``runs`` rounds, so machine noise hits all alike.

    Each candidate returns the seconds it measured; returns every candidate's list of runs.
    """
    results = {name: [] for name in candidates}
    for _ in range(runs):
        for name, run in candidates.items():
            results[name].append(run())
    return results


def median(values: list[float]) -> float:
    return statistics.median(values)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as `uptime` shows them ("unknown" where not available)."""
    try:
        return ", ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "unknown"


def peak_memory_bytes(step: Callable[[], object]) -> int:
    """Peak bytes PyTorch's allocator held during one call of step, above what it held before.

    CUDA keeps this statistic itself; on CPU, the allocation and free events the profiler records
    are replayed (PyTorch tensors only, not Python objects or the allocator's own caching).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()  # negative for a free
        peak = max(peak, held)
    return peak
