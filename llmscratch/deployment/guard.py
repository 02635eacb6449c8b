"""The server's door: what a request must pass before its body is read, and the connection it comes on.

``Guard`` (a plain ASGI middleware) decides from the headers alone: the Host header on a keyless server
(DNS rebinding), the API key (wrong keys throttled per address), the rate limit per key (per address
without keys; 429 with Retry-After), then reads the body under a cap (413) and a deadline (408).
``make_server`` runs an app under uvicorn with the connection's own guards: a deadline for a request's
headers (``TimedH11``), forwarding headers believed only from named proxies, and a grace period for
running answers at shutdown (``Server``). Every refusal is an ``APIError``, answered in OpenAI's shape.
"""

import asyncio
import collections
import hmac
import threading
import time
from collections.abc import Callable, Sequence

import uvicorn
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_BODY_BYTES = 4 * 2**20  # a request's body; a full context of token ids as JSON is far less


READ_TIMEOUT = 30.0  # seconds for a request's headers, and again for its body, to arrive whole


SHUTDOWN_GRACE = 10.0  # seconds running answers get to finish when the server stops; then they end with an error


WRONG_KEYS_PER_MINUTE = 10  # from one address; past it, every request from there that needs a key waits


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
TOKENIZER_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")  # vLLM's, outside /v1/: keyed like /v1/


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


def http_error(request: Request, err: HTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown route, a wrong method) in the OpenAI shape."""
    if err.status_code == 404:
        message, code = f"no route {request.method} {request.url.path}", "not_found"
    elif err.status_code == 405:
        message = f"{request.url.path} does not take {request.method}; it takes {err.headers.get('Allow', '?')}"
        code = "method_not_allowed"
    else:
        message, code = str(err.detail), "invalid_request"
    return APIError(err.status_code, message, code, headers=err.headers).response()


# --------------------------------------------------------------------------- keys and limits
class RateLimit:
    """At most ``per_minute`` events per client in any 60 seconds (a sliding window of their times).

    A client is forgotten a minute after its last event, and the table holds at most ``max_clients``: past
    that, the one seen least recently is forgotten first, so no stream of new names grows it without end.
    """

    def __init__(self, per_minute: int, max_clients: int = 10_000, window: float = 60.0):
        self.per_minute, self.max_clients, self.window = per_minute, max_clients, window
        self.times: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()
        self.lock = threading.Lock()

    def wait(self, client: str) -> int:
        """Whole seconds until ``client`` may act again; 0: now."""
        now = time.monotonic()
        with self.lock:
            self._forget(now)
            times = self.times.get(client)
            while times and times[0] <= now - self.window:
                times.popleft()
            if not times or len(times) < self.per_minute:
                return 0
            return max(1, int(times[0] + self.window - now + 0.999))

    def add(self, client: str) -> None:
        now = time.monotonic()
        with self.lock:
            self.times.setdefault(client, collections.deque()).append(now)
            self.times.move_to_end(client)  # least recently seen first: the order _forget drops them in
            self._forget(now)

    def _forget(self, now: float) -> None:
        while self.times:
            times = next(iter(self.times.values()))
            if len(self.times) <= self.max_clients and times[-1] > now - self.window:
                break
            self.times.popitem(last=False)

    def check(self, client: str) -> None:
        """Count one request of ``client``; APIError 429 with Retry-After if it has had its share."""
        retry = self.wait(client)
        if retry:
            raise APIError(429, f"rate limit of {self.per_minute} requests per minute reached; retry in {retry} s",
                           "rate_limit_exceeded", headers={"Retry-After": str(retry)})
        self.add(client)


def allowed_host(host_header: str, names: frozenset[str]) -> bool:
    """Whether a Host header ("name", "name:port", "[v6]:port") names one of ``names``."""
    host = host_header.strip().lower()
    name = host[:host.find("]") + 1] if host.startswith("[") else host.partition(":")[0]
    port = host[len(name):]
    return name in names and (not port or (port[0] == ":" and port[1:].isdigit()))


def host_names(hosts: Sequence[str]) -> frozenset[str]:
    """The names a Host header may give for a server listening on ``hosts``: loopback's, and theirs."""
    names = {host.lower() for host in hosts}
    names |= {f"[{host}]" for host in names if ":" in host and not host.startswith("[")}
    return frozenset(names) | frozenset(LOOPBACK_NAMES)


