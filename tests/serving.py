"""A server under test: a FastAPI app run by uvicorn in a thread, on 127.0.0.1 and a free port, with deadlines.

``running_server(app)`` yields the base URL ("http://127.0.0.1:PORT") once the server answers, and stops it
when the block ends; starting and stopping are bounded, so a server that hangs fails the test in seconds. The
server is ``llmscratch.deployment.guard.make_server``'s, as serve.py runs it (its keyword arguments pass on).
"""

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

from llmscratch.deployment.guard import make_server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(app, start_timeout: float = 30.0, stop_timeout: float = 30.0, **options) -> Iterator[str]:
    """``app`` served on loopback in a daemon thread for the block; yields its base URL."""
    port = free_port()
    server = make_server(app, "127.0.0.1", port, **options)
    thread = threading.Thread(target=server.run, name="uvicorn-under-test", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server under test exited while starting (see its log above)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"the server under test did not start within {start_timeout:.0f} s")
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(stop_timeout)
        if thread.is_alive():
            server.force_exit = True
            thread.join(5)
            raise TimeoutError(f"the server under test did not stop within {stop_timeout:.0f} s")

