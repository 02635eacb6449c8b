"""Measuring what a step costs in time and memory, for the benchmarks and the chapters' bench scripts."""

import contextlib
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from llmscratch.device import cpu_model, resolve_device


def time_once(fn: Callable[[], object], device: str | torch.device | None = None) -> float:
    """Wall-clock seconds of one call of ``fn``; on a CUDA ``device``, its queued work included."""
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)  # work queued before the call is not the call's
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)  # kernels launched by the call run after it returns
    return time.perf_counter() - start


def round_robin(candidates: dict[str, Callable[[], float]], rounds: int,
                description: str | None = None) -> dict[str, list[float]]:
    """Each candidate once per round, ``rounds`` rounds, so that a slow spell of a shared machine hits all alike.

    Each candidate returns what it measured (seconds, or a rate); returns each one's list, a value a round.
    ``description``: a progress bar over the rounds, with that label.
    """
    each_round = range(rounds)
    if description is not None:
        from tqdm.auto import tqdm  # imported here: the package imports without it

        each_round = tqdm(each_round, desc=description, leave=False)
    results = {name: [] for name in candidates}
    for _ in each_round:
        for name, measure in candidates.items():
            results[name].append(measure())
    return results


def time_steps(steps: dict[str, Callable[[], object]], rounds: int, warmup: int = 1,
               device: str | torch.device | None = None) -> dict[str, tuple[float, float]]:
    """Each step's (seconds of its first call, compilation included; median seconds of ``rounds`` later calls).

    Each step runs ``warmup`` times first, the first of them timed; the timed rounds go round robin.
    """
    first = {}
    for name, step in steps.items():
        first[name] = time_once(step, device)
        for _ in range(warmup - 1):
            step()
    timings = round_robin({name: lambda step=step: time_once(step, device) for name, step in steps.items()}, rounds)
    return {name: (first[name], statistics.median(timings[name])) for name in steps}


def backward_step(module: torch.nn.Module, inputs: tuple, grad_out: torch.Tensor) -> Callable[[], None]:
    """One training-like step of ``module(*inputs)``: forward, backward of ``grad_out``, then the gradients
    dropped (the module's and the inputs'), so that every step starts alike."""

    def step():
        module(*inputs).backward(grad_out)
        module.zero_grad(set_to_none=True)
        for tensor in inputs:
            if isinstance(tensor, torch.Tensor):
                tensor.grad = None

    return step


def device_description(device: str | torch.device) -> str:
    """torch's version and the device: the GPU's name, or the CPU's model and torch's threads."""
    device = torch.device(device)
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{cpu_model()}, {torch.get_num_threads()} threads"
    return f"torch {torch.__version__} on {device.type} ({where})"


def failed_allocation(error: BaseException) -> str | None:
    """None unless ``error`` is a failed allocation (CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError);
    then the size it asked for as its message writes it ("1024 bytes", "2.00 GiB"), or "" if it names none."""
    if not isinstance(error, torch.OutOfMemoryError) and "can't allocate memory" not in str(error):
        return None
    asked = re.search(r"allocate (\d+ bytes|[\d.]+ [KMGT]iB)", str(error))
    return asked[1] if asked else ""


def sdpa_kernels(fn: Callable[[], object]) -> list[str]:
    """The names of the kernels scaled_dot_product_attention dispatched to during one call of ``fn`` (no grad)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")})


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

    device = resolve_device() if device is None else torch.device(device)
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