class Guard:
    """The door, a plain ASGI middleware: it reads a request's headers and decides before its body is read.

    In order: the Host header (a keyless server answers only to its own names, so a web page whose name
    an attacker points at 127.0.0.1 cannot use it); the API key for /v1/ (wrong keys are counted per
    address; past ``WRONG_KEYS_PER_MINUTE`` that address waits, right key or not); the rate limit of
    POST /v1/ requests (per key, per address without keys); then the body, read whole here up to
    ``max_body_bytes`` (413) within ``read_timeout`` seconds (408), and handed on to the app.
    """

    def __init__(self, app, *, api_keys: Sequence[str], hosts: frozenset[str], limit: RateLimit | None,
                 max_body_bytes: int, read_timeout: float):
        self.app, self.limit = app, limit
        self.keys = [key.encode() for key in api_keys]  # bytes: compare_digest refuses str outside ASCII
        self.hosts, self.max_body_bytes, self.read_timeout = hosts, max_body_bytes, read_timeout
        self.wrong_keys = RateLimit(WRONG_KEYS_PER_MINUTE)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        try:
            self.admit(scope, headers)
            receive = await self.read_body(headers, receive)
        except APIError as err:
            if has_body(headers):  # its body is not read: the connection cannot carry another request
                err.headers = {**(err.headers or {}), "Connection": "close"}
            return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)

    def admit(self, scope, headers: dict[str, str]) -> None:
        peer = scope["client"][0] if scope.get("client") else "unknown"
        if not self.keys and not allowed_host(headers.get("host", ""), self.hosts):
            raise APIError(400, f"the Host header {headers.get('host', '')!r} is not a name of this server; a keyless "
                                f"server answers to {', '.join(sorted(self.hosts))}", "invalid_host")
        client = peer
        if self.keys and guarded(scope["path"]):
            retry = self.wrong_keys.wait(peer)
            if retry:
                raise APIError(429, f"too many wrong API keys from this address; retry in {retry} s",
                               "too_many_wrong_keys", headers={"Retry-After": str(retry)})
            client = self.key(headers, peer)
        if self.limit is not None and scope["method"] == "POST" and guarded(scope["path"]):
            self.limit.check(client)

    def key(self, headers: dict[str, str], peer: str) -> str:
        """The caller's key; 401 unless it is one of the keys (a wrong one counts against its address)."""
        scheme, _, key = headers.get("authorization", "").partition(" ")
        given = key.strip().encode("latin-1")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(given, k) for k in self.keys):
            if "authorization" in headers:  # a guess; a request with no key at all guesses nothing
                self.wrong_keys.add(peer)
            raise APIError(401, "a valid API key is required: send the header 'Authorization: Bearer KEY'",
                           "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return key.strip()

    async def read_body(self, headers: dict[str, str], receive):
        """A receive that hands the app the whole body at once: read here, capped and with a deadline."""
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise self.too_large()
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.read_timeout
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise APIError(408, f"the request's body did not arrive within {self.read_timeout:g} s",
                               "request_timeout") from None
            if message["type"] != "http.request":  # the client left: the app hears it too
                return once(message, receive)
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                raise self.too_large()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return once({"type": "http.request", "body": b"".join(chunks), "more_body": False}, receive)

    def too_large(self) -> APIError:
        return APIError(413, f"the request's body is larger than this server takes ({self.max_body_bytes} bytes)",
                        "request_too_large")


def guarded(path: str) -> bool:
    """Whether a request for ``path`` needs a key (when keys are set) and counts against the rate limit."""
    return path.startswith("/v1/") or path in TOKENIZER_ROUTES


def has_body(headers: dict[str, str]) -> bool:
    return headers.get("content-length", "0") != "0" or "transfer-encoding" in headers


def once(message: dict, receive):
    """A receive that gives ``message`` first, then what ``receive`` gives (the client's disconnect)."""
    pending = [message]

    async def replay():
        return pending.pop() if pending else await receive()
    return replay


# --------------------------------------------------------------------------- the connection
class TimedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request line and headers do not arrive in time.

    uvicorn times out an idle connection only after a response; one that sends half a request line and
    waits would hold its socket forever. (Guard sets the body's deadline.)
    """

    header_timeout = READ_TIMEOUT
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        self._arm()  # before uvicorn starts a pipelined request: that one's cycle is new, so the timer spares it
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout, self._late, self.cycle)

    def _late(self, cycle) -> None:
        if self.cycle is cycle:  # no new request began since the timer was set
            self.transport.close()


class Server(uvicorn.Server):
    """uvicorn's server, whose shutdown lets running answers finish for ``grace`` seconds, then ends them."""

    def __init__(self, config: uvicorn.Config, grace: float, end_answers: Callable[[], None] | None):
        super().__init__(config)
        self.grace, self.end_answers = grace, end_answers

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        timer = None
        if self.end_answers is not None:  # from a thread: the engine's last step may take a moment
            timer = loop.call_later(self.grace, loop.run_in_executor, None, self.end_answers)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def make_server(app, host: str, port: int, *, trusted_proxies: Sequence[str] = (), read_timeout: float = READ_TIMEOUT,
                shutdown_grace: float = SHUTDOWN_GRACE, log_level: str = "warning") -> Server:
    """A uvicorn server for ``app`` (``server.run()`` serves until SIGINT or SIGTERM).

    trusted_proxies: the addresses whose X-Forwarded-For and X-Forwarded-Proto are believed (a reverse proxy in
    front); none by default, so the client's address is the socket's and no client can choose its own.
    read_timeout: seconds for a request's headers to arrive. shutdown_grace: seconds running answers get to
    finish at shutdown before they end with an error event.
    """
    protocol = type("TimedH11", (TimedH11,), {"header_timeout": read_timeout})
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                            proxy_headers=bool(trusted_proxies), forwarded_allow_ips=list(trusted_proxies) or None,
                            timeout_graceful_shutdown=int(shutdown_grace) + 10)  # a backstop past the grace
    state = getattr(app, "state", None)
    return Server(config, shutdown_grace, getattr(state, "end_answers", None))
