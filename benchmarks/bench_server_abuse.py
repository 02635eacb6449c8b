"""The server under abuse: does /health keep answering, and does memory stay bounded?

    python -m benchmarks.bench_server_abuse                 # 20 s of abuse; prints a Markdown section
    python -m benchmarks.bench_server_abuse --seconds 60 --connections 300
    python -m benchmarks server_abuse                       # the same, and RESULTS.md's section replaced

The server (``llmscratch.deployment.server``: ``create_app`` over the bundled model and ``make_server``, as
``ch07-deployment/serve.py`` runs it, default limits, 127.0.0.1 only) runs in a subprocess of its own, with a
Hugging Face-style chat template (``chat_template.jinja``, read by ``ChatTemplate.from_hf``) whose nested
loops never end. Then, all at once for ``--seconds``: ``--connections`` connections that send half a request
line and wait (reopened when the server closes them); clients sending 200 MB bodies, one announced by its
Content-Length and one chunked; clients asking for chat completions, which the hostile template renders; and
a client polling ``GET /health`` every 100 ms. Reported: the slowest /health answer (and its p99, and any that
failed), the peak RSS of the server and its template workers (sampled every 50 ms), and what each kind of abuse
got back.
"""

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from benchmarks.common import add_threads_flag, load_average, machine_description, set_threads, today

ROOT = Path(__file__).resolve().parent.parent
HOSTILE_TEMPLATE = ("{% for a in range(99999) %}{% for b in range(99999) %}{% for c in range(99999) %}x"
                    "{% endfor %}{% endfor %}{% endfor %}")
BIG_BODY = 200 * 2**20
START_TIMEOUT = 120.0


