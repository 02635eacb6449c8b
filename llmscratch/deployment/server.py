"""An OpenAI-compatible HTTP server over the continuous-batching engine, with a chat page.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (whole, or streamed as server-sent
events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text) and the chat page at ``/``. The requests and answers are the OpenAI API's, so
its official clients, curl scripts and chat front ends written for it work unchanged.

Guards at the door: API keys (``Authorization: Bearer KEY``) when any are set; a per-key rate
limit (429 with Retry-After); the engine's bounded queue (503 at once when full); requests
checked before they reach the engine (400 / 422 naming the field; 404 for a model not served).
A client that goes away has its request cancelled: the engine frees its row at its next step.
"""

import asyncio
import collections
import hmac
import importlib.resources
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from llmscratch.deployment.engine import Engine, Event, QueueFull, SamplingParams
from llmscratch.finetuning.instruct import TEMPLATE_MARKERS, format_chat
from llmscratch.model.generate import prompt_ids as text_prompt_ids, with_bos
from llmscratch.text.chat_template import ChatTemplate

CHAT_STOP = TEMPLATE_MARKERS[0]  # "###": an instruction model that starts a new section has finished its answer


class APIError(Exception):
    """An error answered in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# --------------------------------------------------------------------------- the requests
class _Sampling(BaseModel):
    """The fields both endpoints share. Fields this server does not know are ignored (as vLLM's server does),
    so a client that sends more of OpenAI's options still gets an answer. Those below that this server cannot
    honour (n > 1, penalties, logprobs; echo and best_of for completions) are refused rather than ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)  # not in OpenAI's API; vLLM and llama.cpp take it too
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what a torch.Generator takes
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n}: this server answers one choice per request (n=1)", "unsupported", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported (it must be 0)", "unsupported", name)
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", "unsupported", "logprobs")

    def sampling(self, max_tokens: int, extra_stop: Sequence[str] = ()) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise APIError(400, f"stop has {len(stops)} strings; at most 4 are allowed", "invalid_value", "stop")
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                                  top_p=None if self.top_p == 1.0 else self.top_p, seed=self.seed,
                                  stop=tuple(stops) + tuple(extra_stop))
        except ValueError as err:
            raise APIError(400, str(err), "invalid_value") from None


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    best_of: int | None = None


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens


# --------------------------------------------------------------------------- keys and limits
class RateLimit:
    """At most ``per_minute`` requests per key in any 60 seconds (a sliding window of their times)."""

    def __init__(self, per_minute: int):
        self.per_minute = per_minute
        self.times: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self.lock = threading.Lock()

    def check(self, key: str) -> None:
        now = time.monotonic()
        with self.lock:
            times = self.times[key]
            while times and times[0] <= now - 60.0:
                times.popleft()
            if len(times) >= self.per_minute:
                retry = max(1, int(times[0] + 60.0 - now + 0.999))
                raise APIError(429, f"rate limit of {self.per_minute} requests per minute reached; retry in "
                                    f"{retry} s", "rate_limit_exceeded", headers={"Retry-After": str(retry)})
            times.append(now)


