"""Continuous batching over a paged KV cache: many requests decoded together, each at its own pace, in a budget.

The engine keeps every running sequence's keys and values in one ``PagedKVCache``: blocks drawn from a
pool of ``kv_memory`` bytes, so a sequence holds memory for the tokens it has, not for the whole context.
Each step it
1. retires the sequences that finished or whose client left, giving their blocks back at once;
2. admits waiting requests while a slot is free and the pool has room for their prompt (a prompt that
   starts like an earlier one takes that one's cached blocks and skips their prefill; one that starts
   like a prompt still being prefilled waits for those blocks to be written);
3. prefills up to ``prefill_chunk`` prompt tokens, so that a long prompt runs in chunks between
   decoding steps and the running streams keep moving;
4. decodes every sequence that has a token to feed, in one batched forward; if the pool cannot hold
   the step, the newest sequence is preempted: its blocks freed, the request back at the head of the
   queue, its prompt and tokens so far prefilled again when it returns (the same tokens, greedy);
5. chooses each sequence's next token with that request's own settings and random generator.
Decoding one token reads every weight once whatever the batch: 16 rows cost little more than 1
while the weights dominate, which is why serving batches (ch07-deployment's notebook).

A request's tokens do not depend on what else runs beyond float rounding: its rows attend only to its
own blocks, and its sampling draws from its own generator. ``batch_shape="fixed"`` runs every decoding
step at the full ``max_slots`` rows (each sequence in the row of its slot) and prefills each prompt alone,
so that a row's arithmetic is the same whoever else runs: see RESULTS.md for what that costs.

One thread runs the steps (``start``/``stop``, or ``with engine:``); ``submit`` may be called from
any thread, and each request's events go to its ``emit`` callback, from the engine's thread.
"""

import collections
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch

from llmscratch.deployment.requests import (MAX_LOGPROBS, Event, QueueFull, Request, SamplingParams, TokenLogprob,
                                            token_logprobs)
from llmscratch.device import available_memory
from llmscratch.model.generate import sample_next_token
from llmscratch.model.gpt import GPT
from llmscratch.model.paged import PagedKVCache, describe, feed
from llmscratch.training.memory import format_bytes

__all__ = ["BATCH_SHAPES", "CACHE_SHARE", "MAX_LOGPROBS", "Engine", "EngineStats", "Event", "QueueFull", "Request",
           "SamplingParams", "TokenLogprob", "check_cache_fits", "kv_cache_bytes"]

BATCH_SHAPES = ("occupied", "fixed")
# The most of the memory free at start (the weights already loaded) that the cache may take: the rest is for
# each step's work (a prefill chunk's activations and attention, the gathered keys and values, the logits).
CACHE_SHARE = 0.5
PREFILL_CHUNK = 128  # prompt tokens a step prefills at most: on 2 CPU cores, 2.5x a 15-stream step (RESULTS.md)


class Running:
    """A request admitted into a slot: the tokens its cache must hold (prompt, then answer) and how many it has."""

    def __init__(self, request: Request, slot: int):
        self.request = request
        self.slot = slot
        self.tokens = request.prompt_ids + request.token_ids  # a preempted request returns with its answer so far
        self.fed = 0  # tokens whose keys and values the cache holds
        self.prompt_logprobs: list[TokenLogprob] | None = None  # collected chunk by chunk while the prompt is fed

    @property
    def unfed(self) -> int:
        return len(self.tokens) - self.fed