def serve(port: int) -> None:
    """The hidden --serve mode: the bundled model behind the hostile template, on 127.0.0.1:port until killed."""
    from llmscratch.cli import DEFAULT_MODELS
    from llmscratch.deployment.engine import Engine
    from llmscratch.deployment.guard import make_server
    from llmscratch.deployment.server import create_app
    from llmscratch.model.weights import load_model_and_tokenizer
    from llmscratch.text.chat_template import ChatTemplate

    parent = os.getppid()

    def orphaned() -> None:  # the benchmark was killed without its finally: do not outlive it
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODELS["base"][0])
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "chat_template.jinja").write_text(HOSTILE_TEMPLATE, encoding="utf-8")
        template = ChatTemplate.from_hf(folder, tokenizer)
    app = create_app(Engine(model.float().eval(), tokenizer, max_slots=4), model_name="base", chat_template=template)
    make_server(app, "127.0.0.1", port).run()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Abuse:
    """The clients, each a thread, until ``stop`` is set; what they got back is counted in ``outcomes``."""

    def __init__(self, url: str, port: int):
        self.url, self.port = url, port
        self.stop = threading.Event()
        self.outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.health: list[float] = []
        self.lock = threading.Lock()

    def count(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.outcomes[kind][outcome] += 1

    def half_sent(self, connections: int) -> None:
        socks = []
        while not self.stop.is_set():
            while len(socks) < connections:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
                sock.setblocking(False)
                socks.append(sock)
                self.count("half-sent connections", "opened")
            for sock in list(socks):  # one the server closed reads as b"": open another in its place
                try:
                    if sock.recv(1) == b"":
                        socks.remove(sock)
                        sock.close()
                        self.count("half-sent connections", "closed by the server")
                except BlockingIOError:
                    pass
            self.stop.wait(0.2)
        for sock in socks:
            sock.close()

    def big_body(self, chunked: bool) -> None:
        kind = "200 MB bodies, chunked" if chunked else "200 MB bodies, Content-Length"
        piece = b" " * 2**20

        def body():
            for _ in range(BIG_BODY // len(piece)):
                yield piece
        while not self.stop.is_set():
            headers = {"Content-Type": "application/json"} | ({} if chunked else {"Content-Length": str(BIG_BODY)})
            try:
                response = httpx.post(f"{self.url}/v1/completions", content=body(), headers=headers, timeout=30)
                self.count(kind, str(response.status_code))
            except httpx.HTTPError as err:  # the server closed the connection after its 413, mid-upload
                self.count(kind, type(err).__name__)

    def hostile_chat(self) -> None:
        body = {"model": "base", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        while not self.stop.is_set():
            try:
                response = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=30)
                self.count("hostile-template chats", str(response.status_code))
            except httpx.HTTPError as err:
                self.count("hostile-template chats", type(err).__name__)

    def poll_health(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                started = time.perf_counter()
                try:
                    ok = client.get(f"{self.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.health.append(time.perf_counter() - started)
                self.count("/health", "200" if ok else "failed")
                self.stop.wait(0.1)


def measure(seconds: float, connections: int, threads: int | None) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "benchmarks.bench_server_abuse", "--serve", str(port)]
    if threads is not None:
        command += ["--threads", str(threads)]
    server = subprocess.Popen(command, cwd=ROOT, start_new_session=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit("error: the server under abuse did not start")
            time.sleep(0.2)
        process = psutil.Process(server.pid)
        rss_start = total_rss(process)
        abuse = Abuse(url, port)
        clients = [threading.Thread(target=abuse.half_sent, args=(connections,)), threading.Thread(
                   target=abuse.big_body, args=(False,)), threading.Thread(target=abuse.big_body, args=(True,)),
                   *[threading.Thread(target=abuse.hostile_chat) for _ in range(4)],
                   threading.Thread(target=abuse.poll_health)]
        for client in clients:
            client.daemon = True
            client.start()
        peak = rss_start
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            peak = max(peak, total_rss(process))
            time.sleep(0.05)
        abuse.stop.set()
        for client in clients:
            client.join(60)
        return {"health": abuse.health, "rss_start": rss_start, "rss_peak": peak, "outcomes": abuse.outcomes}
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def total_rss(process: psutil.Process) -> int:
    """The resident bytes of the server and its children (the chat template's worker processes)."""
    total = 0
    for each in [process, *process.children(recursive=True)]:
        try:
            total += each.memory_info().rss
        except psutil.NoSuchProcess:  # a worker killed at its deadline meanwhile
            pass
    return total


def report(result: dict, seconds: float, connections: int) -> str:
    health = np.array(result["health"])
    failed = result["outcomes"]["/health"]["failed"]
    lines = [f"## The server under abuse ({today()})", "",
             f"Machine: {machine_description()}; load average {load_average()}.", "",
             (f"For {seconds:g} s at once: {connections} half-sent connections, 200 MB bodies (by Content-Length "
              f"and chunked), 4 clients chatting through a chat template whose nested loops never end, and "
              f"`/health` polled every 100 ms (`python -m benchmarks.bench_server_abuse`)."), "",
             "| measure | value |", "|---|---|",
             f"| /health answers (failed) | {len(health)} ({failed}) |",
             f"| slowest /health answer | {health.max() * 1000:.0f} ms |",
             (f"| /health p99 / median | {np.percentile(health, 99) * 1000:.0f} ms / "
              f"{np.median(health) * 1000:.1f} ms |"),
             (f"| server RSS (with its template workers) at start / peak | {result['rss_start'] / 2**20:.0f} MiB / "
              f"{result['rss_peak'] / 2**20:.0f} MiB |"), "",
             "| abuse | what it got back |", "|---|---|"]
    for kind, outcomes in result["outcomes"].items():
        if kind != "/health":
            lines.append(f"| {kind} | {', '.join(f'{name}: {n}' for name, n in outcomes.most_common())} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the abuse lasts (default 20)")
    parser.add_argument("--connections", type=int, default=200, help="half-sent connections held (default 200)")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    add_threads_flag(parser)
    args = parser.parse_args()
    set_threads(parser, args.threads)
    if args.serve is not None:
        serve(args.serve)
        return
    if not args.seconds > 0 or args.connections < 1:
        parser.error(f"--seconds must be more than 0 and --connections at least 1, got {args.seconds} and "
                     f"{args.connections}")
    print(report(measure(args.seconds, args.connections, args.threads), args.seconds, args.connections))


if __name__ == "__main__":
    main()
