"""Serving benchmark: continuous batching through the OpenAI-compatible server, 1, 4 and 16 clients at once.

    python -m benchmarks.bench_serve                       # both models; prints a Markdown section
    python -m benchmarks.bench_serve --models base --rounds 5
    python -m benchmarks serve                             # the same, and RESULTS.md's section replaced

The server (``llmscratch.deployment.server.create_app`` over an ``llmscratch.deployment.engine.Engine`` of 16 slots,
uvicorn, 127.0.0.1 only) runs in a subprocess of its own, started here for each model and killed
at the end, so that the clients' Python never shares its interpreter lock. The clients are
asyncio tasks in this process, on httpx, each streaming ``POST /v1/completions``
(``stream: true``, ``temperature: 0``, a fixed ``max_tokens``) and timing every server-sent chunk
as it arrives: time to first token (TTFT) is the request's send to its first chunk of text; the
per-token latency is the gap between one chunk of text and the next (one token each, unless a
token ends inside a UTF-8 character). With c clients, each sends its requests back to back, so c
are in flight at any moment; aggregate tokens/s is every completion token over the wall time.

Models: ``base``, the bundled model (llmscratch/assets/moby_llama_mini.safetensors, float32),
and ``gpt2-small``, GPT-2's shape (124M parameters, learned positions, the 50,257-token GPT-2
tokenizer of ``BPETokenizer.gpt2()``) with random weights seeded alike in the server and here,
a model whose decode step reads its 0.5 GB of weights from memory.

In the same rounds, in this process while the server is idle, with the server's torch threads:
``llmscratch.model.generate.generate`` alone (batch 1, KV cache, eager, greedy) on the one client's
prompts and token counts, the baseline of the server's single stream (target: at least 90% of
it); and the same engine driven directly (``Engine.submit``, no HTTP), 1 and 16 streams, which
says how much of the gap between them is the HTTP/SSE layer and how much the engine's step.
CPU seconds of the server process and of this one over each measurement say who was busy.
"""

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import torch

from benchmarks.common import add_threads_flag, load_average, machine_description, median, set_threads, today
from llmscratch.deployment.engine import BATCH_SHAPES

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = (1, 4, 16)
SLOTS = 16  # the engine's rows: the most clients measured
MODELS = {  # name: default new tokens a request and requests a client makes per round
    "base": dict(max_tokens=64, requests=4),
    "gpt2-small": dict(max_tokens=32, requests=1),
}
PROMPTS = (  # Moby-Dick-ish openings; neither model reaches end-of-text within max_tokens from them (checked)
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse,",
    "The whale rose slowly out of the deep, and the men in the boats",
    "Captain Ahab stood upon the quarter-deck, and looking out over the sea, he said",
    "It was a clear steel-blue day. The firmaments of air and sea were hardly separable",
)
START_TIMEOUT = 300.0  # seconds for the server to answer /health (building gpt2-small on a busy machine)
REQUEST_TIMEOUT = 600.0


# --------------------------------------------------------------------------- the models
def build(name: str):
    """(model in eval mode, float32; tokenizer) for a name of MODELS."""
    if name == "base":
        from llmscratch.cli import DEFAULT_MODELS
        from llmscratch.model.weights import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(DEFAULT_MODELS["base"][0])
        return model.float().eval(), tokenizer
    from llmscratch.model.config import GPTConfig
    from llmscratch.model.gpt import GPT
    from llmscratch.text.tokenizer import BPETokenizer

    torch.manual_seed(0)  # the same random weights in the server and in this process
    return GPT(GPTConfig.from_preset("gpt2-small")).eval(), BPETokenizer.gpt2()


