"""The OpenAI-compatible server (llmscratch.deployment.server) through real HTTP on 127.0.0.1: the official openai
client, streaming, concurrency, keys, rate limit, a full queue, malformed requests and clients that leave.

Every server runs in a thread with start and stop deadlines (tests/serving.py); every client call has a timeout
and every polling loop a deadline, so a hang fails in seconds.
"""

import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
from scripts import SCRIPTS, run_script
from serving import free_port, running_server

from llmscratch.deployment.engine import Engine
from llmscratch.deployment.server import create_app
from llmscratch.finetuning.instruct import format_chat
from llmscratch.model.generate import generate

pytestmark = [pytest.mark.timeout(300)]
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def server(served_model):
    model, tokenizer = served_model
    engine = Engine(model, tokenizer, max_slots=16)
    with running_server(create_app(engine, model_name="base")) as url:
        yield url, engine


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=TIMEOUT)


def greedy(base, prompt: str, max_tokens: int) -> str:
    model, tokenizer = base
    ids = tokenizer.encode(prompt)
    out = generate(model, torch.tensor([ids]), max_tokens, eos_id=tokenizer.eot_token, vocab_size=tokenizer.n_vocab)
    new = [i for i in out[0, len(ids):].tolist() if i != tokenizer.eot_token]
    return tokenizer.decode(new)