class Engine:
    """Continuous batching over ``model`` with a paged KV cache, at most ``max_slots`` sequences at once.

    kv_memory: the cache's budget in bytes (None: what ``max_slots`` sequences of ``max_model_len`` positions
    need, or ``CACHE_SHARE`` of the memory free on the model's device if that is less); max_model_len: the
    longest prompt + answer (None: the model's context); max_waiting: requests queued beyond the running
    ones (``submit`` raises QueueFull past it); prefill_chunk: prompt tokens per step; prefix_sharing: take
    cached blocks for a prompt's first tokens; batch_shape: "occupied" or "fixed" (see the module docstring).
    """

    def __init__(self, model: GPT, tokenizer, *, max_slots: int = 16, max_waiting: int = 64,
                 batch_shape: str = "occupied", kv_memory: int | None = None, max_model_len: int | None = None,
                 block_size: int = 16, prefill_chunk: int = PREFILL_CHUNK, prefix_sharing: bool = True):
        context = model.config.context_length
        max_model_len = context if max_model_len is None else max_model_len
        if min(max_slots, max_waiting, block_size, prefill_chunk) < 1 or not 1 <= max_model_len <= context:
            raise ValueError(f"max_slots, max_waiting, block_size and prefill_chunk must be at least 1 and "
                             f"max_model_len between 1 and the model's context of {context}; got {max_slots}, "
                             f"{max_waiting}, {block_size}, {prefill_chunk} and {max_model_len}")
        if batch_shape not in BATCH_SHAPES:
            raise ValueError(f"batch_shape must be one of {BATCH_SHAPES}, got {batch_shape!r}")
        device = model.token_embedding.weight.device
        need = kv_cache_bytes(model, max_slots, max_model_len, block_size, prefill_chunk)
        one = kv_cache_bytes(model, 1, max_model_len, block_size, prefill_chunk)
        free = available_memory(device)
        if kv_memory is None:  # what the slots need, within a share of the free memory; one full sequence at least
            kv_memory = need if free is None else min(need, int(CACHE_SHARE * free))
            check_cache_fits(model, max(kv_memory, one), free, one)
        else:  # a budget asked for: it may be small (longer requests are refused), never more than the share
            check_cache_fits(model, kv_memory, free, one)
        self.model = model.eval()
        # "fixed" computes every prompt whole: a prefix cached by an earlier request would change its arithmetic
        self.cache = PagedKVCache(model, kv_memory, block_size=block_size, max_model_len=max_model_len,
                                  lookahead=prefill_chunk, prefix_sharing=prefix_sharing and batch_shape != "fixed")
        self.cache_bytes = self.cache.bytes
        self.cache_description = describe(self.cache) + f", {_dtype_name(model)}"
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eot_token
        self.vocab_size = min(tokenizer.n_vocab, model.config.vocab_size)  # never a padding id
        self.model_vocab_size = model.config.vocab_size
        self.context_length = max_model_len
        self.max_slots = max_slots
        self.batch_shape = batch_shape
        self.prefill_chunk = prefill_chunk
        self.waiting: queue.Queue[Request] = queue.Queue(maxsize=max_waiting)
        self.returning: collections.deque[Request] = collections.deque()  # preempted, or admitted when no room
        self.slots: list[Request | None] = [None] * max_slots
        self.sequences: list[Running] = []  # in the order admitted: the last is preempted first
        self.stats = EngineStats()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # ------------------------------------------------------------------ the caller's side
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               emit: Callable[[Event], None] | None = None) -> Request:
        """Queue a request; its events go to emit (from the engine's thread) or to ``request.events``.

        ValueError if the prompt is empty, holds an id the model lacks (or, for its logprobs, the tokenizer),
        leaves no room for max_tokens within max_model_len, or needs more blocks than the whole pool holds;
        QueueFull if max_waiting requests already wait.
        """
        prompt_ids = [int(i) for i in prompt_ids]
        if not prompt_ids:
            raise ValueError("the prompt is empty: there must be at least one token to continue")
        ids = self.vocab_size if params.prompt_logprobs else self.model_vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= ids:
            raise ValueError(f"the prompt holds ids outside 0..{ids - 1}")
        length = len(prompt_ids) + params.max_tokens
        if length > self.context_length:
            raise ValueError(f"this model's context is {self.context_length} tokens; the request asks for "
                             f"{length} ({len(prompt_ids)} of prompt, {params.max_tokens} of completion)")
        if not self.cache.fits(length):
            raise ValueError(f"the KV cache ({self.cache_description}) cannot hold one sequence of {length} "
                             f"positions ({len(prompt_ids)} of prompt, {params.max_tokens} of completion): "
                             f"ask for fewer tokens, or give the cache more memory (--kv-memory)")
        request = Request(prompt_ids, params, emit, self.tokenizer)
        try:
            self.waiting.put_nowait(request)
        except queue.Full:
            self._drop_cancelled_waiting()  # places held by clients that left are free
            try:
                self.waiting.put_nowait(request)
            except queue.Full:
                raise QueueFull(f"{self.waiting.maxsize} requests are already waiting") from None
        self.stats.submitted += 1
        return request

    def start(self) -> "Engine":
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name="llmscratch-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """End the engine's thread after its current step; requests still running or waiting are cancelled."""
        if self._thread is not None:
            self._stopping.set()
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the engine's step did not end within {timeout:.0f} s")
            self._thread = None

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> int:
        return len(self.sequences)

    @property
    def queued(self) -> int:
        return self.waiting.qsize() + len(self.returning)

    # ------------------------------------------------------------------ the engine's thread
    @torch.inference_mode()
    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.step(wait=0.05)
            except Exception as err:  # a bug of ours: end what runs with it, and keep serving
                self._end_all("error", f"{type(err).__name__}: {err}", waiting=False)
        self._end_all("cancelled")

    def _end_all(self, reason: str, error: str | None = None, waiting: bool = True) -> None:
        """End every running request (and every waiting one) with this reason."""
        for sequence in list(self.sequences):
            self._retire(sequence, reason, error)
        while waiting and (self.returning or not self.waiting.empty()):
            request = self.returning.popleft() if self.returning else self.waiting.get_nowait()
            request.finish(reason, error)
            self.stats.finished[reason] += 1

    @torch.inference_mode()  # no autograd record of the cache writes, whoever calls it
    def step(self, wait: float = 0.0) -> None:
        """One step: retire, admit, a prefill chunk, decode. With nothing to do, wait for a request (seconds)."""
        for sequence in list(self.sequences):
            if sequence.request.cancelled.is_set():
                self._retire(sequence, "cancelled")
        self._drop_cancelled_waiting()
        self._admit(wait if not self.sequences else 0.0)
        for work in (self._prefill_chunk, self._decode):
            try:
                work()
            except Exception as err:  # a failing step ends the requests in it, not the server
                self._end_all("error", f"{type(err).__name__}: {err}", waiting=False)

    def _drop_cancelled_waiting(self) -> None:
        """Take the requests whose clients left out of the queue now, rather than when a slot frees: their places
        are for others (``submit`` counts them)."""
        with self.waiting.mutex:  # queue.Queue's own lock over its deque
            left = [request for request in self.waiting.queue if request.cancelled.is_set()]
            if left:
                self.waiting.queue = collections.deque(r for r in self.waiting.queue if not r.cancelled.is_set())
                self.waiting.not_full.notify_all()
        left += [request for request in self.returning if request.cancelled.is_set()]
        self.returning = collections.deque(r for r in self.returning if not r.cancelled.is_set())
        for request in left:
            request.finish("cancelled")
            self.stats.finished["cancelled"] += 1

    def _next_waiting(self, wait: float) -> Request | None:
        if self.returning:
            return self.returning.popleft()
        try:
            return self.waiting.get(timeout=wait) if wait else self.waiting.get_nowait()
        except queue.Empty:
            return None

    def _admit(self, wait: float) -> None:
        """Give free slots to waiting requests, oldest first, while the pool has room for their prompts."""
        while None in self.slots:
            request = self._next_waiting(wait)
            wait = 0.0
            if request is None:
                return
            if request.cancelled.is_set():
                request.finish("cancelled")
                self.stats.finished["cancelled"] += 1
                continue
            share = not (request.params.prompt_logprobs and not request.token_ids)  # its prompt's logits are asked
            if share and self.cache.prefix_sharing and self._prefix_in_flight(request):
                self.returning.appendleft(request)  # its prefix will be cached within a step or two: wait for it
                return
            sequence = Running(request, self.slots.index(None))
            sequence.fed = self.cache.add(sequence, sequence.tokens if share else ())
            # Room for its first chunk of prompt, and a token more for every sequence already decoding (the later
            # chunks wait for blocks, and the newest sequence gives its own back when an older one needs them)
            room = {s: 1 for s in self.sequences if s.unfed == 1} | {sequence: min(sequence.unfed, self.prefill_chunk)}
            if self.sequences and not self.cache.can_feed(room):
                self.cache.free(sequence)
                self.returning.appendleft(request)
                return
            if request.params.prompt_logprobs and not request.token_ids:
                sequence.prompt_logprobs = [TokenLogprob(sequence.tokens[0], None, [])]
            self.slots[sequence.slot] = request
            self.sequences.append(sequence)
            if not request.admitted:  # counted once, however often it is preempted and readmitted
                self.stats.prompt_tokens += len(request.prompt_ids)
            request.admitted = True
            self.stats.cached_tokens += sequence.fed

    def _prefix_in_flight(self, request: Request) -> bool:
        """Whether a sequence still prefilling starts with at least one more block of this request's prompt than
        it has fed: admitted now, the request would compute those blocks again instead of sharing them."""
        tokens, block = request.prompt_ids + request.token_ids, self.cache.block_size
        for sequence in self.sequences:
            if sequence.unfed > 1:
                same = next((i for i, (a, b) in enumerate(zip(tokens, sequence.tokens)) if a != b),
                            min(len(tokens), len(sequence.tokens)))
                if (min(same, len(tokens) - 1) // block) * block > sequence.fed:
                    return True
        return False

    def _decode(self) -> None:
        """Feed every sequence its one unfed token (the last chosen, or a prompt's last) in one forward."""
        decoding = [s for s in self.sequences if s.unfed == 1]
        while decoding and not self.cache.can_feed({s: 1 for s in decoding}):
            victim = self.sequences[-1]  # the newest gives its blocks back (there is always room for one alone)
            self._preempt(victim)
            decoding = [s for s in decoding if s is not victim]
        if not decoding:
            return
        decoding.sort(key=lambda s: s.slot)
        rows: list[Running | None] = decoding
        if self.batch_shape == "fixed":  # every slot a row, the free ones a dummy token at position 0
            occupied = {s.slot: s for s in decoding}
            rows = [occupied.get(slot) for slot in range(self.max_slots)]
        logits = self._forward(rows, [[s.tokens[-1]] if s else [0] for s in rows], last_only=True)[:, -1]  # (rows, V)
        for sequence in decoding:
            if sequence.prompt_logprobs is not None:  # a prompt's last token: nothing of the prompt left to score
                self._score_prompt(sequence, logits[:0], sequence.fed - 1)
        self._chosen({s.slot: logits[i] for i, s in enumerate(rows) if s is not None})
        self.stats.step(len(decoding))

    def _prefill_chunk(self) -> None:
        """Feed up to prefill_chunk prompt tokens of the sequences still prefilling, oldest first, in one forward
        (each alone when "fixed"); a sequence whose prompt is then all fed gets its first token."""
        prefilling = [s for s in self.sequences if s.unfed > 1]
        # The oldest prompt must move: while the pool cannot take a token of it, the newest sequence gives way
        while prefilling and not self.cache.can_feed({prefilling[0]: 1}) and self.sequences[-1] is not prefilling[0]:
            victim = self.sequences[-1]
            self._preempt(victim)
            prefilling = [s for s in prefilling if s is not victim]
        budget, work = self.prefill_chunk, []
        for sequence in prefilling:
            if sequence.unfed > 1 and budget and (not work or self.batch_shape == "occupied"):
                take = min(budget, sequence.unfed)
                while not self.cache.can_feed({s: n for s, n in work} | {sequence: take}) and take > 1:
                    take //= 2  # the pool is short: a smaller chunk now, the rest when blocks come back
                if self.cache.can_feed({s: n for s, n in work} | {sequence: take}):
                    work.append((sequence, take))
                    budget -= take
        if not work:
            return
        sequences = [s for s, _ in work]
        chunks = [s.tokens[s.fed: s.fed + n] for s, n in work]
        starts = [s.fed for s in sequences]
        # Only the last position's logits, unless a prompt's logprobs are asked: the rest would be (T, V) unread
        scoring = any(s.prompt_logprobs is not None for s in sequences)
        logits = self._forward(sequences, chunks, last_only=not scoring)  # (n, T or 1, V)
        for i, (sequence, start, chunk) in enumerate(zip(sequences, starts, chunks)):
            if sequence.prompt_logprobs is not None:
                self._score_prompt(sequence, logits[i, : len(chunk)], start)
        self._chosen({s.slot: logits[i, len(c) - 1 if scoring else -1] for i, (s, c) in enumerate(zip(sequences, chunks))
                      if s.unfed == 0})

    def _forward(self, rows: list[Running | None], chunks: list[list[int]], last_only: bool) -> torch.Tensor:
        """Each row's chunk fed at its next positions (None: a dummy row); the logits (rows, T or 1, V)."""
        fixed = self.cache.blocks_for(self.context_length) if self.batch_shape == "fixed" else 0
        logits = feed(self.model, self.cache, rows, chunks, read_blocks=fixed, last_only=last_only)
        for sequence, chunk in zip(rows, chunks):
            if sequence is not None:
                sequence.fed += len(chunk)
        return logits

    def _score_prompt(self, sequence: Running, logits: torch.Tensor, start: int) -> None:
        """The prompt's logprobs from a chunk's logits (T, V) fed from position start; handed over when complete."""
        prompt = sequence.request.prompt_ids
        targets = prompt[start + 1: start + 1 + logits.size(0)]  # position p predicts token p + 1 of the prompt
        if targets:
            sequence.prompt_logprobs += token_logprobs(logits[: len(targets), : self.vocab_size], targets,
                                                       sequence.request.params.logprobs or 0)
        if sequence.fed >= len(prompt):
            sequence.request.prompt_logprobs, sequence.prompt_logprobs = sequence.prompt_logprobs, None

    def _chosen(self, logits_by_slot: dict[int, torch.Tensor]) -> None:
        """The sequences whose logits (V,) predict a new token: a request that only wanted its prompt's logprobs
        ends; the others choose (``_choose``)."""
        for slot in [s for s in logits_by_slot if not self.slots[s].params.max_tokens]:
            self._retire(self._sequence(slot), "length")
            del logits_by_slot[slot]
        if logits_by_slot:
            self._choose(logits_by_slot)

    def _choose(self, logits_by_slot: dict[int, torch.Tensor]) -> None:
        """Each slot's next token by its own settings; emit it; retire the sequences that finished."""
        for slot, logits in logits_by_slot.items():
            sequence = self._sequence(slot)
            request = sequence.request
            params = request.params
            # On the CPU, where the request's generator is (a seed then gives the same tokens on any device).
            token = sample_next_token(logits[None, : self.vocab_size].float().cpu(), params.temperature,
                                      params.top_k, params.top_p, request.generator)  # (1,)
            token_id = int(token)
            sequence.tokens.append(token_id)
            self.stats.tokens += 1
            if len(request.token_ids) == 0:
                self.stats.first_token(time.monotonic() - request.submitted)
            # The model's own distribution, before temperature, top-k and top-p reshape it (as vLLM reports it)
            logprob = None if params.logprobs is None else token_logprobs(logits[None, : self.vocab_size], [token_id],
                                                                          params.logprobs)[0]
            reason = request.add_token(token_id, self.eos_id, logprob)
            if reason is None and len(sequence.tokens) >= self.context_length:
                reason = "length"  # submit keeps prompt + max_tokens within the context; this is the backstop
            if reason is not None:
                self._retire(sequence, reason)

    def _sequence(self, slot: int) -> Running:
        return next(s for s in self.sequences if s.slot == slot)

    def _retire(self, sequence: Running, reason: str, error: str | None = None) -> None:
        self._release(sequence)
        sequence.request.finish(reason, error)
        self.stats.finished[reason] += 1

    def _preempt(self, sequence: Running) -> None:
        """Free a sequence's slot and blocks; its request waits at the head of the queue, to be prefilled again."""
        self._release(sequence)
        self.returning.appendleft(sequence.request)
        self.stats.preempted += 1

    def _release(self, sequence: Running) -> None:
        self.sequences.remove(sequence)
        self.slots[sequence.slot] = None
        self.cache.free(sequence)


def kv_cache_bytes(model: GPT, sequences: int, positions: int, block_size: int = 16,
                   prefill_chunk: int = PREFILL_CHUNK) -> int:
    """The bytes of a paged cache that holds ``sequences`` sequences of ``positions`` positions at once, known
    before allocating; a sliding-window layer counts only the blocks its window and a prefill chunk reach."""
    return PagedKVCache.bytes_for(model, sequences, positions, block_size, lookahead=prefill_chunk)


def check_cache_fits(model: GPT, cache_bytes: int, free: int | None, one_sequence: int) -> None:
    """ValueError, naming the bytes and what reduces them, where the cache would take more than CACHE_SHARE of
    ``free`` bytes (None: unknown, not checked); one_sequence: the bytes of one sequence of max_model_len."""
    if free is None or cache_bytes <= CACHE_SHARE * free:
        return
    remedies = [f"lower --kv-memory (at most {format_bytes(CACHE_SHARE * free)})"]
    if CACHE_SHARE * free < one_sequence:
        remedies = [f"lower --max-model-len (one sequence of the full length needs {format_bytes(one_sequence)})"]
        if model.token_embedding.weight.element_size() > 2:
            remedies.append("use --dtype bfloat16 (half the bytes)")
        remedies.append("use a device with more memory")
    device = model.token_embedding.weight.device
    raise ValueError(f"a KV cache of {format_bytes(cache_bytes)} ({cache_bytes:,} bytes, {_dtype_name(model)}) is "
                     f"more than {CACHE_SHARE:.0%} of the {format_bytes(free)} free on {device} (the rest is for "
                     f"each step's work): {' or '.join(remedies)}")


def _dtype_name(model: GPT) -> str:
    return str(model.token_embedding.weight.dtype).removeprefix("torch.")


class EngineStats:
    """Counters and recent timings for ``/metrics``: tokens, steps, preemptions, time to first token."""

    def __init__(self, window: float = 10.0, keep: int = 1000):
        self.window = window
        self.submitted = self.tokens = self.prompt_tokens = self.cached_tokens = self.steps = self.preempted = 0
        self.finished: collections.Counter[str] = collections.Counter()  # requests ended, by finish reason
        self.first_token_seconds: collections.deque[float] = collections.deque(maxlen=keep)
        self.first_token_sum, self.first_token_count = 0.0, 0  # over all requests, for a Prometheus summary
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens of a step)
        self._lock = threading.Lock()

    def step(self, tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.steps += 1
            self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] < now - self.window:
                self._recent.popleft()

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.first_token_seconds.append(seconds)
            self.first_token_sum += seconds
            self.first_token_count += 1

    def tokens_per_second(self) -> float:
        """Decoded tokens per second over the last ``window`` seconds."""
        now = time.monotonic()
        with self._lock:
            recent = [tokens for at, tokens in self._recent if at >= now - self.window]
        return sum(recent) / self.window

    def first_token_quantiles(self, quantiles: Sequence[float] = (0.5, 0.9, 0.99)) -> dict[float, float]:
        with self._lock:
            seconds = sorted(self.first_token_seconds)
        if not seconds:
            return {}
        return {q: seconds[max(0, math.ceil(q * len(seconds)) - 1)] for q in quantiles}  # nearest rank
