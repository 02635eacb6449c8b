"""Shared helpers for the benchmarks: what machine this is, and its threads.

Timing lives in the package (``llmscratch.profiling``: ``time_once``, ``round_robin``), where the
chapters' bench scripts use it too.
"""

import argparse
import datetime
import os
import platform
import statistics

import torch

from llmscratch.flops import cpu_model

__all__ = ["add_threads_flag", "load_average", "machine_description", "median", "set_threads", "today"]


def machine_description() -> str:
    """CPU model, core count, Python and torch versions, in one line."""
    return (f"{cpu_model()}, {os.cpu_count()} cores (torch threads {torch.get_num_threads()}), "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def today() -> str:
    return datetime.date.today().isoformat()


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")


def set_threads(parser: argparse.ArgumentParser, threads: int | None) -> None:
    """Give torch ``threads`` CPU threads (None: its own choice); parser.error if that is not a positive count."""
    if threads is not None:
        if threads < 1:
            parser.error(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)


def median(values: list[float]) -> float:
    return statistics.median(values)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as `uptime` shows them ("unknown" where not available)."""
    try:
        return ", ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "unknown"