def wait_until(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not so after {seconds} s")
        time.sleep(0.02)


# --------------------------------------------------------------------------- the official client
def test_the_openai_client_gets_generates_greedy_answer_whole_and_streamed(server, base):
    url, engine = server
    api = client(url)
    assert [m.id for m in api.models.list().data] == ["base"]
    expected = greedy(base, "Call me Ishmael.", 24)
    whole = api.completions.create(model="base", prompt="Call me Ishmael.", max_tokens=24, temperature=0)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 24 and whole.usage.prompt_tokens == len(base[1].encode("Call me Ishmael."))
    pieces = [chunk.choices[0].text for chunk in api.completions.create(
        model="base", prompt="Call me Ishmael.", max_tokens=24, temperature=0, stream=True) if chunk.choices]
    assert len([p for p in pieces if p]) > 5 and "".join(pieces) == expected  # token by token, the same text


def test_chat_through_the_openai_client_is_the_instruction_prompt_streamed(server, base):
    url, engine = server
    api = client(url)
    messages = [{"role": "user", "content": "Name a sea creature."}]
    prompt = format_chat(messages)
    expected = greedy(base, prompt, 12).split("###")[0]
    answer = api.chat.completions.create(model="base", messages=messages, max_tokens=12, temperature=0)
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].message.content == expected
    chunks = list(api.chat.completions.create(model="base", messages=messages, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")


def test_the_stream_is_server_sent_events_ending_with_done(server):
    url, _ = server
    body = {"model": "base", "prompt": "Ahab", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[0]["object"] == "text_completion"


def test_sixteen_concurrent_requests_each_equal_their_solo_result_and_free_their_slots(base):
    model, tokenizer = base
    rng = random.Random(3)
    prompts = ["Call me Ishmael.", "The whale", "Queequeg said", "Ahab", "There she blows!", "The sea was",
               "Starbuck", "In the morning"]
    requests = [dict(model="base", prompt=prompts[i % len(prompts)], max_tokens=rng.randint(3, 40),
                     temperature=rng.choice([0.0, 0.8, 1.3]), top_p=rng.choice([1.0, 0.9]), seed=i,
                     stop=rng.choice([None, ["\n"], [" the", "!"]])) for i in range(16)]
    engine = Engine(model, tokenizer, max_slots=16, batch_shape="fixed")  # a row's sums never depend on the others
    with running_server(create_app(engine, model_name="base")) as url:
        api = client(url)
        solo = [api.completions.create(**r).choices[0] for r in requests]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            together = [f.result(TIMEOUT) for f in [pool.submit(api.completions.create, **r) for r in requests]]
        wait_until(lambda: engine.running == 0)
        assert engine.queued == 0 and engine.stats.finished["cancelled"] == 0
    assert max(engine.stats.first_token_seconds) < TIMEOUT
    for r, alone, crowd in zip(requests, solo, together):
        assert crowd.choices[0].text == alone.text and crowd.choices[0].finish_reason == alone.finish_reason, r
    assert len({a.text for a in solo}) > 8  # different settings gave different answers


# --------------------------------------------------------------------------- keys, limits, queue
def test_keys_are_required_when_set_and_the_rate_limit_answers_429_with_retry_after(base):
    model, tokenizer = base
    app = create_app(Engine(model, tokenizer, max_slots=2), model_name="base", api_keys=["k1", "k2"],
                     requests_per_minute=3)
    with running_server(app) as url:
        with pytest.raises(openai.AuthenticationError, match="Authorization: Bearer"):
            client(url, "wrong").models.list()
        not_ascii = {"Authorization": "Bearer \xe9t\xe9".encode("latin-1")}
        odd = httpx.get(f"{url}/v1/models", headers=not_ascii, timeout=TIMEOUT)
        assert odd.status_code == 401  # a key outside ASCII is refused like any other wrong key
        bare = httpx.post(f"{url}/v1/completions", json={"model": "base", "prompt": "x"}, timeout=TIMEOUT)
        assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200  # health and metrics stay open
        first = client(url, "k1")
        for _ in range(3):
            first.completions.create(model="base", prompt="x", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as refused:
            first.completions.create(model="base", prompt="x", max_tokens=1)
        assert 1 <= int(refused.value.response.headers["retry-after"]) <= 60
        client(url, "k2").completions.create(model="base", prompt="x", max_tokens=1)  # each key has its own limit


def test_a_full_queue_answers_503_at_once(base):
    model, tokenizer = base
    engine = Engine(model, tokenizer, max_slots=1, max_waiting=1)
    with running_server(create_app(engine, model_name="base")) as url:
        body = {"model": "base", "prompt": "Call me", "max_tokens": 200, "stream": True}
        with httpx.Client(timeout=TIMEOUT) as http:
            with http.stream("POST", f"{url}/v1/completions", json=body) as running:
                wait_until(lambda: engine.running == 1)
                with http.stream("POST", f"{url}/v1/completions", json=body) as waiting:
                    wait_until(lambda: engine.queued == 1)
                    started = time.monotonic()
                    full = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
                    assert full.status_code == 503 and time.monotonic() - started < 5
                    assert "busy" in full.json()["error"]["message"] and full.headers["retry-after"] == "1"
                    assert running.status_code == 200 and waiting.status_code == 200
        wait_until(lambda: engine.running == 0 and engine.queued == 0)  # the two that left were cancelled


# --------------------------------------------------------------------------- bad requests
@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    ({"prompt": "x"}, 422, "model: Field required"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "'gpt-4' is not served here"),
    ({"model": "base", "prompt": "x", "n": 2}, 400, "n=2"),
    ({"model": "base", "prompt": "x", "max_tokens": 300}, 400, "maximum context length is 256 tokens"),
    ({"model": "base", "prompt": "whale " * 300, "max_tokens": 1}, 400, "maximum context length is 256 tokens"),
    ({"model": "base", "prompt": "x", "temperature": "hot"}, 422, "temperature"),
    ({"model": "base", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "base", "prompt": "x", "max_tokens": -1}, 422, "max_tokens"),
    ({"model": "base", "prompt": "x", "seed": 10**23}, 422, "seed"),
    ({"model": "base", "prompt": [99999]}, 400, "outside 0..4095"),
    ({"model": "base", "messages": []}, 422, "messages"),
    ({"model": "base", "messages": [{"role": "robot", "content": "x"}]}, 422, "role"),
    ({"model": "base", "messages": [{"role": "assistant", "content": "x"}]}, 400, "must answer a user message"),
])
def test_malformed_requests_get_a_clear_error(server, body, status, words):
    url, _ = server
    endpoint = "chat/completions" if isinstance(body, dict) and "messages" in body else "completions"
    if isinstance(body, bytes):
        response = httpx.post(f"{url}/v1/{endpoint}", content=body, headers={"content-type": "application/json"},
                              timeout=TIMEOUT)
    else:
        response = httpx.post(f"{url}/v1/{endpoint}", json=body, timeout=TIMEOUT)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"


# --------------------------------------------------------------------------- clients that leave
def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    url, engine = server
    cancelled = engine.stats.finished["cancelled"]
    body = {"model": "base", "prompt": "Call me", "max_tokens": 250, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        wait_until(lambda: engine.running == 1)
    started = engine.stats.steps
    wait_until(lambda: engine.running == 0)
    assert engine.stats.finished["cancelled"] == cancelled + 1  # ended by the disconnect, not by its length
    assert engine.stats.steps - started < 250


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_slot(server):
    url, engine = server
    cancelled = engine.stats.finished["cancelled"]
    body = {"model": "base", "prompt": "Call me", "max_tokens": 250, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.3)
    wait_until(lambda: engine.running == 0)
    assert engine.stats.finished["cancelled"] == cancelled + 1


def test_metrics_are_prometheus_text(server):
    url, engine = server
    client(url).completions.create(model="base", prompt="Ahab", max_tokens=3)
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}
    assert values["llmscratch_queue_length"] == 0 and values["llmscratch_running_sequences"] == 0
    assert values["llmscratch_generated_tokens_total"] >= 3 and values["llmscratch_slots"] == 16
    assert values["llmscratch_time_to_first_token_seconds_count"] >= 1
    assert 'llmscratch_time_to_first_token_seconds{quantile="0.5"}' in values
    assert "# TYPE llmscratch_tokens_per_second gauge" in text
    assert values["llmscratch_kv_cache_usage"] == 0
    assert values["llmscratch_kv_cache_bytes"] == pytest.approx(engine.cache_bytes, rel=1e-5)  # six digits written
    assert values["llmscratch_preempted_total"] == engine.stats.preempted
    # The same prompt again: its first block comes from the cache, and the counter says how many tokens it held
    prompt = "Call me Ishmael. Some years ago, never mind how long precisely, having little money in my purse"
    before = values["llmscratch_prompt_tokens_cached_total"]
    for _ in range(2):
        client(url).completions.create(model="base", prompt=prompt, max_tokens=1)
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}
    assert values["llmscratch_prompt_tokens_cached_total"] - before >= engine.cache.block_size


def test_the_chat_page_is_served_at_the_root(server):
    url, _ = server
    page = httpx.get(url + "/", timeout=TIMEOUT)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "v1/chat/completions" in page.text and "<textarea" in page.text


# --------------------------------------------------------------------------- the script
@pytest.mark.slow
def test_serve_py_serves_with_a_key_from_the_environment_until_stopped():
    port = free_port()
    env = {**os.environ, "LLMSCRATCH_API_KEYS": "secret-1, secret-2"}
    process = subprocess.Popen([sys.executable, str(SCRIPTS["serve"]), "--port", str(port), "--max-slots", "4"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "serve.py did not start"
            time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models", timeout=TIMEOUT).status_code == 401
        answer = client(url, "secret-2").completions.create(model="base", prompt="Ahab", max_tokens=4)
        assert answer.usage.completion_tokens == 4
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
    # the KV cache: 4 slots (--max-slots) x 256 positions in blocks of 16 (and the null block) x 6 layers x (keys +
    # values) x 4 kv heads x 32 widths x 4 bytes
    blocks = 4 * 256 // 16
    cache = (f"paged KV cache {(blocks + 1) * 16 * 6 * 2 * 4 * 32 * 4 / 2**20:.1f} MiB ({blocks} blocks for 6 full "
             f"layers, 16 positions each; 4 sequences of 256 positions fit), float32")
    assert f"serving base (5.8M parameters, float32, cpu; {cache}; 2 API key(s); the instruction template)" in output


@pytest.mark.parametrize("argv, words", [
    (["--host", "0.0.0.0"], "--host 0.0.0.0 listens beyond this machine: give --api-key"),
    (["--model", "nowhere.safetensors"], "--model nowhere.safetensors: no such file"),
    (["--max-slots", "0"], "--max-slots must be at least 1"),
    (["--rate-limit", "0"], "--rate-limit must be at least 1"),
    (["--port", "70000"], "--port must be between 1 and 65535"),
])
def test_serve_py_refuses_bad_flags_by_name(argv, words, capsys, monkeypatch):
    monkeypatch.delenv("LLMSCRATCH_API_KEYS", raising=False)
    assert run_script("serve", argv) == 2
    assert words in capsys.readouterr().err


def test_serve_py_help_explains_every_flag(capsys):
    assert run_script("serve", ["--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--name", "--host", "--port", "--api-key", "--rate-limit", "--max-slots", "--max-waiting",
                 "--batch-shape", "--dtype", "--device", "LLMSCRATCH_API_KEYS"):
        assert flag in text


@pytest.fixture(scope="module")
def base(served_model):
    """(model, tokenizer): the bundled base model, as the server under test serves it (tests/conftest.py)."""
    return served_model
