"""Paged KV cache benchmark (issue 52's targets): real sizes in a budget, windows that forget, throughput,
chunked prefill, shared prefixes, and how attention reads the blocks.

    python -m benchmarks.bench_paged                          # every part; prints a Markdown section
    python -m benchmarks.bench_paged --parts window attention  # only these
    python -m benchmarks paged                                # the same, and RESULTS.md's section replaced

Parts (each a table; the load average is noted beside each, as the machine may be shared):
- ``real``: a Qwen3-0.6B-shaped Hugging Face folder (random weights, its 40,960-position config, GPT-2's
  tokenizer with ChatML's special tokens, a ChatML template) served by ch07-deployment/serve.py with
  ``--max-slots 16 --kv-memory 4``, answering 16 concurrent chat requests; the server's peak resident memory
  (VmHWM, children included) against the weights + the budget + 1.5 GB;
- ``window``: the Gemma 3 1B shape at 32k positions: the paged cache's bytes a sequence (sliding layers keep
  one window) against every layer full length (chapter 3 computes 6.0x);
- ``throughput``: the bundled base model through ``Engine`` (no HTTP): 16 streams against 1, and 1 stream
  against ``generate`` alone (bench_serve's own helpers, the same load);
- ``chunked``: 15 streams decode the gpt2-small shape while a prompt that fills its 1,024 positions arrives:
  the streams' p99 gap between tokens during its prefill against their median gap before it, per prefill_chunk;
- ``prefix``: 16 requests with a common 512-token prefix, time to first token with prefix sharing on and off,
  the prefix unseen (the 16 arrive at once) and already cached (one request with it answered first);
- ``attention``: one layer's attention over paged blocks, a gather into scaled_dot_product_attention (what
  ``llmscratch.model.paged`` does) against FlexAttention with a block mask compiled by torch.compile.
"""

import argparse
import asyncio
import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import torch

from benchmarks.common import add_threads_flag, load_average, machine_description, median, set_threads, today

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("real", "window", "throughput", "chunked", "prefix", "attention")
TIMEOUT = 600.0  # seconds any one wait may take before the benchmark fails instead of hanging
CHATML = """{%- for message in messages %}
{%- if loop.first and message.role != 'system' %}<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
<|im_start|>{{ message.role }}
{{ message.content | trim }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
QUESTIONS = ("Who is Ishmael?", "Why does Ahab hunt the whale?", "What is a harpoon?", "Where is Nantucket?")


def spread(values: list[float], digits: int = 1) -> str:
    """Median, and the range over runs when there are several."""
    text = f"{median(values):.{digits}f}"
    return text if len(values) == 1 else f"{text} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def gpt2_small():
    """GPT-2's shape (124M parameters, 1,024 positions) with random weights, and GPT-2's tokenizer."""
    from llmscratch.model.config import GPTConfig
    from llmscratch.model.gpt import GPT
    from llmscratch.text.tokenizer import BPETokenizer

    torch.manual_seed(0)
    return GPT(GPTConfig.from_preset("gpt2-small")).eval(), BPETokenizer.gpt2()


class Streams:
    """Requests submitted to an engine, each token's arrival time recorded; waits that fail after TIMEOUT."""

    def __init__(self, engine):
        self.engine = engine
        self.times: list[list[float]] = []
        self.sent: list[float] = []
        self.requests = []
        self.finished: list[threading.Event] = []

    def submit(self, prompt_ids: list[int], max_tokens: int) -> int:
        from llmscratch.deployment.engine import SamplingParams

        index = len(self.times)
        self.times.append([])
        self.finished.append(threading.Event())

        def emit(event) -> None:  # on the engine's thread
            if event.token_ids:
                self.times[index].append(time.perf_counter())
            if event.finish_reason is not None:
                if event.finish_reason == "error":
                    print(f"bench_paged: request {index} failed: {event.error}", file=sys.stderr, flush=True)
                self.finished[index].set()

        self.sent.append(time.perf_counter())
        self.requests.append(self.engine.submit(prompt_ids, SamplingParams(max_tokens=max_tokens), emit))
        return index

    def wait(self, indices, condition=None) -> None:
        """Until each request has finished (or meets condition(index)); TimeoutError past TIMEOUT."""
        deadline = time.monotonic() + TIMEOUT
        for i in indices:
            while not (self.finished[i].is_set() or (condition is not None and condition(i))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"request {i} did not get there within {TIMEOUT:.0f} s")
                time.sleep(0.002)

    def ttft(self, index: int) -> float:
        return self.times[index][0] - self.sent[index]


