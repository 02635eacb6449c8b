"""An OpenAI-compatible HTTP server over the continuous-batching engine, with a chat page.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (whole, or streamed as server-sent
events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text) and the chat page at ``/``. The requests and answers are the OpenAI API's, so
its official clients, curl scripts and chat front ends written for it work unchanged.

Guards at the door (``Guard``), from the headers alone, before a byte of the body is read: the Host
header on a keyless server (DNS rebinding), API keys (``Authorization: Bearer KEY``) when any are set,
with wrong keys throttled per address; a rate limit per key (per address without keys; 429 with
Retry-After); a cap on the body's size (413) and a deadline to send it (408). Then the engine's bounded
queue (503 at once when full), and requests checked before they reach the engine (400 / 422 naming the
field; 404 for a model not served). Parsing, tokenising and chat templates run in threads, so no request
holds up the event loop. A client that goes away has its request cancelled: the engine frees its row at
its next step. ``make_server`` runs the app under uvicorn with the same guards on the connection (a
deadline for the request's headers, forwarding headers only from named proxies, a grace period at
shutdown).
"""

import asyncio
import base64
import hashlib
import importlib.resources
import json
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from llmscratch.deployment.engine import Engine, Event, QueueFull, SamplingParams
from llmscratch.deployment.guard import MAX_BODY_BYTES, READ_TIMEOUT, APIError, Guard, RateLimit, host_names, http_error
from llmscratch.finetuning.instruct import TEMPLATE_MARKERS, format_chat
from llmscratch.model.generate import prompt_ids as text_prompt_ids
from llmscratch.model.generate import with_bos
from llmscratch.text.chat_template import ChatTemplate

CHAT_STOP = TEMPLATE_MARKERS[0]  # "###": an instruction model that starts a new section has finished its answer


# --------------------------------------------------------------------------- the requests
class _Sampling(BaseModel):
    """The fields both endpoints share. Fields this server does not know are ignored (as vLLM's server does),
    so a client that sends more of OpenAI's options still gets an answer. Those below that this server cannot
    honour (n > 1, penalties, logprobs; echo and best_of for completions) are refused rather than ignored.
    Values are taken as JSON types them (strict): "5" or true is not a number, and NaN or infinity is refused."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
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


class ContentPart(BaseModel):
    """One part of a message's content as OpenAI's clients send it: {"type": "text", "text": ...}."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's newer name for system
    content: str | list[ContentPart]

    def plain(self, index: int) -> dict[str, str]:
        """{"role", "content"} as the templates take it: developer as system, text parts joined by newlines."""
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, str):
            return {"role": role, "content": self.content}
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                what = f"of type {part.type!r}" if part.type != "text" else "of type 'text' without a 'text' string"
                raise APIError(400, f"messages[{index}].content[{j}]: a content part {what} is not supported; "
                                    f"this server takes text parts only", "unsupported", f"messages[{index}].content")
        return {"role": role, "content": "\n".join(part.text for part in self.content)}


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens


FIELD_NAMES = frozenset().union(*(model.model_fields for model in (CompletionRequest, ChatRequest, ChatMessage,
                                                                   ContentPart)))


