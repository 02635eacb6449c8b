"""Check an answers file in a worker process, so that no answer can hang the checker, end it, or pass unchecked.

The command line (``python -m llmscratch.exercises``) never runs the reader's code itself. A
worker process imports the chapter's checkers and references first, then loads the answers, then
checks one exercise after another and sends each verdict back over a pipe (the reader's prints go
to the terminal, never into the pipe). Loading and each exercise get ``time_limit`` seconds: a
worker past it is killed, a worker that ends (``os._exit``, a crash) is noted, the exercise under
way fails saying which, and a fresh worker goes on with the rest. A worker whose checker is
killed outright ends itself, so that no endless answer outlives it.
"""

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from llmscratch.exercises import chapter
from llmscratch.exercises.checking import Verdict, load_answers
from llmscratch.exercises.isolation import too_slow

__all__ = ["Outcome", "check_answers"]

STARTUP_LIMIT = 300.0  # seconds for a worker to import torch and the chapter


@dataclass(frozen=True)
class Outcome:
    verdicts: list[Verdict]  # one per exercise, in the chapter's order
    defined: list[str]  # the names the answers file defines
    load_error: str = ""  # why the answers file does not load, if it does not ("does not run: ...")


def check_answers(chapter_name: str, path: Path, time_limit: float, seed: int | None = None) -> Outcome:
    """A verdict on each of the chapter's exercises for the answers in ``path``, each checked in a worker.

    seed: the seed of every check's fresh cases (None: a new one for each, which a failure prints).
    """
    worker = _Worker(chapter_name, path, seed, done=[])  # it starts while this process imports the chapter too
    exercises = chapter(chapter_name)
    verdicts: dict[str, Verdict] = {}
    while True:
        with worker:
            worker.wait_until_ready()
            loaded = worker.receive(time_limit)
            if loaded[0] != "loaded":
                verdicts |= {name: Verdict(exercise, "failed") for name, exercise in exercises.exercises.items()
                             if name not in verdicts}
                return Outcome([verdicts[name] for name in exercises.exercises], [],
                               f"does not run: {_load_error(loaded, time_limit)}")
            for name in [name for name in exercises.exercises if name not in verdicts]:
                message = worker.receive(time_limit)
                exercise = exercises.exercises[name]
                if message[0] != "verdict":
                    verdicts[name] = Verdict(exercise, "failed", f"  {_cut_short(message, time_limit)}")
                    break  # this worker is dead or killed: a fresh one takes the rest
                verdicts[name] = Verdict(exercise, *message[2:])
        if len(verdicts) == len(exercises.exercises):
            return Outcome([verdicts[name] for name in exercises.exercises], loaded[1])
        worker = _Worker(chapter_name, path, seed, done=list(verdicts))


class _Worker:
    """A worker process checking a chapter's exercises but those ``done``, and the pipe its messages come by."""

    def __init__(self, chapter_name: str, path: Path, seed: int | None, done: list[str]):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no state of ours for the answers to see
        self.inbox, outbox = context.Pipe(duplex=False)
        self.process = context.Process(target=_work, args=(chapter_name, str(path), seed, done, outbox,
                                                                    os.getpid()))
        self.process.start()
        outbox.close()  # the worker holds the only other end, so its death closes the pipe

    def wait_until_ready(self) -> None:
        """Wait for the worker to import torch and the chapter: the machine's time, not the answers'."""
        started = self.receive(STARTUP_LIMIT)
        if started[0] == "timeout":
            raise RuntimeError(f"the checking process did not start within {STARTUP_LIMIT:g} s")
        if started[0] != "ready":
            raise RuntimeError(f"the checking process did not start ({_how_it_ended(started[1])}; its error is above)")

    def receive(self, limit: float) -> tuple:
        """The worker's next message; ("timeout",) after ``limit`` seconds (it is killed); ("ended", exit code)."""
        if not self.inbox.poll(limit):
            self.process.kill()  # past its limit, nothing more will come from it
            return ("timeout",)
        try:
            return self.inbox.recv()
        except EOFError:
            self.process.join(timeout=5)
            return ("ended", self.process.exitcode)

    def __enter__(self) -> "_Worker":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if error_type is not None:  # Ctrl-C, say: no waiting for the worker
            self.process.kill()
        self.process.join(timeout=5)  # time to end as a program does: flush the answers' prints, run atexit hooks
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if hasattr(os, "killpg"):  # and whatever processes the answers started (the worker leads their group)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.inbox.close()


def _work(chapter_name: str, path: str, seed: int | None, done: list[str], outbox, parent: int) -> None:
    """The worker: the chapter's references first, then the answers, then each exercise's verdict into ``outbox``."""
    if hasattr(os, "setpgrp"):
        os.setpgrp()  # a process group of its own, which the checker ends with everything the answers started
    threading.Thread(target=_end_with, args=(parent,), daemon=True).start()
    exercises = chapter(chapter_name)  # imported (and remembered as loaded) before any answer runs
    outbox.send(("ready",))
    try:
        module = load_answers(path)
    except SystemExit as exit:
        outbox.send(("unloadable", f"it called sys.exit({exit.code!r}) while loading"))
        return
    except Exception as err:
        outbox.send(("unloadable", f"{type(err).__name__}: {err}"))
        return
    outbox.send(("loaded", sorted(vars(module))))
    for name in [name for name in exercises.exercises if name not in done]:
        verdict = exercises.check(getattr(module, name, None), name, quiet=True, time_limit=None,  # we kill instead
                                  seed=seed)
        sys.stdout.flush()  # the answer's prints out before its verdict, in case this process is killed later
        sys.stderr.flush()
        outbox.send(("verdict", name, verdict.status, verdict.detail))


def _end_with(parent: int) -> None:
    """End this worker once its parent is gone (killed outright, say), so that no endless answer outlives the checker."""
    while os.getppid() == parent:
        time.sleep(1)
    if hasattr(os, "killpg"):
        os.killpg(0, signal.SIGKILL)  # this worker's group: it and whatever the answers started
    os._exit(1)


def _load_error(message: tuple, time_limit: float) -> str:
    if message[0] == "unloadable":
        return message[1]
    if message[0] == "timeout":
        return f"it did not finish loading within {time_limit:g} s (an endless loop at its top level?)"
    return f"it ended the checking process while loading ({_how_it_ended(message[1])})"


def _cut_short(message: tuple, time_limit: float) -> str:
    """Why no verdict came: the time ran out, or the process ended."""
    if message[0] == "timeout":
        return too_slow(time_limit)
    return f"your answer ended the checking process ({_how_it_ended(message[1])})"


def _how_it_ended(exit_code: int | None) -> str:
    if exit_code is None:
        return "it closed the checker's pipe and went on"
    if exit_code >= 0:
        return f"exit status {exit_code}" + (", as os._exit(0) gives" if exit_code == 0 else "; any error is above")
    name = signal.Signals(-exit_code).name
    return f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else " (a crash?)")
