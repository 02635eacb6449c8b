"""An OpenAI-compatible HTTP server over the continuous-batching engine, with a chat page.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (whole, or streamed as server-sent
events ending with ``data: [DONE]``), ``GET /v1/models`` and ``/v1/models/{id}``, ``GET /health``,
``GET /metrics`` (Prometheus text) and the chat page at ``/``. The requests and answers are the OpenAI
API's, so its official clients, curl scripts and chat front ends written for it work unchanged. Completions
take what evaluation harnesses send (lm-evaluation-harness, for one): ``prompt`` as a list (a batch, one
choice each), ``logprobs`` (each token's log-probability and up to 20 alternatives) and ``echo`` (the
prompt's own tokens scored too, with ``max_tokens`` 0 allowed).

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

from llmscratch.deployment.engine import Engine
from llmscratch.deployment.guard import MAX_BODY_BYTES, READ_TIMEOUT, APIError, Guard, RateLimit, host_names, http_error
from llmscratch.deployment.requests import MAX_LOGPROBS, Event, QueueFull, SamplingParams, TokenLogprob
from llmscratch.finetuning.instruct import TEMPLATE_MARKERS, format_chat
from llmscratch.model.generate import prompt_ids as text_prompt_ids
from llmscratch.model.generate import with_bos
from llmscratch.text.chat_template import ChatTemplate

CHAT_STOP = TEMPLATE_MARKERS[0]  # "###": an instruction model that starts a new section has finished its answer
MAX_PROMPTS = 64  # prompts in one completions request (each its own request to the engine)


# --------------------------------------------------------------------------- the requests
class _Sampling(BaseModel):
    """The fields both endpoints share. Fields this server does not know are ignored (as vLLM's server does),
    so a client that sends more of OpenAI's options still gets an answer. Those below that this server cannot
    honour (n > 1, penalties; logprobs for chat, best_of for completions) are refused rather than ignored.
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

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n}: this server answers one choice per request (n=1)", "unsupported", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported (it must be 0)", "unsupported", name)

    def sampling(self, max_tokens: int, extra_stop: Sequence[str] = (), **options) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise APIError(400, f"stop has {len(stops)} strings; at most 4 are allowed", "invalid_value", "stop")
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                                  top_p=None if self.top_p == 1.0 else self.top_p, seed=self.seed,
                                  stop=tuple(stops) + tuple(extra_stop), **options)
        except ValueError as err:
            raise APIError(400, str(err), "invalid_value") from None


