"""The server as evaluation harnesses use it: token logprobs and echo (checked against the model's own log-softmax),
prompts as a batch, /v1/models/{id}, the context-length error in OpenAI's words, vLLM's tokenizer routes.

Every server runs in a thread with start and stop deadlines (tests/serving.py); every client call has a timeout.
"""

import json
import re

import httpx
import openai
import pytest
import torch
from serving import running_server

from llmscratch.deployment.engine import Engine
from llmscratch.deployment.server import MAX_PROMPTS, create_app
from llmscratch.model.generate import generate

pytestmark = [pytest.mark.timeout(300)]
TIMEOUT = 60.0
# The server's logits come from a KV-cached prefill and decode, the reference's from one forward: the same sums in
# another order. float32 rounds each to about 1.2e-7 of its size; logits of size ~20 through a few layers of
# ~256-term sums stay within 1e-4 of each other, and a log-softmax adds no more than its input's error.
LOGPROB_ATOL = 1e-4
PROMPTS = ["Call me Ishmael.", "The whale", "It was a dark and", "Queequeg"]


@pytest.fixture(scope="module")
def url(served_model):
    model, tokenizer = served_model
    with running_server(create_app(Engine(model, tokenizer, max_slots=4), model_name="base")) as url:
        yield url


def post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT)


