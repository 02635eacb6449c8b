"""What a request to the engine is: its sampling settings, its progress, and the events it sends back.

The engine (``llmscratch.deployment.engine``) schedules requests; everything about one request alone lives
here: how it is decoded (``SamplingParams``), the text it releases piece by piece, held back where a stop
string may begin (``StopText``), and the events that carry its tokens, log-probabilities and finish reason.
"""

import codecs
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch

from llmscratch.model.checks import check_sampling

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
        self.admitted = False  # an engine has started it (a preempted request returns with this set)

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
