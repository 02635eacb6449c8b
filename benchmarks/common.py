"""Shared helpers for the benchmarks: what machine this is, its threads, and the device a benchmark runs on.

Timing lives in the package (``llmscratch.profiling``: ``time_once``, ``round_robin``), where the
chapters' bench scripts use it too.
"""

import argparse
import datetime
import os
import platform
import statistics

import torch

from llmscratch.device import cpu_model, resolve_device

__all__ = ["add_threads_flag", "device_flag", "device_name", "load_average", "machine_description", "median",
           "set_threads", "today"]


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


def device_flag(parser: argparse.ArgumentParser, name: str) -> torch.device:
    """The --device a benchmark runs on, cpu or cuda[:N]; parser.error (exit 2) if it is not one here."""
    try:
        kind = torch.device(name).type
    except RuntimeError:  # not a device name at all
        kind = None
    if kind not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    try:
        return resolve_device(name)
    except ValueError as error:  # a GPU this machine does not have
        parser.error(f"--device: {error}")


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