# --------------------------------------------------------------------------- real sizes
def qwen_folder(folder: Path) -> None:
    """A Qwen3-0.6B-shaped Hugging Face folder: random weights (float32), GPT-2's tokenizer with ChatML's tokens."""
    from llmscratch.model.config import GPTConfig
    from llmscratch.model.gpt import GPT
    from llmscratch.model.weights import save_hf
    from llmscratch.text.hf_export import save_tokenizer_hf
    from llmscratch.text.tokenizer import BPETokenizer

    gpt2 = BPETokenizer.gpt2()
    specials = {"<|endoftext|>": 50256, "<|im_start|>": 50257, "<|im_end|>": 50258}
    tokenizer = BPETokenizer(gpt2.merges, pattern=gpt2.pattern, special_tokens=specials,
                             byte_order=gpt2.byte_order, name="gpt2-chatml", eos_token="<|im_end|>")
    config = GPTConfig.from_preset("qwen3-0.6b")
    torch.manual_seed(0)
    save_hf(GPT(config).eval(), folder)
    save_tokenizer_hf(tokenizer, folder, chat_template=CHATML, model_max_length=config.context_length)


def peak_resident(pid: int) -> int:
    """VmHWM of a process and of its children, in bytes."""
    total = 0
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        status = Path(f"/proc/{process.pid}/status").read_text()
        total += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))
    return total


async def chat_round(url: str, clients: int, max_tokens: int) -> tuple[float, list[float], int]:
    """clients chat requests at once: (wall seconds, each one's seconds, completion tokens)."""
    async def one(client: httpx.AsyncClient, question: str) -> tuple[float, int]:
        start = time.perf_counter()
        body = {"model": "qwen", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                "temperature": 0}
        response = await client.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"/v1/chat/completions answered {response.status_code}: {response.text}")
        return time.perf_counter() - start, response.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=2 * clients)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, limits=limits) as client:
        start = time.perf_counter()
        done = await asyncio.gather(*(one(client, QUESTIONS[i % len(QUESTIONS)]) for i in range(clients)))
        return time.perf_counter() - start, [s for s, _ in done], sum(t for _, t in done)


