"""How a training loop ends early: cleanly on Ctrl-C or SIGTERM, or with ``TrainingDiverged`` when its loss does.

A loop reads ``stop_requested`` after each step; ``stop_on_signals`` sets it (through
``request_stop``) on the first signal, so the run can save what it has. A second signal
raises KeyboardInterrupt at once, for a reader who does not want to wait.
"""

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator


class StopRequest:
    """The flag a signal handler sets and a training loop reads (``Trainer`` has the same two members)."""

    def __init__(self):
        self.stop_requested = False

    def request_stop(self) -> None:
        self.stop_requested = True


def exit_status(target) -> int:
    """The exit status of a program that ``stop_on_signals`` stopped: 128 + the signal (130 Ctrl-C, 143 SIGTERM)."""
    return 128 + getattr(target, "stop_signal", signal.SIGINT)


@contextlib.contextmanager
def stop_on_signals(target, say: Callable[[str], None] = print, saving: str = "with a checkpoint") -> Iterator[None]:
    """Inside the block, Ctrl-C (SIGINT) or SIGTERM calls ``target.request_stop()``; a second one stops at once.

    The signal is noted as ``target.stop_signal`` (see ``exit_status``). saving: what stopping this
    way keeps, for the message (e.g. "with a checkpoint").
    """
    def handle(signum, frame):
        target.stop_signal = signum
        if target.stop_requested:
            raise KeyboardInterrupt
        target.request_stop()
        say(f"\n{signal.Signals(signum).name}: stopping at the end of the step under way, {saving} "
            f"(send it again to stop at once, without one)")

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class TrainingDiverged(RuntimeError):
    """The loss (or, outside float16, the gradient) became NaN or infinite; no update was made."""
