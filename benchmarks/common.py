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