def real(args) -> None:
    from benchmarks.bench_serve import free_port, wait_until_healthy

    budget = 4
    with tempfile.TemporaryDirectory(prefix="bench_paged_") as temporary:
        folder = Path(temporary) / "qwen3-0.6b-random"
        start = time.perf_counter()
        qwen_folder(folder)
        written = time.perf_counter() - start
        weights = (folder / "model.safetensors").stat().st_size
        port = free_port()
        command = [sys.executable, "ch07-deployment/serve.py", "--model", str(folder), "--name", "qwen",
                   "--port", str(port), "--max-slots", "16", "--kv-memory", str(budget), "--dtype", args.real_dtype]
        server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=sys.stderr, text=True,
                                  start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until_healthy(server, url, "serve.py", TIMEOUT)
            banner = server.stdout.readline().strip()  # "serving ... at http://...": printed before it listens
            rounds = [asyncio.run(chat_round(url, 16, args.real_tokens)) for _ in range(args.rounds)]
            peak = peak_resident(server.pid)
            metrics = httpx.get(f"{url}/metrics", timeout=30.0).text
        finally:
            os.killpg(server.pid, 15)
            server.wait(60)
    bound = weights + budget * 2 ** 30 + 1.5e9
    pool = [line for line in metrics.splitlines() if "cache" in line and not line.startswith("#")]
    print(f"#### Real sizes: a Qwen3-0.6B-shaped folder served with 16 slots in 4 GiB of cache "
          f"(load average {load_average()})\n")
    print(f"Server: `python ch07-deployment/serve.py --model FOLDER --max-slots 16 --kv-memory {budget} --dtype "
          f"{args.real_dtype}`; its banner: `{banner}`. The folder (random weights, float32 on disk, the 40,960-"
          f"position config) took {written:.0f} s to write. Each round: 16 chat requests at once "
          f"(`/v1/chat/completions`, max_tokens {args.real_tokens}, temperature 0).\n")
    print("| rounds | wall s a round | request s p50 / max | completion tokens a round | peak resident (VmHWM) | "
          "weights + budget + 1.5 GB | within |")
    print("|---:|---:|---:|---:|---:|---:|:---:|")
    walls = [wall for wall, _, _ in rounds]
    each = [s for _, seconds, _ in rounds for s in seconds]
    print(f"| {len(rounds)} | {spread(walls)} | {median(each):.1f} / {max(each):.1f} | "
          f"{median([t for _, _, t in rounds]):.0f} | {peak / 1e9:.2f} GB | {bound / 1e9:.2f} GB | "
          f"{'yes' if peak <= bound else '**no**'} |\n")
    if pool:
        print("The server's /metrics on the cache at the end: " + "; ".join(f"`{line}`" for line in pool) + "\n")


# --------------------------------------------------------------------------- windows that forget
def window(args) -> None:
    from llmscratch.deployment.engine import PREFILL_CHUNK, kv_cache_bytes
    from llmscratch.model.config import GPTConfig
    from llmscratch.model.gpt import GPT
    from llmscratch.model.paged import PagedKVCache

    config = GPTConfig.from_preset("gemma3-1b")
    with torch.device("meta"):  # shapes only: nothing allocated
        model = GPT(config).to(torch.bfloat16)
    length = config.context_length
    element = model.token_embedding.weight.element_size()
    full = length * config.n_layers * 2 * config.kv_heads * config.head_dim * element
    sliding = sum(kind == "sliding" for kind in config.attention_types)
    print(f"#### Windows that forget: the Gemma 3 1B shape at {length:,} positions (load average {load_average()})\n")
    print(f"{config.n_layers} layers ({sliding} sliding, window {config.sliding_window}; "
          f"{config.n_layers - sliding} full), {config.kv_heads} key/value head(s) of {config.head_dim}, "
          f"bfloat16. Full length: every layer keeps all {length:,} positions.\n")
    print("| count | bytes a sequence | full length / it |")
    print("|---|---:|---:|")
    print(f"| every layer full length | {full / 2 ** 20:,.1f} MiB | 1.00x |")
    rows = [(f"`PagedKVCache.bytes_for` (lookahead {lookahead})",
             PagedKVCache.bytes_for(model, 1, length, lookahead=lookahead)) for lookahead in (1, PREFILL_CHUNK)]
    rows.append((f"`engine.kv_cache_bytes` (prefill_chunk {PREFILL_CHUNK})", kv_cache_bytes(model, 1, length)))
    for name, paged in rows:
        print(f"| {name} | {paged / 2 ** 20:,.1f} MiB | **{full / paged:.2f}x** |")
    print("\nTarget: at least 5x. Lookahead is the most positions one step feeds: a window must keep that many "
          "more, so the engine's chunked prefill costs a little of the saving.\n")