def serve(name: str, port: int, batch_shape: str) -> None:
    """The hidden --serve mode: the server of one model on 127.0.0.1:port until killed."""
    import uvicorn

    from llmscratch.deployment.engine import Engine
    from llmscratch.deployment.server import create_app

    parent = os.getppid()

    def orphaned() -> None:  # the benchmark was killed without its finally: do not outlive it
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=orphaned, name="bench-serve-watchdog", daemon=True).start()
    model, tokenizer = build(name)
    engine = Engine(model, tokenizer, max_slots=SLOTS, max_waiting=4 * SLOTS, batch_shape=batch_shape)
    app = create_app(engine, model_name=name)
    print(f"bench_serve: serving {name} on 127.0.0.1:{port} (torch threads {torch.get_num_threads()})",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(process: subprocess.Popen, url: str, name: str, timeout: float) -> None:
    """Return once url's /health answers 200; RuntimeError if the process ends first, TimeoutError past timeout s."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited while starting (status {process.returncode}; its messages are above)")
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not answer /health within {timeout:.0f} s")
        time.sleep(0.2)


class ServerProcess:
    """``python -m benchmarks.bench_serve --serve NAME`` in its own process group, up once /health answers."""

    def __init__(self, name: str, threads: int | None, batch_shape: str):
        self.name, self.threads, self.batch_shape = name, threads, batch_shape

    def __enter__(self) -> "ServerProcess":
        self.port = free_port()
        command = [sys.executable, "-m", "benchmarks.bench_serve", "--serve", self.name, "--port", str(self.port),
                   "--batch-shape", self.batch_shape]
        if self.threads is not None:
            command += ["--threads", str(self.threads)]
        # Its output goes to stderr: this process's stdout is the Markdown section.
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=sys.stderr, start_new_session=True,
                                        env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            self._wait_until_healthy()
        except BaseException:
            self._kill()
            raise
        self.ps = psutil.Process(self.process.pid)
        return self

    def _wait_until_healthy(self) -> None:
        wait_until_healthy(self.process, self.url, f"the {self.name} server", START_TIMEOUT)

    def cpu_seconds(self) -> float:
        times = self.ps.cpu_times()
        return times.user + times.system

    def _kill(self) -> None:
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
            try:
                os.killpg(self.process.pid, sig)  # its own group (start_new_session): only it and its children
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __exit__(self, *exc) -> None:
        self._kill()


# --------------------------------------------------------------------------- the clients
@dataclasses.dataclass
class Record:
    """One streamed request as the client saw it: send time, each chunk of text's arrival, the usage."""

    sent: float
    chunks: list[float]
    text: str
    completion_tokens: int
    finish_reason: str | None

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Record:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks, text, tokens, reason = [], [], 0, None
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{model}: /v1/completions answered {response.status_code}: "
                               f"{(await response.aread()).decode(errors='replace')}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                break
            event = json.loads(payload)
            if "error" in event:
                raise RuntimeError(f"{model}: the stream failed: {event['error']}")
            for choice in event.get("choices", ()):
                if choice.get("text"):
                    chunks.append(time.perf_counter())
                    text.append(choice["text"])
                reason = choice.get("finish_reason") or reason
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if not chunks:
        raise RuntimeError(f"{model}: a streamed request produced no text")
    return Record(sent, chunks, "".join(text), tokens, reason)


async def load(client: httpx.AsyncClient, model: str, clients: int, requests: int,
               max_tokens: int) -> tuple[float, list[Record]]:
    """clients tasks, each sending requests requests back to back: (wall seconds, every record)."""
    async def worker(index: int) -> list[Record]:
        return [await one_request(client, model, PROMPTS[(index + j) % len(PROMPTS)], max_tokens)
                for j in range(requests)]

    start = time.perf_counter()
    results = await asyncio.gather(*(worker(i) for i in range(clients)))
    return time.perf_counter() - start, [record for records in results for record in records]


# --------------------------------------------------------------------------- the same work without the server
def generate_alone(model, prompt_ids: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds to generate max_tokens greedily after each prompt in turn, batch 1; the new ids of each."""
    from llmscratch.model.generate import generate

    outputs = []
    start = time.perf_counter()
    for ids in prompt_ids:
        outputs.append(generate(model, torch.tensor([ids]), max_tokens)[0, len(ids):].tolist())
    return time.perf_counter() - start, outputs


def engine_direct(engine, prompt_ids: list[list[int]], clients: int, requests: int,
                  max_tokens: int) -> tuple[float, int]:
    """The load of ``load`` submitted straight to the engine (no HTTP): (wall seconds, completion tokens)."""
    from llmscratch.deployment.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens)
    done, lock = threading.Event(), threading.Lock()
    state = {"left": clients * requests, "tokens": 0, "error": None}

    def submit(worker: int, j: int) -> None:
        def emit(event) -> None:  # on the engine's thread
            if event.finish_reason is None:
                return
            with lock:
                state["tokens"] += event.completion_tokens
                state["left"] -= 1
                if event.finish_reason == "error":
                    state["error"] = event.error
            if j + 1 < requests:
                submit(worker, j + 1)
            if state["left"] == 0:
                done.set()

        engine.submit(prompt_ids[(worker + j) % len(prompt_ids)], params, emit)

    start = time.perf_counter()
    for worker in range(clients):
        submit(worker, 0)
    if not done.wait(REQUEST_TIMEOUT):
        raise TimeoutError("the engine did not finish its requests in time")
    if state["error"]:
        raise RuntimeError(f"the engine failed: {state['error']}")
    return time.perf_counter() - start, state["tokens"]


# --------------------------------------------------------------------------- one model
async def measure(name: str, args) -> dict:
    """Every measurement of one model, interleaved over args.rounds rounds."""
    from llmscratch.deployment.engine import Engine

    settings = MODELS[name]
    max_tokens, requests = args.max_tokens or settings["max_tokens"], args.requests or settings["requests"]
    model, tokenizer = build(name)
    prompt_ids = [tokenizer.encode(prompt, allowed_special="all") for prompt in PROMPTS]
    single_ids = [prompt_ids[j % len(PROMPTS)] for j in range(requests)]  # the one client's prompts, in its order
    rates = {key: [] for key in ("generate", "direct 1", "direct 16", *CONCURRENCY)}
    records = {c: [] for c in CONCURRENCY}
    cpu = {c: {"server": 0.0, "client": 0.0, "wall": 0.0} for c in CONCURRENCY}
    limits = httpx.Limits(max_connections=2 * SLOTS, max_keepalive_connections=2 * SLOTS)
    with (ServerProcess(name, args.threads, args.batch_shape) as server,
          Engine(model, tokenizer, max_slots=SLOTS, batch_shape=args.batch_shape) as engine):
        async with httpx.AsyncClient(base_url=server.url, timeout=REQUEST_TIMEOUT, limits=limits) as client:
            print(f"== {name}: warming up", file=sys.stderr, flush=True)
            _, alone_ids = generate_alone(model, prompt_ids, max_tokens)
            eos_early = [tokenizer.eot_token in ids for ids in alone_ids]
            engine_direct(engine, prompt_ids, SLOTS, 1, max_tokens)
            await load(client, name, 1, 1, max_tokens)
            await load(client, name, SLOTS, 1, max_tokens)  # every connection of the pool opened
            for round_index in range(args.rounds):
                print(f"== {name}: round {round_index + 1} of {args.rounds}", file=sys.stderr, flush=True)
                seconds, _ = generate_alone(model, single_ids, max_tokens)
                rates["generate"].append(requests * max_tokens / seconds)
                for clients in (1, SLOTS):
                    seconds, tokens = engine_direct(engine, prompt_ids, clients, requests, max_tokens)
                    rates[f"direct {clients}"].append(tokens / seconds)
                for clients in CONCURRENCY:
                    server_cpu, client_cpu = server.cpu_seconds(), time.process_time()
                    seconds, got = await load(client, name, clients, requests, max_tokens)
                    cpu[clients]["server"] += server.cpu_seconds() - server_cpu
                    cpu[clients]["client"] += time.process_time() - client_cpu
                    cpu[clients]["wall"] += seconds
                    rates[clients].append(sum(r.completion_tokens for r in got) / seconds)
                    records[clients] += got
            single_texts = [r.text for r in records[1][:requests]]
    alone_texts = [tokenizer.decode(ids) for ids in alone_ids]
    same_text = sum(text == alone_texts[j % len(PROMPTS)] for j, text in enumerate(single_texts))
    return dict(name=name, params=model.num_params(), max_tokens=max_tokens, requests=requests,
                prompt_tokens=[len(ids) for ids in prompt_ids], rates=rates, records=records, cpu=cpu,
                eos_early=sum(eos_early), same_text=same_text, compared=len(single_texts))


# --------------------------------------------------------------------------- the report
def spread(values: list[float], digits: int = 1) -> str:
    """Median, and the range over rounds when there are several."""
    text = f"{median(values):.{digits}f}"
    return text if len(values) == 1 else f"{text} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def ms(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q) * 1e3:.1f}" if values else "-"


def report(results: list[dict], args, elapsed: float) -> None:
    command = " ".join(["python -m benchmarks.bench_serve", *sys.argv[1:]])
    print(f"### Serving: continuous batching through the HTTP server ({today()})\n")
    print(f"Command: `{command}` ({elapsed / 60:.1f} minutes in all)  ")
    print(f"Machine: {machine_description()} (the server's torch threads; the server and the clients share "
          f"the machine); load average {load_average()} at the end  ")
    print(f"Server: `create_app` over `Engine(max_slots={SLOTS})` (batch shape \"{args.batch_shape}\"), "
          f"uvicorn on 127.0.0.1, "
          f"in a subprocess; clients: asyncio + httpx in the benchmark's process, streaming `/v1/completions` "
          f"(`temperature: 0`, `stream: true`). With c clients each sends its requests back to back. "
          f"Tokens/s: completion tokens over wall time, median of {args.rounds} interleaved rounds (range in "
          f"brackets); TTFT (send to first chunk of text) and per-token latency (gap between chunks of text) "
          f"pooled over all rounds' requests. CPU: the process's CPU seconds per wall second during the "
          f"measurement (2.0 = both cores busy).\n")
    for result in results:
        rates, records, cpu = result["rates"], result["records"], result["cpu"]
        kind = ("the bundled model, float32" if result["name"] == "base"
                else "GPT-2's shape, random weights, GPT-2 tokenizer")
        print(f"**{result['name']}** ({kind}; {result['params'] / 1e6:.1f}M parameters): prompts of "
              f"{min(result['prompt_tokens'])}-{max(result['prompt_tokens'])} tokens, {result['max_tokens']} new "
              f"tokens a request, {result['requests']} request{'s' if result['requests'] != 1 else ''} a client "
              f"a round.\n")
        print("| clients | requests | tokens/s | vs 1 client | TTFT p50 / p99 ms | per-token p50 / p99 ms | "
              "server CPU | client CPU |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for clients in CONCURRENCY:
            got = records[clients]
            ratios = [a / b for a, b in zip(rates[clients], rates[1])]
            gaps = [gap for record in got for gap in record.gaps]
            ttfts = [record.ttft for record in got]
            wall = cpu[clients]["wall"]
            versus = "1" if clients == 1 else f"{spread(ratios, 2)}x"
            print(f"| {clients} | {len(got)} | {spread(rates[clients])} | {versus} | "
                  f"{ms(ttfts, 50)} / {ms(ttfts, 99)} | {ms(gaps, 50)} / {ms(gaps, 99)} | "
                  f"{cpu[clients]['server'] / wall:.2f} | {cpu[clients]['client'] / wall:.2f} |")
        short = sum(r.completion_tokens < result["max_tokens"] for c in CONCURRENCY for r in records[c])
        single = [a / b for a, b in zip(rates[1], rates["generate"])]
        direct = [a / b for a, b in zip(rates["direct 16"], rates["direct 1"])]
        via_http = [a / b for a, b in zip(rates[SLOTS], rates["direct 16"])]
        speedup = [a / b for a, b in zip(rates[SLOTS], rates[1])]
        print(f"\n{SLOTS} clients against 1: **{spread(speedup, 2)}x** the tokens/s (target: at least 5x; "
              f"moonshot 10x).  ")
        print(f"Single stream: `generate` alone {spread(rates['generate'])} tokens/s, the server with one client "
              f"{spread(rates[1])}: **{spread(single, 2)}** of it (target: at least 0.90). Greedy texts of the one "
              f"client equal to `generate`'s: {result['same_text']} of {result['compared']}.  ")
        print(f"The engine without HTTP (`Engine.submit` in the benchmark's process, same load): 1 stream "
              f"{spread(rates['direct 1'])} tokens/s, {SLOTS} streams {spread(rates['direct 16'])} "
              f"({spread(direct, 2)}x); the server at {SLOTS} clients reaches {spread(via_http, 2)} of the engine's "
              f"{SLOTS} streams.  ")
        ended = (f"{short} requests ended before {result['max_tokens']} tokens (tokens/s counts the tokens made)"
                 if short else f"every request made its {result['max_tokens']} tokens")
        print(f"{ended}; `generate` met end-of-text on {result['eos_early']} of {len(PROMPTS)} prompts.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                        help=f"models to serve, one after the other (default: {' '.join(MODELS)})")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians over them (default 3)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="new tokens a request (default: " + ", ".join(
                            f"{name} {s['max_tokens']}" for name, s in MODELS.items()) + ")")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests each client sends a round (default: " + ", ".join(
                            f"{name} {s['requests']}" for name, s in MODELS.items()) + ")")
    parser.add_argument("--batch-shape", choices=BATCH_SHAPES, default="occupied",
                        help="the engine's batch shape (llmscratch.deployment.engine.Engine; default occupied)")
    parser.add_argument("--serve", choices=list(MODELS), default=None, help=argparse.SUPPRESS)  # the server's side
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    add_threads_flag(parser)
    args = parser.parse_args()
    set_threads(parser, args.threads)
    if args.serve is not None:
        if args.port is None:
            parser.error("--serve needs --port")
        serve(args.serve, args.port, args.batch_shape)
        return
    for flag, value in (("--rounds", args.rounds), ("--max-tokens", args.max_tokens),
                        ("--requests", args.requests)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    start = time.perf_counter()
    results = [asyncio.run(measure(name, args)) for name in args.models]
    report(results, args, time.perf_counter() - start)


if __name__ == "__main__":
    main()
