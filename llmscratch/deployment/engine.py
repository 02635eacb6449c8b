"""Continuous batching: many requests decoded together, one batched forward per step, each at its own pace.

The engine owns one static KV cache with a row ("slot") per running sequence. Each step it
1. retires the sequences that finished or whose client left, freeing their rows at once;
2. admits waiting requests into free rows, each prompt prefilled alone into its own row;
3. runs one decode forward over the occupied rows, every row at its own position;
4. chooses each row's next token with that request's own settings and random generator.
So a short request never waits for a long one to end, and a new one waits at most one step to
start. Decoding one token reads every weight once whatever the batch: 16 rows cost little more
than 1 while the weights dominate, which is why serving batches (ch07-deployment's notebook).

A request's tokens do not depend on what else runs beyond float rounding: its prefill is its
own, its row attends only to its own positions, and its sampling draws from its own generator.
``batch_shape="fixed"`` runs every step at the full ``max_slots`` rows, so that a row's arithmetic
is the same whoever else runs: see RESULTS.md for what that costs.

One thread runs the steps (``start``/``stop``, or ``with engine:``); ``submit`` may be called from
any thread, and each request's events go to its ``emit`` callback, from the engine's thread.

With ``logprobs`` a request's events also carry each token's log-probability under the model and the most
likely alternatives; with ``prompt_logprobs`` its first event carries the prompt's, taken from the logits its
prefill computes anyway (what an evaluation harness scores a multiple-choice answer with).

The cache is allocated whole at start: ``cache_bytes`` says how much, and an engine whose cache would
take more than ``CACHE_SHARE`` of the memory free on the model's device is refused before allocating.
"""

import codecs
import collections
import dataclasses
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch

from llmscratch.device import available_memory
from llmscratch.model.checks import check_sampling
from llmscratch.model.generate import sample_next_token
from llmscratch.model.gpt import GPT
from llmscratch.training.memory import format_bytes

BATCH_SHAPES = ("occupied", "fixed")
# The most of the memory free at start (the weights already loaded) that the cache may take: the rest is for
# each step's work, where a batched prefill writes its prompts into a scratch cache of their own (as large as
# the cache itself when every slot is admitted at once with a long prompt) and computes their logits.
CACHE_SHARE = 0.5
MAX_LOGPROBS = 20  # the most alternatives a request may ask for at each position (vLLM's default bound too)


class QueueFull(Exception):
    """The waiting queue is at its bound: come back later (an HTTP server answers 503)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded: greedy when temperature == 0, else sampled (see ``sample_next_token``).

    seed: the request's own random stream (None: a fresh one); stop: strings that end the answer
    (not part of it); max_tokens: new tokens at most (0: none, only the prompt's logprobs).
    logprobs: each new token's log-probability and this many alternatives' (None: none);
    prompt_logprobs: the prompt's tokens' too (with as many alternatives). Checked when made.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: bool = False

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.max_tokens < (0 if self.prompt_logprobs else 1):
            raise ValueError(f"max_tokens must be at least 1 (0 only with prompt_logprobs), got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability where it stands (None: a prompt's first token, which nothing predicts), and the
    ``top`` most likely ids there with theirs, most likely first."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, ids: list[int], top: int) -> list[TokenLogprob]:
    """Each id's log-probability under logits (T, V) at its position, with the ``top`` most likely alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()  # (T, V)
    chosen = logprobs.gather(1, torch.tensor(ids, dtype=torch.long)[:, None])[:, 0].tolist()  # (T,)
    values, indices = logprobs.topk(top, dim=-1)  # (T, top)
    return [TokenLogprob(i, lp, list(zip(alt_ids, alt_lps)))
            for i, lp, alt_ids, alt_lps in zip(ids, chosen, indices.tolist(), values.tolist())]