# --------------------------------------------------------------------------- throughput
def throughput(args) -> None:
    from benchmarks.bench_serve import PROMPTS, build, engine_direct, generate_alone
    from llmscratch.deployment.engine import Engine

    max_tokens, requests = 64, 4
    model, tokenizer = build("base")
    prompt_ids = [tokenizer.encode(prompt, allowed_special="all") for prompt in PROMPTS]
    single = [prompt_ids[j % len(PROMPTS)] for j in range(requests)]
    rates = {"generate": [], 1: [], 16: []}
    with Engine(model, tokenizer, max_slots=16) as engine:
        generate_alone(model, prompt_ids, max_tokens)  # warm-up
        engine_direct(engine, prompt_ids, 16, 1, max_tokens)
        for _ in range(args.rounds):
            seconds, _ = generate_alone(model, single, max_tokens)
            rates["generate"].append(requests * max_tokens / seconds)
            for clients in (1, 16):
                seconds, tokens = engine_direct(engine, prompt_ids, clients, requests, max_tokens)
                rates[clients].append(tokens / seconds)
        description = engine.cache_description
    speedup = [a / b for a, b in zip(rates[16], rates[1])]
    single_share = [a / b for a, b in zip(rates[1], rates["generate"])]
    print(f"#### Throughput: the bundled base model through `Engine` (load average {load_average()})\n")
    print(f"{model.num_params() / 1e6:.1f}M parameters, float32; {description}. Each stream sends {requests} "
          f"requests of {max_tokens} new tokens back to back (greedy); `generate` alone: batch 1, the one stream's "
          f"prompts. Median of {args.rounds} interleaved rounds (range).\n")
    print("| | tokens/s | ratio | target |")
    print("|---|---:|---:|---:|")
    print(f"| `generate` alone | {spread(rates['generate'])} | | |")
    print(f"| engine, 1 stream | {spread(rates[1])} | {spread(single_share, 2)} of `generate` | 0.95 |")
    print(f"| engine, 16 streams | {spread(rates[16])} | {spread(speedup, 2)}x 1 stream | 6x |\n")


# --------------------------------------------------------------------------- chunked prefill
def chunked_once(model, tokenizer, chunk: int, long_prompt: list[int], stream_prompts: list[list[int]]) -> dict:
    """15 streams decoding, then a prompt that fills the context: their gaps before and during its prefill."""
    from llmscratch.deployment.engine import Engine

    context = model.config.context_length
    with Engine(model, tokenizer, max_slots=16, prefill_chunk=chunk) as engine:
        streams = Streams(engine)
        running = [streams.submit(ids, context - len(ids)) for ids in stream_prompts]
        streams.wait(running, lambda i: len(streams.times[i]) >= 12)
        arrived = time.perf_counter()
        long = streams.submit(long_prompt, 1)
        streams.wait([long])
        answered = streams.times[long][0]
        streams.wait(running, lambda i: streams.times[i][-1] > answered)  # the gap that spans the answer
        for i in running:
            streams.requests[i].cancelled.set()
        streams.wait(running)
    before, during = [], []
    for i in running:
        times = streams.times[i][2:]  # the first tokens come while the others are still admitted
        for a, b in itertools.pairwise(times):
            if b <= arrived:
                before.append(b - a)
            elif a < answered:
                during.append(b - a)
    return {"before": median(before), "p99": float(np.percentile(during, 99)), "worst": max(during),
            "gaps": len(during), "prefill": answered - arrived}