def completion(url: str, **fields) -> dict:
    response = post(url, {"model": "base", "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()


@torch.no_grad()
def reference_logprobs(base, ids: list[int]) -> torch.Tensor:
    """log p(token t | tokens before it) for every position but the first, by the package's model (T - 1, V)."""
    model, tokenizer = base
    logits = model(torch.tensor([ids]))[0, :-1, : tokenizer.n_vocab]  # (T - 1, V)
    return torch.log_softmax(logits.double(), dim=-1)


def assert_block_matches(base, block: dict, ids: list[int], first: int, top: int) -> None:
    """block's entries from ``first`` on score ids[first:] as the model does: each token's and the top ones'."""
    _, tokenizer = base
    expected = reference_logprobs(base, ids)
    for t in range(first, len(ids)):
        want = expected[t - 1]
        assert block["tokens"][t] == tokenizer.decode_bytes([ids[t]]).decode("utf-8", errors="replace")
        assert block["token_logprobs"][t] == pytest.approx(want[ids[t]].item(), abs=LOGPROB_ATOL)
        values, indices = want.topk(top)
        alternatives = {tokenizer.decode_bytes([i]).decode("utf-8", errors="replace"): v
                        for i, v in zip(indices.tolist(), values.tolist())}
        got = block["top_logprobs"][t]
        assert set(alternatives) <= set(got) and len(got) <= top + 1  # the top ones, and the token's own
        for text, value in alternatives.items():
            assert got[text] == pytest.approx(value, abs=LOGPROB_ATOL)
    for t in range(first, len(ids) - 1):  # each token's text begins where the one before it ends
        assert block["text_offset"][t + 1] - block["text_offset"][t] == len(block["tokens"][t])


# --------------------------------------------------------------------------- logprobs and echo
@pytest.mark.parametrize("top", [0, 1, 5, 20])
def test_generated_tokens_logprobs_are_the_models_log_softmax(url, base, top):
    model, tokenizer = base
    prompt = "Call me Ishmael. Some years ago"
    plain = completion(url, prompt=prompt, max_tokens=12)["choices"][0]
    scored = completion(url, prompt=prompt, max_tokens=12, logprobs=top)["choices"][0]
    assert scored["text"] == plain["text"] and plain["logprobs"] is None  # asking changes no token
    block = scored["logprobs"]
    assert "".join(block["tokens"]) == scored["text"] and block["text_offset"][0] == 0
    ids = tokenizer.encode(prompt)
    ids += generate(model, torch.tensor([ids]), 12, vocab_size=tokenizer.n_vocab)[0, len(ids):].tolist()  # greedy
    padded = {key: [None] * (len(ids) - 12) + value for key, value in block.items()}  # where the prompt's would be
    assert_block_matches(base, padded, ids, len(ids) - 12, top)
    # Greedy: each token is the likeliest, so it leads its own alternatives.
    assert all(lp == pytest.approx(max(alts.values())) for lp, alts in zip(block["token_logprobs"],
                                                                          block["top_logprobs"]))


@pytest.mark.parametrize("prompt", ["Call me Ishmael.", "  whale-ship Pequod, \u201cAhab\u201d!\n\nThe sea"])
def test_echo_scores_the_prompt_as_the_model_does(url, base, prompt):
    _, tokenizer = base
    ids = tokenizer.encode(prompt)
    for max_tokens in (0, 1):  # lm-eval sends 1; OpenAI's legacy API took 0 too
        choice = completion(url, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1)["choices"][0]
        block = choice["logprobs"]
        assert choice["text"].startswith(prompt) and len(block["tokens"]) == len(ids) + max_tokens
        assert block["token_logprobs"][0] is None and block["top_logprobs"][0] is None
        assert "".join(block["tokens"][: len(ids)]) == prompt
        assert_block_matches(base, block, ids, 1, 1)
    as_ids = completion(url, prompt=ids, max_tokens=0, echo=True, logprobs=2)["choices"][0]
    assert as_ids["text"] == tokenizer.decode(ids)
    assert_block_matches(base, as_ids["logprobs"], ids, 1, 2)


def test_streamed_logprobs_are_the_whole_answers(url):
    whole = completion(url, prompt="The whale", max_tokens=10, logprobs=2)["choices"][0]
    body = {"model": "base", "prompt": "The whale", "max_tokens": 10, "logprobs": 2, "temperature": 0, "stream": True}
    tokens, logprobs, offsets = [], [], []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                block = json.loads(line[6:])["choices"][0]["logprobs"]
                if block:
                    tokens += block["tokens"]
                    logprobs += block["token_logprobs"]
                    offsets += block["text_offset"]
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]
    assert logprobs == pytest.approx(whole["logprobs"]["token_logprobs"], abs=LOGPROB_ATOL)


@pytest.mark.parametrize("body, words", [
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens: 0"),
    ({"prompt": "x", "echo": True, "stream": True}, "echo is not supported with stream"),
    ({"prompt": ["a", "b"], "stream": True}, "cannot be streamed"),
    ({"prompt": ["x"] * (MAX_PROMPTS + 1)}, f"at most {MAX_PROMPTS}"),
    ({"prompt": [[1, 2]] * (MAX_PROMPTS + 1)}, f"at most {MAX_PROMPTS}"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
])
def test_what_cannot_be_answered_is_refused_by_name(url, body, words):
    response = post(url, {"model": "base", **body})
    assert response.status_code in (400, 422) and words in response.json()["error"]["message"], response.text


def test_chat_refuses_logprobs_rather_than_ignoring_them(url):
    body = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    response = post(url, body, "/v1/chat/completions")
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"


# --------------------------------------------------------------------------- a list of prompts
@pytest.mark.parametrize("as_ids", [False, True])
def test_a_list_of_prompts_is_a_batch_answered_as_one_by_one(url, base, as_ids):
    _, tokenizer = base
    prompts = [tokenizer.encode(p) for p in PROMPTS] if as_ids else PROMPTS
    alone = [completion(url, prompt=p, max_tokens=8, logprobs=1, echo=True)["choices"][0] for p in prompts]
    batch = completion(url, prompt=prompts, max_tokens=8, logprobs=1, echo=True)
    assert [c["index"] for c in batch["choices"]] == list(range(len(prompts)))
    for one, together in zip(alone, batch["choices"]):
        assert together["text"] == one["text"] and together["logprobs"]["tokens"] == one["logprobs"]["tokens"]
        assert together["logprobs"]["token_logprobs"][1:] == pytest.approx(one["logprobs"]["token_logprobs"][1:],
                                                                           abs=LOGPROB_ATOL)
    lengths = [len(tokenizer.encode(p)) for p in PROMPTS]
    assert batch["usage"]["prompt_tokens"] == sum(lengths) and batch["usage"]["completion_tokens"] <= 8 * len(PROMPTS)


def test_a_list_of_ints_stays_one_prompt(url, base):
    _, tokenizer = base
    ids = tokenizer.encode("Call me Ishmael.")
    answer = completion(url, prompt=ids, max_tokens=5)
    assert len(answer["choices"]) == 1 and answer["usage"]["prompt_tokens"] == len(ids)
    as_text = completion(url, prompt="Call me Ishmael.", max_tokens=5)
    assert answer["choices"][0]["text"] == as_text["choices"][0]["text"]


def test_a_bad_prompt_in_a_batch_refuses_the_whole_request(url):
    response = post(url, {"model": "base", "prompt": [[5, 6], [99999]], "max_tokens": 2})
    assert response.status_code == 400 and "outside" in response.json()["error"]["message"]


# --------------------------------------------------------------------------- the official client
def test_the_openai_client_sends_lists_logprobs_and_echo(url, base):
    _, tokenizer = base
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    answer = api.completions.create(model="base", prompt=PROMPTS[:3], max_tokens=1, temperature=0, logprobs=1,
                                    echo=True)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for prompt, choice in zip(PROMPTS, answer.choices):
        ids = tokenizer.encode(prompt)
        assert choice.text.startswith(prompt) and len(choice.logprobs.tokens) == len(ids) + 1
        assert choice.logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    assert api.models.retrieve("base").id == "base"
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4")
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model="base", prompt="whale " * 200, max_tokens=100)
    assert refused.value.code == "context_length_exceeded"


# --------------------------------------------------------------------------- models, errors, tokenizer routes
def test_a_model_is_described_by_its_id_and_an_unknown_one_is_a_404_in_openais_shape(url):
    card = httpx.get(f"{url}/v1/models/base", timeout=TIMEOUT)
    assert card.status_code == 200 and card.json() == httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()["data"][0]
    for unknown in ("gpt-4", "org/base", "base%20"):
        missing = httpx.get(f"{url}/v1/models/{unknown}", timeout=TIMEOUT)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_models_by_id_and_the_tokenizer_routes_need_a_key_where_keys_are_set(base):
    model, tokenizer = base
    app = create_app(Engine(model, tokenizer, max_slots=1), model_name="base", api_keys=["secret"])
    with running_server(app) as url:
        assert httpx.get(f"{url}/v1/models/base", timeout=TIMEOUT).status_code == 401
        keyed = httpx.get(f"{url}/v1/models/base", headers={"Authorization": "Bearer secret"}, timeout=TIMEOUT)
        assert keyed.status_code == 200 and keyed.json()["id"] == "base"
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):  # the tokenizer's too
            assert httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT).status_code == 401
            assert httpx.post(f"{url}{path}", json=body, headers={"Authorization": "Bearer secret"},
                              timeout=TIMEOUT).status_code == 200
        assert httpx.get(f"{url}/tokenizer_info", timeout=TIMEOUT).status_code == 401