def utf8_length(text: str, param: str) -> int:
    """The UTF-8 bytes of ``text``; APIError 400 where it holds a lone surrogate (JSON's "\\ud800"), which is no
    character: a tokenizer would drop it, or write U+FFFD, or fail."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as err:
        raise APIError(400, f"{param}: character {err.start} is a lone surrogate ({text[err.start]!r}), not Unicode "
                            "text", "invalid_value", param) from None


def parse_body(raw: bytes, kind: type[_Sampling]) -> _Sampling:
    """The request's body as ``kind``; APIError 400 if it is not a JSON object, 422 naming the first bad field.

    Runs in a thread: parsing takes time in proportion to the body.
    """
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise APIError(400, f"the body is not valid UTF-8 (byte {err.start})", "invalid_json") from None
    except RecursionError:
        raise APIError(400, "the body's JSON is nested too deeply", "invalid_json") from None
    except ValueError as err:
        raise APIError(400, f"the body is not valid JSON: {err}", "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object, sent with 'Content-Type: application/json'",
                       "invalid_json")
    try:
        return kind.model_validate(data)
    except ValidationError as err:
        # Of a union's branches (str | list[int]) pydantic reports each; the one that went deepest is what the
        # client meant. Its location holds the branch names too ("list[int]"): the field's name leaves them out.
        first = max(err.errors(), key=lambda error: len(error["loc"]))
        field = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]
                        if isinstance(part, int) or part in FIELD_NAMES).lstrip(".")
        raise APIError(422, f"{field}: {first['msg']}", "invalid_value", field) from None


# --------------------------------------------------------------------------- the engine's events
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
               chat_template: ChatTemplate | None = None, hosts: Sequence[str] = (),
               max_body_bytes: int = MAX_BODY_BYTES, read_timeout: float = READ_TIMEOUT) -> FastAPI:
    """The server's app; it starts the engine's thread when it starts serving and stops it at shutdown.

    model_name: what clients pass as "model" (and what /v1/models lists). api_keys: empty serves
    anyone who can connect (keep the host 127.0.0.1 then). requests_per_minute: per key, None: no limit.
    chat_template: a Hugging Face model's own chat format (its stop texts end an answer); None: ch05's
    instruction template, whose next section (chat_stop) ends an answer. hosts: the names a keyless
    server answers to besides loopback's (the address it listens on). max_body_bytes, read_timeout: a
    request's body is refused past this size (413) or when it takes longer to arrive (408).
    """
    limit = RateLimit(requests_per_minute) if requests_per_minute else None
    tokenizer = engine.tokenizer
    created = int(time.time())
    # The most UTF-8 bytes a prompt can have and still fit the context: each token stands for at most this many
    # (4: a character the vocabulary lacks; 3 times as many where normalizing first may merge characters).
    vocab = getattr(tokenizer, "vocab", None)  # id -> bytes (BPETokenizer, SentencePieceBPE); else no such bound
    token_bytes = max([4, *map(len, vocab.values()), *map(len, getattr(tokenizer, "special_tokens", ()))]
                      ) if isinstance(vocab, dict) else float("inf")
    max_prompt_bytes = token_bytes * engine.context_length * (3 if getattr(tokenizer, "normalization", None) else 1)
    stopping = threading.Event()

    def end_answers() -> None:
        """Refuse new requests and end the running ones (each with an error event): the server is stopping."""
        stopping.set()
        engine.stop()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    docs = {} if not api_keys else {"docs_url": None, "redoc_url": None, "openapi_url": None}  # no keyless door
    app = FastAPI(title="llmscratch", lifespan=lifespan, **docs)
    app.state.end_answers = end_answers  # make_server's shutdown calls it once the grace period is over
    app.add_middleware(Guard, api_keys=api_keys, hosts=host_names(hosts), limit=limit, max_body_bytes=max_body_bytes,
                       read_timeout=read_timeout)

    @app.exception_handler(APIError)
    async def api_error(_, err: APIError):
        return err.response()

    @app.exception_handler(HTTPException)
    async def starlette_error(request: Request, err: HTTPException):
        return http_error(request, err)

    async def parse(request: Request, kind: type[_Sampling]):
        body = await run_in_threadpool(parse_body, await request.body(), kind)
        if body.model != model_name:
            raise APIError(404, f"the model {body.model!r} is not served here; this server serves {model_name!r}",
                           "model_not_found", "model")
        body.check_supported()
        return body

    def fits(size: int, unit: str, param: str) -> None:
        """Refuse at once a prompt that cannot fit the context, before any work in proportion to it."""
        most = max_prompt_bytes if unit == "bytes" else engine.context_length
        if size > most:
            raise APIError(400, f"this model's context is {engine.context_length} tokens; {param} is {size} "
                                f"{unit} long, more than can fit", "context_length_exceeded", param)

    mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}

    def start(prompt_ids: list[int], params: SamplingParams) -> tuple[asyncio.Queue, object]:
        if stopping.is_set():
            raise APIError(503, "the server is shutting down; retry shortly", "server_shutting_down")
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

    def completion_ids(body: CompletionRequest) -> list[int]:
        if isinstance(body.prompt, list):
            fits(len(body.prompt), "tokens", "prompt")
            return body.prompt
        fits(utf8_length(body.prompt, "prompt"), "bytes", "prompt")
        try:
            return text_prompt_ids(tokenizer, body.prompt)
        except ValueError as err:  # text the tokenizer cannot take (a lone surrogate)
            raise APIError(400, f"prompt: {err}", "invalid_value", "prompt") from None

    def chat_ids(body: ChatRequest) -> list[int]:
        messages = [message.plain(i) for i, message in enumerate(body.messages)]
        fits(sum(utf8_length(m["content"], f"messages[{i}].content") for i, m in enumerate(messages)), "bytes",
             "messages")
        try:
            if chat_template is None:
                return with_bos(tokenizer, tokenizer.encode(format_chat(messages), disallowed_special=()))
            return chat_template.encode(messages, tokenizer)
        except ValueError as err:  # a conversation the template refuses, or a template that failed on it
            raise APIError(400, str(err), "invalid_value", "messages") from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        if body.echo or (body.best_of or 1) > 1:
            raise APIError(400, "echo and best_of > 1 are not supported", "unsupported")
        prompt_ids = await run_in_threadpool(completion_ids, body)
        params = body.sampling(room(prompt_ids, body.max_tokens))
        return await answer(request, body, "text_completion", *start(prompt_ids, params))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatRequest)
        prompt_ids = await run_in_threadpool(chat_ids, body)
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
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "llmscratch"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "running": engine.running, "waiting": engine.queued}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine), media_type="text/plain; version=0.0.4")

    page = (importlib.resources.files("llmscratch.deployment") / "chat.html").read_text("utf-8")
    page_headers = {"Content-Security-Policy": page_policy(page), "X-Frame-Options": "DENY",
                    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return HTMLResponse(page, headers=page_headers)

    return app


def page_policy(page: str) -> str:
    """The chat page's Content-Security-Policy: its own inline script and style (by their hashes) and requests to
    this server, nothing else; no frame may hold it (clickjacking)."""
    def hashes(tag: str) -> str:
        found = re.findall(f"<{tag}>(.*?)</{tag}>", page, flags=re.DOTALL)
        digests = (base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() for text in found)
        return " ".join(f"'sha256-{digest}'" for digest in digests)
    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; connect-src 'self'; "
            f"img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


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