def chunked(args) -> None:
    model, tokenizer = gpt2_small()
    context = model.config.context_length
    long_prompt = torch.randint(0, tokenizer.n_vocab - 1, (context - 1,),
                                generator=torch.Generator().manual_seed(1)).tolist()
    from benchmarks.bench_serve import PROMPTS

    stream_prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(15)]
    chunks = args.chunks + [context]  # the last: the whole prompt in one step, as without chunking
    results = {chunk: [] for chunk in chunks}
    with torch.inference_mode():
        chunked_once(model, tokenizer, 64, long_prompt[:128], stream_prompts[:2])  # warm-up
        for _ in range(args.rounds):
            for chunk in chunks:
                results[chunk].append(chunked_once(model, tokenizer, chunk, long_prompt, stream_prompts))
                print(f"bench_paged: chunked prefill {chunk}: {results[chunk][-1]}", file=sys.stderr, flush=True)
    print(f"#### Chunked prefill: a {context - 1}-token prompt arrives while 15 streams decode the gpt2-small shape "
          f"(load average {load_average()})\n")
    print(f"Random weights, float32, `Engine(max_slots=16, prefill_chunk=N)`; the streams' gaps between tokens "
          f"(engine events) before the prompt arrives, and while it is prefilled (until its first token). Median "
          f"of {args.rounds} runs (range). {context} is the whole prompt in one step: no chunking.\n")
    print("| prefill_chunk | median gap before ms | p99 gap during ms | p99 / median | worst gap ms | "
          "prefill s (arrival to its token) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for chunk, runs in results.items():
        ratio = [r["p99"] / r["before"] for r in runs]
        print(f"| {chunk} | {spread([r['before'] * 1e3 for r in runs])} | {spread([r['p99'] * 1e3 for r in runs])} | "
              f"**{spread(ratio, 2)}x** | {spread([r['worst'] * 1e3 for r in runs])} | "
              f"{spread([r['prefill'] for r in runs], 2)} |")
    print("\nTarget: p99 during at most 3x the median.\n")


# --------------------------------------------------------------------------- shared prefixes
def prefix_round(engine, prefix: list[int], suffixes: list[list[int]], warm: bool) -> float:
    """TTFT p50 (seconds) of one request per suffix, all at once after the prefix (answered first when warm)."""
    streams = Streams(engine)
    if warm:
        streams.wait([streams.submit(prefix + [0] * 16, 1)])
    indices = [streams.submit(prefix + suffix, 1) for suffix in suffixes]
    streams.wait(indices)
    return median([streams.ttft(i) for i in indices])


def prefix(args) -> None:
    from llmscratch.deployment.engine import Engine

    model, tokenizer = gpt2_small()
    vocab = tokenizer.n_vocab - 1  # never <|endoftext|>
    results = {(share, warm): [] for share in (True, False) for warm in (False, True)}
    engines = {share: Engine(model, tokenizer, max_slots=16, prefix_sharing=share).start() for share in (True, False)}
    try:
        for round_index in range(args.rounds):
            generator = torch.Generator().manual_seed(round_index)
            for (share, warm), runs in results.items():  # a new prefix each time: none cached before its round
                prefix_ids = torch.randint(0, vocab, (512,), generator=generator).tolist()
                suffixes = torch.randint(0, vocab, (16, 16), generator=generator).tolist()
                runs.append(prefix_round(engines[share], prefix_ids, suffixes, warm))
                print(f"bench_paged: prefix sharing {share}, warm {warm}: {runs[-1]:.2f} s", file=sys.stderr,
                      flush=True)
    finally:
        for engine in engines.values():
            engine.stop()
    print(f"#### Shared prefixes: 16 requests of a common 512-token prefix and 16 tokens of their own "
          f"(load average {load_average()})\n")
    print(f"The gpt2-small shape (random weights, float32), `Engine(max_slots=16)` with and without "
          f"`prefix_sharing`; the 16 are submitted at once, max_tokens 1. Unseen: nothing cached before them; "
          f"cached: one request with the prefix answered just before. TTFT p50 over the 16, median of "
          f"{args.rounds} rounds (range).\n")
    print("| prefix | sharing on s | sharing off s | off / on |")
    print("|---|---:|---:|---:|")
    for warm, name in ((False, "unseen (the 16 at once)"), (True, "cached (an earlier request)")):
        on, off = results[(True, warm)], results[(False, warm)]
        print(f"| {name} | {spread(on, 2)} | {spread(off, 2)} | **{spread([b / a for a, b in zip(on, off)], 2)}x** |")
    print("\nTarget: at least 3x sooner with sharing.\n")


# --------------------------------------------------------------------------- how attention reads the blocks
def attention(args) -> None:
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    heads, head_dim, sequences, length, block = 12, 64, 16, 512, 16
    n_blocks = sequences * length // block + 1  # block 0: the null block
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(n_blocks * block, heads, head_dim, generator=generator)  # (N, H, D), as paged.py keeps it
    values = torch.randn(n_blocks * block, heads, head_dim, generator=generator)
    order = torch.randperm(n_blocks - 1, generator=generator) + 1  # blocks scattered over the pool
    tables = order.view(sequences, length // block)  # (B, n): each sequence's blocks
    owner = torch.full((n_blocks * block,), -1)  # the sequence each slot belongs to, and its position there
    position = torch.zeros(n_blocks * block, dtype=torch.long)
    slots = (tables[:, :, None] * block + torch.arange(block)).flatten(1)  # (B, S)
    owner[slots] = torch.arange(sequences)[:, None].expand_as(slots)
    position[slots] = torch.arange(length).expand_as(slots)
    pool_k, pool_v = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # (1, H, N, D) views
    flex = torch.compile(flex_attention, dynamic=False)

    def gathered(q, rows, q_pos):  # q (B, H, T, D) of the given rows at positions q_pos (T,)
        read = slots[rows]  # (B, S)
        mask = (torch.arange(length)[None, None, None, :] <= q_pos[None, None, :, None])  # (1, 1, T, S)
        k, v = keys[read].transpose(1, 2), values[read].transpose(1, 2)  # (B, H, S, D)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def flex_mask(rows, q_pos, q_block: int):
        """The block mask from the rows' block tables: per block of queries, the blocks every query sees whole
        (no mask_mod needed) and those it sees in part (the causal edge), as physical block ids."""
        starts = q_pos[::q_block]  # (nq,): each block of queries' first and last positions
        ends = q_pos[q_block - 1::q_block] if len(q_pos) >= q_block else q_pos[-1:]
        full = (starts + 1) // block  # (nq,): logical blocks wholly at or before the first query
        seen = ends // block + 1  # (nq,): logical blocks any query of the block sees
        n = tables.size(1)
        logical = torch.arange(n)
        full_indices = torch.where(logical < full[:, None], logical, n)  # (nq, n): the full ones first
        part_indices = torch.where((logical >= full[:, None]) & (logical < seen[:, None]), logical, n)

        def physical(indices):  # (nq, n) logical, unused ones n -> (B, 1, nq, pool blocks) physical, used first
            used = indices.sort(dim=-1).values.clamp(max=n - 1)
            ids = tables[rows][:, None, :].expand(-1, len(used), -1).gather(2, used[None].expand(len(rows), -1, -1))
            return torch.nn.functional.pad(ids, (0, n_blocks - n))[:, None]  # the width flex expects: every block

        return BlockMask.from_kv_blocks(
            (seen - full).expand(len(rows), 1, -1).contiguous(), physical(part_indices),
            full.expand(len(rows), 1, -1).contiguous(), physical(full_indices),
            BLOCK_SIZE=(q_block, block), mask_mod=paged_causal, seq_lengths=(len(q_pos), owner.numel()))

    query_at = torch.zeros(256, dtype=torch.long)  # the positions of the queries of the call: read by paged_causal

    def paged_causal(b, h, q_idx, kv_idx):
        return position[kv_idx] <= query_at[q_idx]

    def flexed(q, rows, q_pos):  # q (B, H, T, D) over the pool (stride 0 over B: no copy), the rows' own blocks
        query_at[: len(q_pos)] = q_pos
        mask = flex_mask(rows, q_pos, min(128, len(q_pos)))
        return flex(q, pool_k.expand(len(rows), -1, -1, -1), pool_v.expand(len(rows), -1, -1, -1), block_mask=mask)

    shapes = {"decode: 16 sequences x 1 query at position 511": (torch.arange(sequences), torch.tensor([length - 1])),
              "prefill chunk: 1 sequence x 256 queries at 256..511": (torch.tensor([3]), torch.arange(256, length))}
    print(f"#### How attention reads the blocks: gather + SDPA against FlexAttention (load average "
          f"{load_average()})\n")
    print(f"One layer of the gpt2-small shape ({heads} heads of {head_dim}), 16 sequences of {length} positions in "
          f"blocks of {block} scattered over a pool of {n_blocks} blocks, float32, torch {torch.__version__}. Gather: "
          f"each sequence's slots indexed into (B, H, S, D), `scaled_dot_product_attention` with a causal mask "
          f"(the ops of `PagedLayer.attend`). Flex: `flex_attention` compiled by `torch.compile`, each row "
          f"over the whole pool (a stride-0 view, no copy), a `BlockMask` made from the rows' block tables "
          f"(`BlockMask.from_kv_blocks`: blocks of up to 128 queries x {block} slots, whole blocks apart from the "
          f"causal edge's), built each call as a step's positions change. "
          f"Median of {args.calls} calls after warm-up (compile excluded); outputs compared first.\n")
    print("| shape | gather + SDPA ms | Flex (mask + attention) ms | Flex / gather | max difference |")
    print("|---|---:|---:|---:|---:|")
    with torch.inference_mode():
        for name, (rows, q_pos) in shapes.items():
            q = torch.randn(len(rows), heads, len(q_pos), head_dim, generator=generator)
            start = time.perf_counter()
            difference = (gathered(q, rows, q_pos) - flexed(q, rows, q_pos)).abs().max().item()
            compile_s = time.perf_counter() - start
            times = {"gather": [], "flex": []}
            for _ in range(args.calls):  # interleaved
                for key, function in (("gather", gathered), ("flex", flexed)):
                    start = time.perf_counter()
                    function(q, rows, q_pos)
                    times[key].append(time.perf_counter() - start)
            gather_ms, flex_ms = median(times["gather"]) * 1e3, median(times["flex"]) * 1e3
            print(f"| {name} | {gather_ms:.2f} | {flex_ms:.2f} | {flex_ms / gather_ms:.2f}x | {difference:.1e} |")
            print(f"bench_paged: attention {name}: first call (compiling) {compile_s:.1f} s", file=sys.stderr,
                  flush=True)
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run (default: all)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each measurement; medians over them (default 3)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128, 256],
                        help="prefill_chunk values of the chunked part (default 32 64 128 256)")
    parser.add_argument("--calls", type=int, default=20, help="timed calls of each attention (default 20)")
    parser.add_argument("--real-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="serve.py's --dtype in the real part (default float32)")
    parser.add_argument("--real-tokens", type=int, default=8, help="max_tokens of each chat request (default 8)")
    add_threads_flag(parser)
    args = parser.parse_args()
    set_threads(parser, args.threads)
    for flag, value in (("--rounds", args.rounds), ("--calls", args.calls), ("--real-tokens", args.real_tokens),
                        ("--chunks", min(args.chunks))):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    parts = {"real": real, "window": window, "throughput": throughput, "chunked": chunked, "prefix": prefix,
             "attention": attention}
    command = " ".join(["python -m benchmarks.bench_paged", *sys.argv[1:]])
    print(f"### Paged KV cache (issue 52) ({today()})\n")
    print(f"Command: `{command}`  ")
    print(f"Machine: {machine_description()}; load average {load_average()} at the start\n", flush=True)
    start = time.perf_counter()
    for part in args.parts:
        print(f"== bench_paged: {part}", file=sys.stderr, flush=True)
        parts[part](args)
        sys.stdout.flush()
    print(f"{(time.perf_counter() - start) / 60:.1f} minutes in all; load average {load_average()} at the end.")

if __name__ == "__main__":
    main()