def bearer_key(request: Request, api_keys: Sequence[str]) -> str:
    """The caller's key (or its address when the server has no keys); 401 unless it is one of api_keys."""
    if not api_keys:
        return request.client.host if request.client else "anonymous"
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    given = key.strip().encode()  # bytes: compare_digest refuses str with non-ASCII characters
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(given, k.encode()) for k in api_keys):
        raise APIError(401, "a valid API key is required: send the header 'Authorization: Bearer KEY'",
                       "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return key.strip()


class Mailbox:
    """Events from the engine's thread to the event loop's queues, one wake-up of the loop for all of a step's.

    A wake-up per token (``call_soon_threadsafe`` each time) costs the loop, and the interpreter lock it shares
    with the engine, more than the tokens' own work once 16 streams run.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: list[tuple[asyncio.Queue, Event]] = []
        self.lock = threading.Lock()

    def post(self, events: asyncio.Queue, event: Event) -> None:
        with self.lock:
            self.pending.append((events, event))
            first = len(self.pending) == 1
        if first:  # the loop is not yet asked to deliver: ask once; later posts join the same delivery
            self.loop.call_soon_threadsafe(self.deliver)

    def deliver(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for events, event in pending:
            events.put_nowait(event)


# --------------------------------------------------------------------------- the app
def create_app(engine: Engine, *, model_name: str, api_keys: Sequence[str] = (),
               requests_per_minute: int | None = None, chat_stop: str = CHAT_STOP,
               chat_template: ChatTemplate | None = None) -> FastAPI:
    """The server's app; it starts the engine's thread when it starts serving and stops it at shutdown.

    model_name: what clients pass as "model" (and what /v1/models lists). api_keys: empty serves
    anyone who can connect (keep the host 127.0.0.1 then). requests_per_minute: per key, None: no limit.
    chat_template: a Hugging Face model's own chat format (its stop texts end an answer); None: ch05's
    instruction template, whose next section (chat_stop) ends an answer.
    """
    limit = RateLimit(requests_per_minute) if requests_per_minute else None
    tokenizer = engine.tokenizer
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="llmscratch", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_, err: APIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_, err: RequestValidationError):
        first = err.errors()[0]
        if first.get("type") == "json_invalid":
            return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                            "invalid_json").response()
        field = ".".join(str(part) for part in first.get("loc", ())[1:])
        if not field:  # the body as a whole: not a JSON object (a form, or JSON sent without its content type)
            return APIError(400, "the body must be a JSON object, sent with 'Content-Type: application/json'",
                            "invalid_json").response()
        return APIError(422, f"{field}: {first['msg']}", "invalid_value", field).response()

    def admit(request: Request, body: _Sampling) -> None:
        key = bearer_key(request, api_keys)
        if body.model != model_name:
            raise APIError(404, f"the model {body.model!r} is not served here; this server serves {model_name!r}",
                           "model_not_found", "model")
        body.check_supported()
        if limit is not None:
            limit.check(key)

    mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}

    def start(prompt_ids: list[int], params: SamplingParams) -> tuple[asyncio.Queue, object]:
        loop = asyncio.get_running_loop()
        mailbox = mailboxes.setdefault(loop, Mailbox(loop))
        events: asyncio.Queue[Event] = asyncio.Queue()
        try:
            handle = engine.submit(prompt_ids, params, lambda event: mailbox.post(events, event))
        except QueueFull as err:
            raise APIError(503, f"the server is busy ({err}); retry shortly", "server_busy",
                           headers={"Retry-After": "1"}) from None
        except ValueError as err:  # the prompt's ids, or prompt + max_tokens past the context
            too_long = "context" in str(err)
            raise APIError(400, str(err), "context_length_exceeded" if too_long else "invalid_value",
                           "max_tokens" if too_long else "prompt") from None
        return events, handle

    def room(prompt_ids: list[int], asked: int | None) -> int:
        """max_tokens as asked, or (chat, unset) all the room the context leaves."""
        return asked if asked is not None else max(1, engine.context_length - len(prompt_ids))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        admit(request, body)
        if body.echo or (body.best_of or 1) > 1:
            raise APIError(400, "echo and best_of > 1 are not supported", "unsupported")
        prompt_ids = body.prompt if isinstance(body.prompt, list) else text_prompt_ids(tokenizer, body.prompt)
        params = body.sampling(room(prompt_ids, body.max_tokens))
        return await answer(request, body, "text_completion", *start(prompt_ids, params))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        admit(request, body)
        messages = [message.model_dump() for message in body.messages]
        try:
            if chat_template is None:
                prompt_ids = with_bos(tokenizer, tokenizer.encode(format_chat(messages), disallowed_special=()))
            else:
                prompt_ids = chat_template.encode(messages, tokenizer)
        except ValueError as err:
            raise APIError(400, str(err), "invalid_value", "messages") from None
        stops = (chat_stop,) if chat_template is None else chat_template.stops
        params = body.sampling(room(prompt_ids, body.max_completion_tokens or body.max_tokens), stops)
        return await answer(request, body, "chat.completion", *start(prompt_ids, params))

    async def answer(request: Request, body: _Sampling, kind: str, events: asyncio.Queue, handle):
        """The answer whole (JSON) or streamed (server-sent events); either way the request ends if the client goes."""
        ident = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(sse(events, handle, ident, kind, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, event = [], None
        left = asyncio.ensure_future(disconnected(request))
        try:
            while event is None or event.finish_reason is None:
                next_event = asyncio.ensure_future(events.get())
                await asyncio.wait({next_event, left}, return_when=asyncio.FIRST_COMPLETED)
                if not next_event.done():  # the client has gone: nobody reads the answer
                    next_event.cancel()
                    return Response(status_code=499)
                event = next_event.result()
                text.append(event.text)
        finally:
            left.cancel()
            if event is None or event.finish_reason is None:  # left early (or the server is stopping)
                handle.cancel()
        if event.finish_reason == "error":
            raise APIError(500, f"generation failed: {event.error}", "server_error")
        if event.finish_reason == "cancelled":  # not by this client: the server is stopping
            raise APIError(503, "the server is shutting down; retry shortly", "server_shutting_down")
        return JSONResponse(whole(ident, kind, "".join(text), event))

    def whole(ident: str, kind: str, text: str, last: Event) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if kind == "chat.completion"
                  else {"index": 0, "text": text, "logprobs": None})
        choice["finish_reason"] = last.finish_reason
        return {"id": ident, "object": kind, "created": int(time.time()), "model": model_name, "choices": [choice],
                "usage": usage_of(last)}

    async def sse(events: asyncio.Queue, handle, ident: str, kind: str, usage: bool) -> AsyncIterator[str]:
        chat = kind == "chat.completion"
        head = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion", "model": model_name}

        def data(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        def chunk(text: str | None, finish_reason: str | None = None, role: bool = False) -> str:
            if chat:  # a delta: the first names the speaker, the last is empty beside its finish_reason
                delta = ({"role": "assistant"} if role else {}) | ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            return data(head | {"created": int(time.time()), "choices": [choice]})

        finished = False
        try:
            if chat:
                yield chunk("", role=True)
            while not finished:
                # What has arrived since the last write goes out in one write (a client or a loop behind
                # catches up at once rather than token by token).
                batch = [await events.get()]
                while not events.empty() and batch[-1].finish_reason is None:
                    batch.append(events.get_nowait())
                out = []
                for event in batch:
                    finished = event.finish_reason is not None
                    if event.finish_reason in ("error", "cancelled"):  # cancelled, not by us: the server is stopping
                        message = (f"generation failed: {event.error}" if event.finish_reason == "error"
                                   else "the server is shutting down; retry shortly")
                        out.append(data({"error": {"message": message, "type": "server_error", "param": None,
                                                   "code": "server_error"}}))
                        break
                    if event.text:
                        out.append(chunk(event.text))
                    if finished:
                        out.append(chunk(None, event.finish_reason))
                        if usage:
                            out.append(data(head | {"created": int(time.time()), "choices": [],
                                                    "usage": usage_of(event)}))
                if out:  # (text held back for a possible stop string makes no chunk yet)
                    yield "".join(out)
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client left mid-stream (the server cancelled this generator): free the row
                handle.cancel()

    @app.get("/v1/models")
    async def models(request: Request):
        bearer_key(request, api_keys)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "llmscratch"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "running": engine.running, "waiting": engine.queued}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return HTMLResponse((importlib.resources.files("llmscratch.deployment") / "chat.html").read_text("utf-8"))

    return app


async def disconnected(request: Request) -> None:
    """Return when the client closes its connection (its body was read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def usage_of(last: Event) -> dict:
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens}


def prometheus_text(engine: Engine) -> str:
    """The engine's state in Prometheus' text format: gauges, counters, and a summary of time to first token."""
    stats = engine.stats
    lines = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP llmscratch_{name} {help_text}", f"# TYPE llmscratch_{name} {kind}"])
        lines.extend(f"llmscratch_{name}{labels} {value:.6g}" for labels, value in samples)

    metric("queue_length", "gauge", "Requests waiting for a slot.", [("", engine.queued)])
    metric("running_sequences", "gauge", "Sequences being decoded (occupied slots).", [("", engine.running)])
    metric("slots", "gauge", "Sequences that can run at once.", [("", engine.max_slots)])
    metric("requests", "counter", "Requests accepted.", [("_total", stats.submitted)])
    metric("requests_finished", "counter", "Requests ended, by reason (stop, length, cancelled, error).",
           [(f'_total{{reason="{reason}"}}', count) for reason, count in sorted(stats.finished.items())])
    metric("prompt_tokens", "counter", "Prompt tokens prefilled.", [("_total", stats.prompt_tokens)])
    metric("generated_tokens", "counter", "Tokens generated.", [("_total", stats.tokens)])
    metric("tokens_per_second", "gauge", f"Tokens decoded per second over the last {stats.window:.0f} s.",
           [("", stats.tokens_per_second())])
    quantiles = stats.first_token_quantiles()
    metric("time_to_first_token_seconds", "summary", "Seconds from a request's arrival to its first token.",
           [(f'{{quantile="{q}"}}', v) for q, v in quantiles.items()]
           + [("_sum", stats.first_token_sum), ("_count", stats.first_token_count)])
    return "\n".join(lines) + "\n"