@dataclasses.dataclass
class Event:
    """What a request produced since its last event: new text and token ids; finish_reason when it ended.

    finish_reason: "stop" (end-of-text or a stop string), "length" (max_tokens), "cancelled" or
    "error" (then ``error`` says why). The last event also carries the token counts. logprobs: one per
    token_ids, when the request asked; prompt_logprobs: on the first event, when it asked.
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


class StopText:
    """Text released piece by piece, cut before the first stop string, holding back what could begin one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.held = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to show now, whether a stop string was found: nothing after it is shown)."""
        text = self.held + piece
        found = min((text.find(stop) for stop in self.stops if stop in text), default=len(text))
        # The earliest place where a stop string could still begin, once more text comes: an end of the text
        # that is the start of a longer stop. A stop found later than it may yet lose to one starting there.
        open_at = min((start for stop in self.stops for start in range(max(0, len(text) - len(stop) + 1), len(text))
                       if stop.startswith(text[start:])), default=len(text))
        if found < open_at:
            self.held = ""
            return text[:found], True
        self.held = text[open_at:]
        return text[:open_at], False

    def flush(self) -> tuple[str, bool]:
        """At the end of the text: what was held back, cut before a stop found in it, and whether one was."""
        text, self.held = self.held, ""
        found = min((text.find(stop) for stop in self.stops if stop in text), default=len(text))
        return text[:found], found < len(text)


class Request:
    """One submitted request: its prompt, settings, where its events go, and its progress in the engine."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, emit: Callable[[Event], None] | None,
                 tokenizer):
        self.prompt_ids = prompt_ids
        self.params = params
        self.events: queue.Queue[Event] | None = None if emit is not None else queue.Queue()
        self._emit = emit if emit is not None else self.events.put
        self.generator = torch.Generator()  # its own stream: the caller's and the other requests' never move
        if params.seed is None:
            self.generator.seed()  # a fresh seed from the operating system
        else:
            self.generator.manual_seed(params.seed)
        self.tokenizer = tokenizer
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop_text = StopText(params.stop)
        self.token_ids: list[int] = []
        self.stopped = False  # a stop string was found: nothing after it is text of the answer
        self.cancelled = threading.Event()
        self.submitted = time.monotonic()
        self.prompt_logprobs: list[TokenLogprob] | None = None  # set by the prefill; goes out with the first event

    def emit(self, event: Event) -> None:
        """Hand an event to the caller; a caller that cannot take it any more (its loop closed) has left."""
        if self.prompt_logprobs is not None:
            event.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        try:
            self._emit(event)
        except Exception:
            self.cancel()

    def cancel(self) -> None:
        """Leave: the engine frees this request's row at the start of its next step (or never admits it)."""
        self.cancelled.set()

    def result(self, timeout: float) -> Event:
        """Wait (at most timeout seconds) for the end; the whole answer as one event. Only without an emit."""
        text, ids, logprobs, prompt_logprobs = [], [], [], None
        deadline = time.monotonic() + timeout
        while True:
            event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))  # queue.Empty past the deadline
            text.append(event.text)
            ids += event.token_ids
            logprobs += event.logprobs or []
            prompt_logprobs = prompt_logprobs or event.prompt_logprobs
            if event.finish_reason is not None:
                return dataclasses.replace(event, text="".join(text), token_ids=ids, prompt_logprobs=prompt_logprobs,
                                           logprobs=logprobs if self.params.logprobs is not None else None)

    def finish(self, reason: str, error: str | None = None) -> None:
        tail = ""
        if reason in ("stop", "length") and not self.stopped:  # a character cut short, then what waited on a stop
            tail, stopped = self.stop_text.feed(self.decoder.decode(b"", final=True))
            if not stopped:
                held, stopped = self.stop_text.flush()
                tail += held
            reason = "stop" if stopped else reason  # a stop string that could only be told at the end
        self.emit(Event(tail, [], reason, error, len(self.prompt_ids), len(self.token_ids)))

    def add_token(self, token_id: int, eos_id: int | None, logprob: TokenLogprob | None = None) -> str | None:
        """Take the next token (and its logprob, if asked); emit its text; the finish reason if the request is done,
        else None."""
        self.token_ids.append(token_id)
        if token_id == eos_id:
            return "stop"
        text, self.stopped = self.stop_text.feed(self.decoder.decode(self.tokenizer.decode_bytes([token_id])))
        if text or not self.stopped:
            self.emit(Event(text, [token_id], logprobs=None if logprob is None else [logprob]))
        if self.stopped:
            return "stop"
        return "length" if len(self.token_ids) == self.params.max_tokens else None