OPENAI_CONTEXT_ERROR = re.compile(r"This model's maximum context length is 256 tokens\. However, you requested "
                                  r"(\d+) tokens \((\d+) in the (prompt|messages), (\d+) in the completion\)\. "
                                  r"Please reduce the length of the (prompt|messages) or completion\.")


@pytest.mark.parametrize("path, body, prompt_tokens, completion_tokens", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 300}, 1, 300),
    ("/v1/completions", {"prompt": [7] * 250, "max_tokens": 7}, 250, 7),
    ("/v1/completions", {"prompt": [7] * 300, "max_tokens": 1}, 300, 1),
    ("/v1/completions", {"prompt": [[1], [7] * 256], "max_tokens": 1}, 256, 1),
    ("/v1/completions", {"prompt": "whale " * 300, "max_tokens": 1}, 300, 1),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 255}, None, 255),
])
def test_the_context_length_error_is_in_openais_words(url, base, path, body, prompt_tokens, completion_tokens):
    response = post(url, {"model": "base", **body}, path)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded", response.text
    match = OPENAI_CONTEXT_ERROR.fullmatch(error["message"])
    assert match, error["message"]
    asked, prompt, _, completion_part, _ = match.groups()
    assert int(completion_part) == completion_tokens and int(asked) == int(prompt) + completion_tokens
    if prompt_tokens is not None:
        assert int(prompt) == (len(base[1].encode(body["prompt"])) if isinstance(body["prompt"], str)
                               else prompt_tokens)


def test_a_text_too_long_to_tokenise_is_refused_in_openais_words(url):
    response = post(url, {"model": "base", "prompt": "é" * 30_000, "max_tokens": 1})
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and message.startswith("This model's maximum context length is 256 tokens.")


def test_the_tokenizer_routes_are_vllms(url, base):
    _, tokenizer = base
    text = "Call me Ishmael.<|endoftext|>"
    tokens = post(url, {"prompt": text, "add_special_tokens": False}, "/tokenize").json()
    assert tokens["tokens"] == tokenizer.encode(text, allowed_special="all") and tokens["max_model_len"] == 256
    assert post(url, {"tokens": tokens["tokens"]}, "/detokenize").json()["prompt"] == text
    info = httpx.get(f"{url}/tokenizer_info", timeout=TIMEOUT).json()
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 256
    assert post(url, {"tokens": [99999]}, "/detokenize").status_code == 400
    assert post(url, {"prompt": "é" * 30_000}, "/tokenize").json()["error"]["code"] == "context_length_exceeded"


@pytest.fixture(scope="module")
def base(served_model):
    """(model, tokenizer): the bundled base model, as the server under test serves it (tests/conftest.py)."""
    return served_model
