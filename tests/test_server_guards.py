"""The server's guards against abuse and faults (issue 50), through real HTTP and raw sockets on 127.0.0.1.

Who a client is (its key, else its socket's address: never what it writes in X-Forwarded-For), wrong keys
throttled, the key checked before the body is read, the body capped, prompts that cannot fit refused before
they are tokenised, tokenising off the event loop, half-sent requests timed out, the Host header of a keyless
server, errors in OpenAI's shape, content parts and the developer role, and streams ended at shutdown.
Every server runs in a thread with start and stop deadlines (tests/serving.py); every socket and client call
has a timeout, so a hang fails in seconds.
"""

import json
import runpy
import socket
import threading
import time
import types
from urllib.parse import urlsplit

import httpx
import pytest
import torch
from scripts import SCRIPTS, run_script
from serving import running_server

from llmscratch.cli import DEFAULT_MODELS
from llmscratch.deployment import guard as guard_module
from llmscratch.deployment.engine import Engine
from llmscratch.deployment.guard import RateLimit
from llmscratch.deployment.server import create_app
from llmscratch.model.weights import load_model_and_tokenizer

pytestmark = [pytest.mark.timeout(120)]
TIMEOUT = 30.0
KEY = "sk-right"


@pytest.fixture(scope="module")
def base():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODELS["base"][0])
    yield model.float().eval(), tokenizer
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def keyless(base):
    model, tokenizer = base
    engine = Engine(model, tokenizer, max_slots=4)
    app = create_app(engine, model_name="base", max_body_bytes=64 * 1024, read_timeout=1.0)
    with running_server(app, read_timeout=1.0) as url:
        yield url, engine


@pytest.fixture(scope="module")
def keyed(base):
    model, tokenizer = base
    with running_server(create_app(Engine(model, tokenizer, max_slots=2), model_name="base", api_keys=[KEY])) as url:
        yield url