class Engine:
    """Continuous batching over ``model``'s static KV cache, ``max_slots`` sequences at once.

    max_waiting: requests queued beyond the running ones; ``submit`` raises QueueFull past it.
    batch_shape: "occupied" runs each step over the rows up to the last occupied one (a freed row
    below it waits for the next request: no cache is ever copied); "fixed" always over all max_slots.
    """

    def __init__(self, model: GPT, tokenizer, *, max_slots: int = 16, max_waiting: int = 64,
                 batch_shape: str = "occupied"):
        if max_slots < 1 or max_waiting < 1:
            raise ValueError(f"max_slots and max_waiting must be at least 1; got {max_slots} and {max_waiting}")
        if batch_shape not in BATCH_SHAPES:
            raise ValueError(f"batch_shape must be one of {BATCH_SHAPES}, got {batch_shape!r}")
        device = model.token_embedding.weight.device
        self.cache_bytes = kv_cache_bytes(model, max_slots, model.config.context_length)
        check_cache_fits(model, max_slots, self.cache_bytes, available_memory(device))
        self.cache_description = (f"KV cache {format_bytes(self.cache_bytes)} ({max_slots} slots x "
                                  f"{model.config.context_length:,} positions, {_dtype_name(model)})")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eot_token
        self.vocab_size = min(tokenizer.n_vocab, model.config.vocab_size)  # never a padding id
        self.context_length = model.config.context_length
        self.max_slots = max_slots
        self.batch_shape = batch_shape
        self.waiting: queue.Queue[Request] = queue.Queue(maxsize=max_waiting)
        self.slots: list[Request | None] = [None] * max_slots
        self.caches = model.make_kv_caches(max_slots, self.context_length)
        self.tokens = torch.zeros(max_slots, 1, dtype=torch.long, device=device)  # (S, 1): each row's last token
        self.positions = torch.zeros(max_slots, 1, dtype=torch.long, device=device)  # (S, 1): where it goes
        self.stats = EngineStats()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # ------------------------------------------------------------------ the caller's side
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               emit: Callable[[Event], None] | None = None) -> Request:
        """Queue a request; its events go to emit (from the engine's thread) or to ``request.events``.

        ValueError if the prompt is empty, holds an id the model lacks (or, for its logprobs, the tokenizer), or
        leaves no room for max_tokens within the context; QueueFull if max_waiting requests already wait.
        """
        prompt_ids = [int(i) for i in prompt_ids]
        if not prompt_ids:
            raise ValueError("the prompt is empty: there must be at least one token to continue")
        ids = self.vocab_size if params.prompt_logprobs else self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= ids:
            raise ValueError(f"the prompt holds ids outside 0..{ids - 1}")
        if len(prompt_ids) + params.max_tokens > self.context_length:
            raise ValueError(f"this model's context is {self.context_length} tokens; the request asks for "
                             f"{len(prompt_ids) + params.max_tokens} ({len(prompt_ids)} of prompt, "
                             f"{params.max_tokens} of completion)")
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
        return sum(request is not None for request in self.slots)

    @property
    def queued(self) -> int:
        return self.waiting.qsize()

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
        for row, request in enumerate(self.slots):
            if request is not None:
                self._retire(row, reason, error)
        while waiting and not self.waiting.empty():
            self.waiting.get_nowait().finish(reason, error)
            self.stats.finished[reason] += 1

    @torch.inference_mode()  # no autograd record of the cache writes, whoever calls it
    def step(self, wait: float = 0.0) -> None:
        """One step: retire, admit, one batched decode. With nothing to do, wait for a request (seconds)."""
        for row, request in enumerate(self.slots):
            if request is not None and request.cancelled.is_set():
                self._retire(row, "cancelled")
        self._drop_cancelled_waiting()
        self._admit(wait if self.running == 0 else 0.0)
        if self.running:
            try:
                self._decode()
            except Exception as err:  # a failing step ends the requests in it, not the server
                self._end_all("error", f"{type(err).__name__}: {err}", waiting=False)

    def _drop_cancelled_waiting(self) -> None:
        """Take the requests whose clients left out of the queue now, rather than when a row frees: their places
        are for others (``submit`` counts them)."""
        with self.waiting.mutex:  # queue.Queue's own lock over its deque
            left = [request for request in self.waiting.queue if request.cancelled.is_set()]
            if not left:
                return
            self.waiting.queue = collections.deque(r for r in self.waiting.queue if not r.cancelled.is_set())
            self.waiting.not_full.notify_all()
        for request in left:
            request.finish("cancelled")
            self.stats.finished["cancelled"] += 1

    def _admit(self, wait: float) -> None:
        """Fill the free rows from the queue, lowest first, and prefill the new prompts (together, unless "fixed")."""
        free = [row for row, request in enumerate(self.slots) if request is None]
        admitted = []
        while len(admitted) < len(free):
            try:
                request = self.waiting.get(timeout=wait) if wait else self.waiting.get_nowait()
            except queue.Empty:
                break
            wait = 0.0
            if request.cancelled.is_set():
                request.finish("cancelled")
                self.stats.finished["cancelled"] += 1
            else:
                admitted.append(request)
        pairs = list(zip(free, admitted))
        # "fixed": each prompt alone, so that its arithmetic cannot depend on the others admitted with it.
        for group in [[pair] for pair in pairs] if self.batch_shape == "fixed" else [pairs] if pairs else []:
            for row, request in group:
                self.slots[row] = request
                self.positions[row] = len(request.prompt_ids)
            try:
                logits = self._prefill(group)  # (n, V)
                self._choose({row: logits[i] for i, (row, request) in enumerate(group) if request.params.max_tokens})
                for row, request in group:
                    if not request.params.max_tokens:  # the prompt's logprobs were all it asked for
                        self._retire(row, "length")
            except Exception as err:  # these requests end; the others run on
                for row, _ in group:
                    if self.slots[row] is not None:
                        self._retire(row, "error", f"{type(err).__name__}: {err}")

    def _prefill(self, group: list[tuple[int, "Request"]]) -> torch.Tensor:
        """Run the prompts of (row, request) pairs into their rows of the cache; each one's next-token logits (n, V)."""
        prompts = [request.prompt_ids for _, request in group]
        self.stats.prompt_tokens += sum(map(len, prompts))
        device = self.tokens.device
        if len(group) == 1:
            row = group[0][0]
            caches = [cache.rows(row, row + 1) for cache in self.caches]
            logits = self.model(torch.tensor(prompts, device=device), caches)
            self._score_prompts(group, logits)  # (1, T, V)
            return logits[:, -1]  # (1, V)
        # Several in one forward: right-padded to the longest, into a cache of their own, then copied into their
        # rows. A prompt never sees the padding after it (causal), and the padding's keys sit at positions its row
        # writes anew before any query reads them.
        longest = max(map(len, prompts))
        idx = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)  # (n, T)
        for i, prompt in enumerate(prompts):
            idx[i, : len(prompt)] = torch.tensor(prompt)
        scratch = self.model.make_kv_caches(len(prompts), longest)
        logits = self.model(idx, scratch)  # (n, T, V)
        self._score_prompts(group, logits)
        rows = torch.tensor([row for row, _ in group], device=device)
        for cache, part in zip(self.caches, scratch):
            cache.keys[rows, :, :longest] = part.keys
            cache.values[rows, :, :longest] = part.values
        last = torch.tensor([len(prompt) - 1 for prompt in prompts], device=device)
        return logits[torch.arange(len(prompts), device=device), last]  # (n, V): each prompt's own last position

    def _score_prompts(self, group: list[tuple[int, "Request"]], logits: torch.Tensor) -> None:
        """The prompt's logprobs for each request that asked, from its prefill's logits (n, T, V)."""
        for i, (_, request) in enumerate(group):
            if request.params.prompt_logprobs:
                ids = request.prompt_ids
                request.prompt_logprobs = [TokenLogprob(ids[0], None, [])] + token_logprobs(
                    logits[i, : len(ids) - 1, : self.vocab_size], ids[1:], request.params.logprobs or 0)

    def _decode(self) -> None:
        """Feed every occupied row its last token at its own position; choose the next ones."""
        occupied = [row for row, request in enumerate(self.slots) if request is not None]
        if self.batch_shape == "fixed":
            rows, caches = self.max_slots, self.caches
        else:  # the rows up to the last occupied one, and only the positions some row has reached
            rows = occupied[-1] + 1
            length = max(len(self.slots[row].prompt_ids) + len(self.slots[row].token_ids) for row in occupied)
            caches = [cache.rows(0, rows, length) for cache in self.caches]
        logits = self.model(self.tokens[:rows], caches, input_pos=self.positions[:rows])[:, -1]  # (rows, V)
        self.positions[occupied] += 1
        self._choose({row: logits[row] for row in occupied})
        self.stats.step(len(occupied))

    def _choose(self, logits_by_row: dict[int, torch.Tensor]) -> None:
        """Each row's next token by its own settings; emit it; retire the rows that finished."""
        for row, logits in logits_by_row.items():
            request = self.slots[row]
            params = request.params
            # On the CPU, where the request's generator is (a seed then gives the same tokens on any device).
            token = sample_next_token(logits[None, : self.vocab_size].float().cpu(), params.temperature,
                                      params.top_k, params.top_p, request.generator)  # (1,)
            self.tokens[row] = token
            token_id = int(token)
            self.stats.tokens += 1
            if len(request.token_ids) == 0:
                self.stats.first_token(time.monotonic() - request.submitted)
            # The model's own distribution, before temperature, top-k and top-p reshape it (as vLLM reports it)
            logprob = None if params.logprobs is None else token_logprobs(logits[None, : self.vocab_size], [token_id],
                                                                          params.logprobs)[0]
            reason = request.add_token(token_id, self.eos_id, logprob)
            if reason is None and int(self.positions[row]) >= self.context_length:
                reason = "length"  # submit keeps prompt + max_tokens within the context; this is the backstop
            if reason is not None:
                self._retire(row, reason)

    def _retire(self, row: int, reason: str, error: str | None = None) -> None:
        request, self.slots[row] = self.slots[row], None
        self.tokens[row] = 0  # a free row below an occupied one decodes a dummy token at position 0
        self.positions[row] = 0
        request.finish(reason, error)
        self.stats.finished[reason] += 1


