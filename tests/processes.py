"""Start worker processes with a hard deadline, so that a deadlock fails in minutes with a stack (not a test file)."""

import faulthandler
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp


def _guarded(rank: int, fn: Callable, args: tuple, timeout: float) -> None:
    # Past the deadline, print every thread's stack to stderr and exit: also when the hang comes
    # after fn returns (at interpreter exit), which is where the gloo teardown deadlock struck.
    faulthandler.dump_traceback_later(timeout, exit=True)
    fn(rank, *args)


def spawn(fn: Callable, args: tuple, nprocs: int, timeout: float) -> None:
    """``mp.spawn(fn, args, nprocs)``, but every process is killed after ``timeout`` seconds.

    A worker that raises makes this raise (torch's ProcessRaisedException, with its traceback);
    one that hangs dumps its stacks and exits non-zero, and this raises ProcessExitedException.
    """
    context = mp.start_processes(_guarded, args=(fn, args, timeout), nprocs=nprocs, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout + 30  # faulthandler's exit comes first; this is the backstop
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{nprocs} worker process(es) of {fn.__name__} still running after {timeout:.0f} s")


def run(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command, timeout=...)`` that also kills the command's children (torchrun's workers).

    The command gets a session of its own; on timeout the whole group is killed, so no orphan keeps
    a port, a file or a core, and the test fails with the output seen so far.
    """
    with subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            raise AssertionError(f"{command[:4]}... still running after {timeout:.0f} s and was killed:\n"
                                 f"{stdout[-4000:]}\n{stderr[-4000:]}") from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def torchrun(script: Path, args: list[str], timeout: float, nproc: int = 2) -> subprocess.CompletedProcess:
    """``script`` under torchrun on ``nproc`` local processes of one thread each (the same float sums in every
    run), with ``run``'s deadline: torchrun and all its workers are killed after ``timeout`` seconds."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
               *args]
    return run(command, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def start_until_lines(command: list[str], path: Path, lines: int, timeout: float, **kwargs) -> subprocess.Popen:
    """Start ``command`` and return it once ``path`` holds ``lines`` lines (or the command has ended).

    A hang is killed after ``timeout`` seconds and fails the test with its stderr; the caller ends the process.
    Its stdout is discarded unless ``kwargs`` say otherwise (``stdout=subprocess.PIPE``).
    """
    process = subprocess.Popen(command, **{"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "text": True,
                                           **kwargs})
    deadline = time.monotonic() + timeout
    while process.poll() is None and (not path.is_file() or path.read_text().count("\n") < lines):
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"no {lines} lines in {path.name} after {timeout:.0f} s: "
                                 f"{process.communicate()[1][-4000:]}")
        time.sleep(0.05)
    return process