def raw(url: str, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection, then read what comes back until the server closes it."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def post(url: str, body, **options) -> httpx.Response:
    return httpx.post(url, json=body, timeout=TIMEOUT, **options)


def error_of(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, response.text  # OpenAI's shape, not FastAPI's
    return error


COMPLETION = {"model": "base", "prompt": "Ahab", "max_tokens": 1}


# --------------------------------------------------------------------------- who the client is
@pytest.mark.parametrize("header", ["X-Forwarded-For", "x-forwarded-for"])
def test_a_client_cannot_choose_its_address_to_escape_the_rate_limit(base, header):
    model, tokenizer = base
    app = create_app(Engine(model, tokenizer, max_slots=2), model_name="base", requests_per_minute=1)
    with running_server(app) as url:
        codes = [post(f"{url}/v1/completions", COMPLETION, headers={header: f"10.0.0.{i}"}).status_code
                 for i in range(3)]
    assert codes == [200, 429, 429]


def test_forwarding_headers_count_only_from_a_named_proxy(base):
    model, tokenizer = base
    app = create_app(Engine(model, tokenizer, max_slots=2), model_name="base", requests_per_minute=1)
    with running_server(app, trusted_proxies=["127.0.0.1"]) as url:  # the proxy is this machine: believed
        codes = [post(f"{url}/v1/completions", COMPLETION, headers={"X-Forwarded-For": f"10.0.0.{i}"}).status_code
                 for i in (1, 2, 1)]
    assert codes == [200, 200, 429]


def test_with_keys_the_limit_follows_the_key_whatever_the_address(base):
    model, tokenizer = base
    app = create_app(Engine(model, tokenizer, max_slots=2), model_name="base", api_keys=["a", "b"],
                     requests_per_minute=1)
    with running_server(app, trusted_proxies=["127.0.0.1"]) as url:
        codes = [post(f"{url}/v1/completions", COMPLETION, headers={"Authorization": f"Bearer {key}",
                                                                     "X-Forwarded-For": f"10.0.0.{i}"}).status_code
                 for i, key in enumerate("aab")]
    assert codes == [200, 429, 200]


def test_wrong_keys_are_throttled_per_address_even_for_the_right_key_then(base):
    model, tokenizer = base
    with running_server(create_app(Engine(model, tokenizer, max_slots=1), model_name="base", api_keys=[KEY])) as url:
        wrong_keys_then_right(url)


def wrong_keys_then_right(keyed: str) -> None:
    codes = [httpx.get(f"{keyed}/v1/models", headers={"Authorization": f"Bearer guess-{i}"},
                       timeout=TIMEOUT).status_code for i in range(guard_module.WRONG_KEYS_PER_MINUTE + 2)]
    assert codes[:guard_module.WRONG_KEYS_PER_MINUTE] == [401] * guard_module.WRONG_KEYS_PER_MINUTE
    assert codes[-2:] == [429, 429]
    right = httpx.get(f"{keyed}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT)
    assert right.status_code == 429 and 1 <= int(right.headers["retry-after"]) <= 60
    assert "wrong API keys" in error_of(right)["message"]
    assert httpx.get(f"{keyed}/health", timeout=TIMEOUT).status_code == 200  # what needs no key stays open


def test_the_limiters_table_forgets_old_clients_and_stays_bounded(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(guard_module.time, "monotonic", lambda: now[0])
    limit = RateLimit(2, max_clients=100)
    for i in range(1000):
        limit.check(f"10.0.{i // 256}.{i % 256}")
    assert len(limit.times) == 100  # the most recent hundred
    limit.check("a")
    limit.check("a")
    with pytest.raises(guard_module.APIError) as refused:
        limit.check("a")
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "60"
    now[0] += 61.0
    limit.check("b")
    assert list(limit.times) == ["b"]  # a minute later every earlier client is forgotten
    limit.check("a")  # and "a" may ask again


# --------------------------------------------------------------------------- the door before the body
def test_a_wrong_key_is_refused_before_a_large_body_is_read(keyed):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer wrong\r\n"
            f"Content-Type: application/json\r\nContent-Length: {20 * 2**20}\r\n\r\n").encode()
    answer = raw(keyed, head + b'{"model": "base", "prompt": "' + b"x" * 1000)  # the other 20 MB never come
    assert answer.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in answer


@pytest.mark.parametrize("body", [b"{not json", b'{"model": 3}', b'{"model": "base", "prompt": "x", "n": "x"}'])
def test_a_bad_body_with_a_wrong_key_gets_401_not_a_description_of_the_body(keyed, body):
    response = httpx.post(f"{keyed}/v1/completions", content=body, timeout=TIMEOUT,
                          headers={"Authorization": "Bearer nope", "Content-Type": "application/json"})
    assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"


def test_a_body_over_the_cap_is_refused_from_its_length_at_once(keyless):
    url, _ = keyless
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 209715200\r\n\r\n")
    answer = raw(url, head + b"{")  # 200 MB announced; none of it is waited for
    assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer


def test_a_chunked_body_is_refused_when_it_passes_the_cap(keyless):
    url, _ = keyless
    sent = []

    def chunks():  # no Content-Length: the cap is found while reading
        for _ in range(1000):
            sent.append(1)
            yield b" " * 4096
    response = httpx.post(f"{url}/v1/completions", content=chunks(), timeout=TIMEOUT,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"


def test_half_sent_headers_are_closed_after_the_read_timeout(keyless):
    url, _ = keyless
    assert raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n") == b""  # closed, not held forever
    assert raw(url, b"GE") == b""


def test_a_body_that_never_finishes_gets_408(keyless):
    url, _ = keyless
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n"
    answer = raw(url, head + b'{"model": ')
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer


# --------------------------------------------------------------------------- prompts that cannot fit
class Spy:
    """Counts the calls of a function (and may hold them until released), then calls it."""

    def __init__(self, function, hold: threading.Event | None = None):
        self.function, self.hold, self.calls = function, hold, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.hold is not None:
            assert self.hold.wait(TIMEOUT), "never released"
        return self.function(*args, **kwargs)


@pytest.mark.parametrize("endpoint, body", [
    ("completions", {"model": "base", "prompt": "whale " * 10_000, "max_tokens": 1}),
    ("completions", {"model": "base", "prompt": "é" * 30_000, "max_tokens": 1}),
    ("chat/completions", {"model": "base", "messages": [{"role": "user", "content": "sea " * 15_000}]}),
    ("chat/completions", {"model": "base", "messages": [{"role": "system", "content": "a" * 8000},
                                                        {"role": "user", "content": "b" * 8000}]}),
])
def test_a_text_prompt_that_cannot_fit_is_refused_before_it_is_tokenised(keyless, monkeypatch, endpoint, body):
    url, engine = keyless
    spy = Spy(engine.tokenizer.encode)
    monkeypatch.setattr(engine.tokenizer, "encode", spy)
    response = post(f"{url}/v1/{endpoint}", body)
    assert response.status_code == 400 and error_of(response)["code"] == "context_length_exceeded"
    assert spy.calls == 0


def test_a_token_list_longer_than_the_context_is_refused_before_the_engine(keyless, monkeypatch):
    url, engine = keyless
    spy = Spy(engine.submit)
    monkeypatch.setattr(engine, "submit", spy)
    response = post(f"{url}/v1/completions", {"model": "base", "prompt": [7] * 5000, "max_tokens": 1})
    assert response.status_code == 400 and "context" in error_of(response)["message"] and spy.calls == 0
    assert post(f"{url}/v1/completions", {"model": "base", "prompt": [7] * 10, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("endpoint, body", [
    ("completions", {"model": "base", "prompt": "Call me Ishmael.", "max_tokens": 1}),
    ("chat/completions", {"model": "base", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
])
def test_tokenising_runs_off_the_event_loop(keyless, monkeypatch, endpoint, body):
    url, engine = keyless
    release = threading.Event()
    spy = Spy(engine.tokenizer.encode, hold=release)
    monkeypatch.setattr(engine.tokenizer, "encode", spy)
    answers = []
    thread = threading.Thread(target=lambda: answers.append(post(f"{url}/v1/{endpoint}", body)), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while spy.calls == 0:  # the request is now held inside the tokenizer
            assert time.monotonic() < deadline
            time.sleep(0.01)
        health = httpx.get(f"{url}/health", timeout=10.0)  # the loop still answers while it tokenises
        assert health.status_code == 200
    finally:
        release.set()
        thread.join(TIMEOUT)
    assert answers[0].status_code == 200


# --------------------------------------------------------------------------- Host header and docs
@pytest.mark.parametrize("host, allowed", [
    ("127.0.0.1", True), ("localhost:8000", True), ("LOCALHOST", True), ("[::1]:8000", True),
    ("evil.example", False), ("evil.example:8000", False), ("localhost.evil.example", False),
    ("127.0.0.1.nip.io", False), ("localhost:80x", False), ("", False),
])
def test_a_keyless_server_answers_only_to_its_own_names(keyless, host, allowed):
    url, _ = keyless
    response = httpx.get(f"{url}/v1/models", headers={"Host": host}, timeout=TIMEOUT)
    if allowed:
        assert response.status_code == 200
    else:
        assert response.status_code == 400 and error_of(response)["code"] == "invalid_host"


def test_a_keyless_server_answers_to_the_host_it_listens_on_too(base):
    model, tokenizer = base
    app = create_app(Engine(model, tokenizer, max_slots=1), model_name="base", hosts=["my-box.lan"])
    with running_server(app) as url:
        assert httpx.get(f"{url}/health", headers={"Host": "my-box.lan:8000"}, timeout=TIMEOUT).status_code == 200
        assert httpx.get(f"{url}/health", headers={"Host": "other.lan"}, timeout=TIMEOUT).status_code == 400


def test_a_keyed_server_takes_any_host_and_hides_its_api_docs(keyed, keyless):
    assert httpx.get(f"{keyed}/health", headers={"Host": "api.example.com"}, timeout=TIMEOUT).status_code == 200
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(keyed + path, timeout=TIMEOUT).status_code == 404, path
    assert httpx.get(keyless[0] + "/openapi.json", timeout=TIMEOUT).status_code == 200  # loopback-only: open


def test_the_chat_page_forbids_framing_and_foreign_scripts(keyless):
    page = httpx.get(keyless[0] + "/", timeout=TIMEOUT)
    assert page.headers["x-frame-options"] == "DENY" and page.headers["x-content-type-options"] == "nosniff"
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy and "'sha256-" in policy
    assert "unsafe-inline" not in policy and "connect-src 'self'" in policy
    assert "localStorage" not in page.text  # the API key is kept for the tab only


# --------------------------------------------------------------------------- errors in OpenAI's shape
@pytest.mark.parametrize("method, path, content, status, words", [
    ("POST", "/v1/nowhere", b"{}", 404, "no route POST /v1/nowhere"),
    ("GET", "/v1/completions", None, 405, "does not take GET"),
    ("POST", "/v1/completions", b"[" * 60_000, 400, "nested too deeply"),
    ("POST", "/v1/completions", b'{"model": "base", "prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
    ("POST", "/v1/chat/completions", b'{"model": "base", "messages": ' + b'{"a": ' * 9000, 400, "nested too deeply"),
])
def test_errors_come_in_openais_shape(keyless, method, path, content, status, words):
    url, _ = keyless
    response = httpx.request(method, url + path, content=content, timeout=TIMEOUT,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == status and words in error_of(response)["message"], response.text


@pytest.mark.parametrize("body, field", [
    ({"model": "base", "prompt": [1, "a"]}, "prompt[1]"),
    ({"model": "base", "prompt": {"a": 1}}, "prompt"),
    ({"model": "base", "messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0].type"),
    ({"model": "base", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "base", "prompt": "x", "stop": [1]}, "stop[0]"),
])
def test_errors_name_the_field_plainly_not_a_pydantic_branch(keyless, body, field):
    url, _ = keyless
    response = post(f"{url}/v1/{'chat/completions' if 'messages' in body else 'completions'}", body)
    error = error_of(response)
    assert response.status_code == 422 and error["message"].startswith(f"{field}: ") and error["param"] == field
    assert "list[" not in error["message"] and ".str" not in error["message"]


@pytest.mark.parametrize("body, field, words", [
    ({"model": "base", "prompt": "x", "max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"model": "base", "prompt": "x", "max_tokens": True}, "max_tokens", "valid integer"),
    ({"model": "base", "prompt": [1, True]}, "prompt[1]", "valid integer"),
    ({"model": "base", "prompt": "x", "temperature": "0.5"}, "temperature", "valid number"),
    ({"model": "base", "prompt": "x", "top_p": float("nan")}, "top_p", "finite number"),
    ({"model": "base", "prompt": "x", "temperature": float("inf")}, "temperature", "finite number"),
])
def test_values_are_taken_as_json_types_them(keyless, body, field, words):
    """A string or true is not a number, and NaN is no temperature: refused by name, not taken as 5, 1 or 2."""
    url, _ = keyless
    response = httpx.post(f"{url}/v1/completions", content=json.dumps(body), timeout=TIMEOUT,
                          headers={"Content-Type": "application/json"})
    error = error_of(response)
    assert response.status_code == 422 and error["param"] == field and words in error["message"], response.text


@pytest.mark.parametrize("endpoint, body, param", [
    ("completions", '{"model": "base", "prompt": "Ahab \\ud800 whale", "max_tokens": 1}', "prompt"),
    ("chat/completions", '{"model": "base", "messages": [{"role": "user", "content": "hi"}, '
                         '{"role": "user", "content": "\\udfff"}], "max_tokens": 1}', "messages[1].content"),
])
def test_a_lone_surrogate_is_refused_by_name(keyless, endpoint, body, param):
    url, _ = keyless
    response = httpx.post(f"{url}/v1/{endpoint}", content=body.encode(), timeout=TIMEOUT,
                          headers={"Content-Type": "application/json"})
    error = error_of(response)
    assert response.status_code == 400 and error["param"] == param and "lone surrogate" in error["message"], \
        response.text


# --------------------------------------------------------------------------- what OpenAI's clients send
def chat(url: str, messages: list[dict]) -> httpx.Response:
    return post(f"{url}/v1/chat/completions", {"model": "base", "messages": messages, "max_tokens": 8,
                                               "temperature": 0})


def test_content_parts_are_text_joined(keyless):
    url, _ = keyless
    parts = chat(url, [{"role": "user", "content": [{"type": "text", "text": "Name a"},
                                                    {"type": "text", "text": "sea creature."}]}])
    joined = chat(url, [{"role": "user", "content": "Name a\nsea creature."}])
    assert parts.status_code == 200 and parts.json()["choices"] == joined.json()["choices"]


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:,"}},
                                  {"type": "input_audio", "input_audio": {}}])
def test_other_content_parts_are_refused_by_type(keyless, part):
    url, _ = keyless
    response = chat(url, [{"role": "user", "content": [{"type": "text", "text": "Look:"}, part]}])
    error = error_of(response)
    assert response.status_code == 400 and repr(part["type"]) in error["message"]
    assert "messages[0].content[1]" in error["message"]


def test_the_developer_role_is_a_system_message(keyless):
    url, _ = keyless
    developer = chat(url, [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}])
    system = chat(url, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}])
    assert developer.status_code == 200 and developer.json()["choices"] == system.json()["choices"]


# --------------------------------------------------------------------------- shutdown
def test_shutdown_ends_running_streams_with_an_error_after_the_grace_period(base, monkeypatch):
    model, tokenizer = base
    engine = Engine(model, tokenizer, max_slots=2)
    decode = engine._decode

    def slow_decode():  # a model slow enough that the stream is still running when the server stops
        time.sleep(0.05)
        decode()
    monkeypatch.setattr(engine, "_decode", slow_decode)
    lines = []
    body = {"model": "base", "prompt": "Call me", "max_tokens": 250, "stream": True}

    def read():
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as response:
            lines.extend(line for line in response.iter_lines() if line)
    with running_server(create_app(engine, model_name="base"), shutdown_grace=0.5, stop_timeout=20) as url:
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + TIMEOUT
        while len(lines) < 3:  # streaming
            assert time.monotonic() < deadline and reader.is_alive()
            time.sleep(0.01)
    reader.join(TIMEOUT)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["error"]["message"] == "the server is shutting down; retry shortly"
    assert engine.stats.finished["length"] == 0


# --------------------------------------------------------------------------- the script
def test_serve_py_announces_a_quantized_model_as_what_it_is():
    precision = runpy.run_path(str(SCRIPTS["serve"]))["precision"]

    quantized = types.SimpleNamespace(quantization={"scheme": "int4", "group_size": 64, "head": True})
    assert precision(quantized, "float32") == "int4 weights (group 64, int8 head), the rest float32"
    assert precision(object(), "bfloat16") == "bfloat16"


@pytest.mark.parametrize("argv, words", [
    (["--trusted-proxy", "my-proxy"], "--trusted-proxy my-proxy: not an IP address"),
    (["--max-body-mib", "0"], "--max-body-mib must be more than 0"),
    (["--read-timeout", "nan"], "--read-timeout must be more than 0"),
    (["--shutdown-grace", "-1"], "--shutdown-grace must be 0 or more"),
])
def test_serve_py_refuses_bad_guard_flags_by_name(argv, words, capsys, monkeypatch):
    monkeypatch.delenv("LLMSCRATCH_API_KEYS", raising=False)
    assert run_script("serve", argv) == 2
    assert words in capsys.readouterr().err