def kv_cache_bytes(model: GPT, slots: int, positions: int) -> int:
    """The bytes of ``model.make_kv_caches(slots, positions)``, known before allocating: keys and values, every block.

    Every layer keeps all ``positions``, sliding-window layers too (the cache does not trim them yet).
    """
    weight = model.token_embedding.weight
    kv_heads = sum(getattr(getattr(block, "attn", None), "n_kv_heads", model.config.kv_heads) for block in model.blocks)
    return 2 * slots * positions * kv_heads * model.config.head_dim * weight.element_size()


def check_cache_fits(model: GPT, slots: int, cache_bytes: int, free: int | None) -> None:
    """ValueError, naming the bytes and what reduces them, where the cache would take more than CACHE_SHARE of
    ``free`` bytes (None: unknown, not checked)."""
    if free is None or cache_bytes <= CACHE_SHARE * free:
        return
    per_slot = cache_bytes // slots
    fit = int(CACHE_SHARE * free // per_slot)
    remedies = [f"lower --max-slots ({fit:,} fit)"] if fit else []
    if model.token_embedding.weight.element_size() > 2:
        remedies.append("use --dtype bfloat16 (half the bytes)")
    remedies += [] if fit else ["use a device with more memory"]
    device = model.token_embedding.weight.device
    raise ValueError(f"the KV cache of {slots:,} slots x {model.config.context_length:,} positions "
                     f"({_dtype_name(model)}) needs {format_bytes(cache_bytes)} ({cache_bytes:,} bytes, "
                     f"{format_bytes(per_slot)} a slot), more than {CACHE_SHARE:.0%} of the {format_bytes(free)} free "
                     f"on {device} (the rest is for each step's work): {'' if fit else 'not one slot fits; '}"
                     f"{' or '.join(remedies)}")


def _dtype_name(model: GPT) -> str:
    return str(model.token_embedding.weight.dtype).removeprefix("torch.")


class EngineStats:
    """Counters and recent timings for ``/metrics``: tokens, steps, time to first token."""

    def __init__(self, window: float = 10.0, keep: int = 1000):
        self.window = window
        self.submitted = self.tokens = self.prompt_tokens = self.steps = 0
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