class CompletionRequest(_Sampling):
    """prompt: a text, a list of token ids, or a batch of either (a list of texts or of id lists)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions; 0 only with echo
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def check_supported(self) -> None:
        super().check_supported()
        if (self.best_of or 1) > 1:
            raise APIError(400, f"best_of={self.best_of} is not supported (it must be 1)", "unsupported", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: 0 asks for nothing without echo (the prompt's own logprobs)",
                           "invalid_value", "max_tokens")
        if self.stream and self.echo:
            raise APIError(400, "echo is not supported with stream", "unsupported", "echo")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a batch: one text or one id list makes a batch of one."""
        batch = self.prompt if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int) \
            else [self.prompt]
        if len(batch) > MAX_PROMPTS:
            raise APIError(400, f"prompt holds {len(batch)} prompts; at most {MAX_PROMPTS} are allowed in one request",
                           "invalid_value", "prompt")
        if len(batch) > 1 and self.stream:
            raise APIError(400, "a list of prompts cannot be streamed; send them one by one", "unsupported", "stream")
        return batch


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
    logprobs: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise APIError(400, "logprobs are not supported for chat (they are for /v1/completions)", "unsupported",
                           "logprobs")


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``, which lm-evaluation-harness uses as its tokenizer when a server offers it."""

    model_config = ConfigDict(extra="ignore", strict=True)
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    tokens: list[int]


FIELD_NAMES = frozenset().union(*(model.model_fields for model in (CompletionRequest, ChatRequest, ChatMessage,
                                                                   ContentPart, TokenizeRequest, DetokenizeRequest)))


def utf8_length(text: str, param: str) -> int:
    """The UTF-8 bytes of ``text``; APIError 400 where it holds a lone surrogate (JSON's "\\ud800"), which is no
    character: a tokenizer would drop it, or write U+FFFD, or fail."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as err:
        raise APIError(400, f"{param}: character {err.start} is a lone surrogate ({text[err.start]!r}), not Unicode "
                            "text", "invalid_value", param) from None


def parse_body(raw: bytes, kind: type[BaseModel]) -> BaseModel:
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

    def fits(size: int, param: str) -> None:
        """Refuse at once a text prompt of ``size`` UTF-8 bytes that cannot fit the context, before any work in
        proportion to it (tokenising it)."""
        if size > max_prompt_bytes:
            raise APIError(400, f"This model's maximum context length is {engine.context_length} tokens. However, "
                                f"your {param} is {size} bytes long, more than {engine.context_length} tokens can "
                                f"hold. "
                                f"Please reduce the length of the {param}.", "context_length_exceeded", param)

    def check_room(prompt_tokens: int, completion_tokens: int, param: str) -> None:
        """The context-length error in OpenAI's words, which clients (litellm, langchain) recognise as such."""
        asked = prompt_tokens + completion_tokens
        if asked > engine.context_length:
            raise APIError(400, f"This model's maximum context length is {engine.context_length} tokens. However, "
                                f"you requested {asked} tokens ({prompt_tokens} in the {param}, {completion_tokens} "
                                f"in the completion). Please reduce the length of the {param} or completion.",
                           "context_length_exceeded", param)

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

    def completion_ids(prompt: str | list[int], max_tokens: int | None) -> list[int]:
        if isinstance(prompt, list):
            check_room(len(prompt), room(prompt, max_tokens), "prompt")
            return prompt
        fits(utf8_length(prompt, "prompt"), "prompt")
        try:
            ids = text_prompt_ids(tokenizer, prompt)
        except ValueError as err:  # text the tokenizer cannot take (a lone surrogate)
            raise APIError(400, f"prompt: {err}", "invalid_value", "prompt") from None
        check_room(len(ids), room(ids, max_tokens), "prompt")
        return ids

    def chat_ids(body: ChatRequest) -> list[int]:
        messages = [message.plain(i) for i, message in enumerate(body.messages)]
        fits(sum(utf8_length(m["content"], f"messages[{i}].content") for i, m in enumerate(messages)), "messages")
        try:
            if chat_template is None:
                return with_bos(tokenizer, tokenizer.encode(format_chat(messages), disallowed_special=()))
            return chat_template.encode(messages, tokenizer)
        except ValueError as err:  # a conversation the template refuses, or a template that failed on it
            raise APIError(400, str(err), "invalid_value", "messages") from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        prompts = body.prompts()
        batch_ids = await run_in_threadpool(lambda: [completion_ids(prompt, body.max_tokens) for prompt in prompts])
        runs = []
        try:  # each prompt its own request; all of them or none
            for prompt_ids in batch_ids:
                params = body.sampling(room(prompt_ids, body.max_tokens), logprobs=body.logprobs,
                                       prompt_logprobs=body.echo)
                runs.append(start(prompt_ids, params))
        except APIError:
            for _, handle in runs:
                handle.cancel()
            raise
        # The prompts' texts lead the answers' (ids the engine took, so the tokenizer knows them)
        echoes = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts] if body.echo else None
        return await answer(request, body, "text_completion", runs, echoes)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatRequest)
        prompt_ids = await run_in_threadpool(chat_ids, body)
        stops = (chat_stop,) if chat_template is None else chat_template.stops
        max_tokens = room(prompt_ids, body.max_completion_tokens or body.max_tokens)
        check_room(len(prompt_ids), max_tokens, "messages")
        params = body.sampling(max_tokens, stops)
        return await answer(request, body, "chat.completion", [start(prompt_ids, params)])

    async def answer(request: Request, body: _Sampling, kind: str, runs: list[tuple[asyncio.Queue, object]],
                     echoes: list[str] | None = None):
        """The answer whole (JSON, a choice per run) or streamed (server-sent events, one run); either way the
        request ends if the client goes."""
        ident = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        logprobs = getattr(body, "logprobs", None) is not None and kind == "text_completion"
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(sse(*runs[0], ident, kind, usage, logprobs), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        results = await gather(request, runs)
        if results is None:  # the client has gone: nobody reads the answer
            return Response(status_code=499)
        for events in results:
            if events[-1].finish_reason == "error":
                raise APIError(500, f"generation failed: {events[-1].error}", "server_error")
            if events[-1].finish_reason == "cancelled":  # not by this client: the server is stopping
                raise APIError(503, "the server is shutting down; retry shortly", "server_shutting_down")
        choices = [choice(index, kind, events, logprobs, echoes[index] if echoes else "")
                   for index, events in enumerate(results)]
        usage = {key: sum(usage_of(events[-1])[key] for events in results) for key in usage_of(results[0][-1])}
        return JSONResponse({"id": ident, "object": kind, "created": int(time.time()), "model": model_name,
                             "choices": choices, "usage": usage})

    async def gather(request: Request, runs: list[tuple[asyncio.Queue, object]]) -> list[list[Event]] | None:
        """Each run's events up to its last; None if the client left first (then every run is cancelled)."""
        async def collect(events: asyncio.Queue) -> list[Event]:
            got = [await events.get()]
            while got[-1].finish_reason is None:
                got.append(await events.get())
            return got

        left = asyncio.ensure_future(disconnected(request))
        collecting = asyncio.ensure_future(asyncio.gather(*(collect(events) for events, _ in runs)))
        try:
            await asyncio.wait({collecting, left}, return_when=asyncio.FIRST_COMPLETED)
            return collecting.result() if collecting.done() else None
        finally:
            left.cancel()
            if not collecting.done():  # left early (or the server is stopping)
                collecting.cancel()
                for _, handle in runs:
                    handle.cancel()

    def choice(index: int, kind: str, events: list[Event], logprobs: bool, echo: str) -> dict:
        text = "".join(event.text for event in events)
        if kind == "chat.completion":
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "finish_reason": events[-1].finish_reason}
        block = None
        if logprobs:
            prompt = logprobs_block([e for event in events for e in event.prompt_logprobs or []], 0)
            block = logprobs_block([e for event in events for e in event.logprobs or []], len(echo))
            block = {key: prompt[key] + block[key] for key in block}
        return {"index": index, "text": echo + text, "logprobs": block, "finish_reason": events[-1].finish_reason}

    def token_text(token_id: int) -> str:
        return tokenizer.decode_bytes([token_id]).decode("utf-8", errors="replace")

    def logprobs_block(entries: list[TokenLogprob], offset: int) -> dict:
        """OpenAI's completions logprobs of these tokens, the first at character ``offset`` of the choice's text:
        each token's text, its logprob, the top alternatives' (and its own) by text, where each text begins."""
        block = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry in entries:
            top = None
            if entry.logprob is not None:
                top = {}
                for token_id, logprob in [*entry.top, (entry.token_id, entry.logprob)]:
                    top.setdefault(token_text(token_id), logprob)  # most likely first: a text two ids share keeps it
            text = token_text(entry.token_id)
            for key, value in zip(block, (text, entry.logprob, top, offset)):
                block[key].append(value)
            offset += len(text)
        return block

    async def sse(events: asyncio.Queue, handle, ident: str, kind: str, usage: bool,
                  logprobs: bool) -> AsyncIterator[str]:
        chat = kind == "chat.completion"
        head = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion", "model": model_name}

        def data(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        offset = 0  # where the next token's text begins in the whole answer (its logprobs' text_offset)

        def chunk(text: str | None, finish_reason: str | None = None, role: bool = False,
                  event: Event | None = None) -> str:
            nonlocal offset
            if chat:  # a delta: the first names the speaker, the last is empty beside its finish_reason
                delta = ({"role": "assistant"} if role else {}) | ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            else:
                block = None
                if logprobs and event is not None:
                    block = logprobs_block(event.logprobs or [], offset)
                    offset += sum(map(len, block["tokens"]))
                choice = {"index": 0, "text": text or "", "logprobs": block, "finish_reason": finish_reason}
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
                    if event.text or (logprobs and event.logprobs):  # a token's logprob goes out with it
                        out.append(chunk(event.text, event=event))
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
        return {"object": "list", "data": [await model(model_name)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise APIError(404, f"The model '{model_id}' does not exist; this server serves {model_name!r}",
                           "model_not_found", "model")
        return {"id": model_name, "object": "model", "created": created, "owned_by": "llmscratch"}

    # vLLM's tokenizer routes, which lm-evaluation-harness uses as its tokenizer when a server offers them (the
    # guard asks for a key there too)
    @app.get("/tokenizer_info")
    async def tokenizer_info():
        eos = None if tokenizer.eot_token is None else tokenizer.decode([tokenizer.eot_token])
        bos = getattr(tokenizer, "bos_id", None)
        return {"eos_token": eos, "bos_token": None if bos is None else tokenizer.decode([bos]),
                "model_max_length": engine.context_length, "tokenizer_class": type(tokenizer).__name__}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await run_in_threadpool(parse_body, await request.body(), TokenizeRequest)
        fits(utf8_length(body.prompt, "prompt"), "prompt")  # bounded work, as for a prompt

        def encode() -> list[int]:
            ids = tokenizer.encode(body.prompt, allowed_special="all")
            return with_bos(tokenizer, ids) if body.add_special_tokens else ids
        ids = await run_in_threadpool(encode)
        return {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await run_in_threadpool(parse_body, await request.body(), DetokenizeRequest)
        if len(body.tokens) > engine.context_length or any(not 0 <= i < engine.vocab_size for i in body.tokens):
            raise APIError(400, f"tokens: at most {engine.context_length} ids, each in 0..{engine.vocab_size - 1}",
                           "invalid_value", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

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
    metric("running_sequences", "gauge", "Sequences being prefilled or decoded (occupied slots).",
           [("", engine.running)])
    metric("slots", "gauge", "Sequences that can run at once.", [("", engine.max_slots)])
    metric("requests", "counter", "Requests accepted.", [("_total", stats.submitted)])
    metric("requests_finished", "counter", "Requests ended, by reason (stop, length, cancelled, error).",
           [(f'_total{{reason="{reason}"}}', count) for reason, count in sorted(stats.finished.items())])
    metric("kv_cache_usage", "gauge", "Share of the KV cache's blocks that running sequences hold (0 to 1).",
           [("", engine.cache.usage())])
    metric("kv_cache_bytes", "gauge", "Bytes of the KV cache's pool.", [("", engine.cache_bytes)])
    metric("preempted", "counter", "Sequences preempted when the KV cache was full (recomputed when readmitted).",
           [("_total", stats.preempted)])
    metric("prompt_tokens", "counter", "Prompt tokens of the requests admitted.", [("_total", stats.prompt_tokens)])
    metric("prompt_tokens_cached", "counter", "Prompt tokens whose keys and values came from a shared prefix.",
           [("_total", stats.cached_tokens)])
    metric("generated_tokens", "counter", "Tokens generated.", [("_total", stats.tokens)])
    metric("tokens_per_second", "gauge", f"Tokens decoded per second over the last {stats.window:.0f} s.",
           [("", stats.tokens_per_second())])
    quantiles = stats.first_token_quantiles()
    metric("time_to_first_token_seconds", "summary", "Seconds from a request's arrival to its first token.",
           [(f'{{quantile="{q}"}}', v) for q, v in quantiles.items()]
           + [("_sum", stats.first_token_sum), ("_count", stats.first_token_count)])
    return "\n".join(lines) + "\n"
