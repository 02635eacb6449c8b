"""Continuous batching (llmscratch.deployment.engine) against generate alone, and the per-row positions it rests on.

The rule for "a request's result does not depend on what else runs": its logits stay within a
tolerance derived from the model itself (4x the largest gap between its float32 and float64
logits on the same tokens: two float32 computations of one float64 truth differ by at most twice
that, and the other 2 is margin for the kernels' other summation orders), and its greedy tokens are
equal, on prompts whose top two logits are further apart than twice that tolerance at every step.
"""

import copy
import dataclasses
import math
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_fixtures import LATER_SHAPES, randomize

from llmscratch.cli import DEFAULT_MODELS
from llmscratch.deployment import engine as engine_module
from llmscratch.deployment.engine import Engine
from llmscratch.deployment.requests import QueueFull, Request, SamplingParams, StopText
from llmscratch.device import available_memory
from llmscratch.finetuning.instruct import format_chat, format_prompt
from llmscratch.model.attention import KVCache, positions_mask
from llmscratch.model.config import GPTConfig
from llmscratch.model.generate import decode_one_token, generate, prefill
from llmscratch.model.gpt import GPT
from llmscratch.model.weights import load_model_and_tokenizer

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

TINY = {
    "gpt2": dict(vocab_size=97, context_length=40, d_model=32, n_layers=2, n_heads=4),
    "llama": dict(vocab_size=89, context_length=40, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, d_ff=80,
                  norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False, bias=False, tie_embeddings=False),
}
TINY.update({kind: dict(shape, context_length=40) for kind, shape in LATER_SHAPES.items()})
PROMPTS = ["Call me Ishmael.", "The whale", "It was a dark and stormy night, and the sea", "Queequeg said",
           "Ahab", "Starbuck looked at the", "There she blows!", "x", "In the morning the crew",
           "What is a harpoon?", "The white whale swam", "Stubb laughed and", "Nantucket", "The Pequod sailed",
           "I went to sea", "Below deck, the sailors"]


@pytest.fixture(scope="module")
def base():
    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODELS["base"][0])
    return model.float().eval(), tokenizer


def tiny(kind: str, **overrides) -> GPT:
    model = GPT(GPTConfig(**{**TINY[kind], **overrides}))
    randomize(model, seed=0, scale=0.2)
    return model.eval()


def submit_all(engine: Engine, prompts, params, tokenizer):
    """Submit, then step the engine in this thread until all end (bounded); each request's whole answer, in order."""
    requests = [engine.submit(tokenizer.encode(p), sp) for p, sp in zip(prompts, params)]
    texts, ids, ends = [[] for _ in requests], [[] for _ in requests], [None] * len(requests)
    with torch.inference_mode():
        for _ in range(5000):
            for i, request in enumerate(requests):
                while not request.events.empty():
                    event = request.events.get_nowait()
                    texts[i].append(event.text)
                    ids[i] += event.token_ids
                    ends[i] = event if event.finish_reason is not None else None
            if all(end is not None for end in ends):
                return [dataclasses.replace(end, text="".join(t), token_ids=i) for end, t, i in zip(ends, texts, ids)]
            engine.step()
    raise AssertionError("the requests did not finish within 5000 steps")


def spy_logits(engine: Engine) -> dict:
    """Record every logits row the engine chooses from, per request: {request: [logits (V,), ...]}."""
    seen, choose = {}, engine._choose

    def spy(logits_by_row):
        for row, logits in logits_by_row.items():
            seen.setdefault(engine.slots[row], []).append(logits[: engine.vocab_size].clone())
        choose(logits_by_row)

    engine._choose = spy
    return seen


def solo_logits(model: GPT, prompt_ids: list[int], max_tokens: int, eos_id: int, vocab_size: int):
    """Greedy tokens and each step's logits along generate's own path: prefill, then decode_one_token."""
    idx = torch.tensor([prompt_ids])
    caches = model.make_kv_caches(1, len(prompt_ids) + max_tokens - 1)
    tokens, logits_seen = [], []
    with torch.inference_mode():
        logits = prefill(model, idx, caches)[:, :vocab_size]
        for step in range(max_tokens):
            logits_seen.append(logits[0].clone())
            token = int(logits.argmax(-1))
            tokens.append(token)
            if token == eos_id or step == max_tokens - 1:
                break
            logits = decode_one_token(model, torch.tensor([[token]]), torch.tensor([len(prompt_ids) + step]),
                                      caches)[:, :vocab_size]
    return tokens, logits_seen


def float64_gap(model: GPT, sequences: list[list[int]]) -> float:
    """The largest |float32 - float64| logit of the model on these token sequences (no cache)."""
    model64 = copy.deepcopy(model).double()
    gap = 0.0
    with torch.inference_mode():
        for ids in sequences:
            idx = torch.tensor([ids])
            gap = max(gap, (model(idx).double() - model64(idx)).abs().max().item())
    return gap


# --------------------------------------------------------------------------- per-row positions
@pytest.mark.parametrize("kind", sorted(TINY))
@pytest.mark.parametrize("fused", [True, False])
def test_rows_at_their_own_positions_match_each_row_alone(kind, fused):
    model = tiny(kind, fused_attention=fused)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 13, 1, 8]
    prompts = [torch.randint(vocab, (n,), generator=gen) for n in lengths]
    caches = model.make_kv_caches(len(lengths), model.config.context_length)
    with torch.inference_mode():
        for row, prompt in enumerate(prompts):  # each prefilled alone into its own row
            model(prompt[None], [cache.rows(row, row + 1) for cache in caches])
        tokens = torch.randint(vocab, (len(lengths), 1), generator=gen)  # (B, 1)
        batched = model(tokens, caches, input_pos=torch.tensor(lengths)[:, None])[:, -1]  # (B, V)
        for row, prompt in enumerate(prompts):
            alone = model(torch.cat([prompt, tokens[row]])[None])[0, -1]  # the whole sequence, no cache
            torch.testing.assert_close(batched[row], alone, atol=2e-5, rtol=1e-5)


def test_cache_writes_rows_at_their_own_positions_and_rows_are_views():
    cache = KVCache(3, 10, n_kv_heads=2, head_dim=4)
    keys, values = torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 4)
    positions = torch.tensor([[0, 1], [4, 5], [8, 9]])  # (B, T)
    all_keys, all_values = cache.write(keys, values, positions)
    for row in range(3):
        expected = KVCache(1, 10, n_kv_heads=2, head_dim=4)
        expected.write(keys[row : row + 1], values[row : row + 1], positions[row])
        assert torch.equal(all_keys[row], expected.keys[0]) and torch.equal(all_values[row], expected.values[0])
    view = cache.rows(1, 2)
    view.write(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), torch.tensor([2]))
    assert cache.keys[1, :, 2].eq(1).all() and cache.keys[[0, 2], :, 2].eq(0).all()  # written through, nowhere else


def test_positions_mask_of_rows_is_each_rows_own():
    positions = torch.tensor([[2], [0], [5]])
    mask = positions_mask(positions, 6)
    assert mask.shape == (3, 1, 1, 6)
    for row in range(3):
        assert torch.equal(mask[row, 0], positions_mask(positions[row], 6))


# --------------------------------------------------------------------------- against generate alone
@pytest.mark.slow
def test_sixteen_concurrent_requests_match_generate_alone_within_the_derived_tolerance(base):
    model, tokenizer = base
    eos, vocab = tokenizer.eot_token, min(tokenizer.n_vocab, model.config.vocab_size)
    lengths = [3 + 4 * i for i in range(len(PROMPTS))]
    engine = Engine(model, tokenizer, max_slots=16)
    seen = spy_logits(engine)
    results = submit_all(engine, PROMPTS, [SamplingParams(max_tokens=n) for n in lengths], tokenizer)
    assert engine.running == 0 and engine.queued == 0
    solos = [solo_logits(model, tokenizer.encode(p), n, eos, vocab) for p, n in zip(PROMPTS, lengths)]
    sequences = [tokenizer.encode(p) + tokens[:-1] for p, (tokens, _) in zip(PROMPTS, solos)]
    tolerance = 4 * float64_gap(model, sequences)
    assert 0 < tolerance < 1e-3, tolerance
    by_request = [next(logits for request, logits in seen.items() if request.prompt_ids == tokenizer.encode(p))
                  for p in PROMPTS]
    for prompt, result, (tokens, logits), batched in zip(PROMPTS, results, solos, by_request):
        assert result.token_ids == (tokens[:-1] if tokens[-1] == eos else tokens), prompt  # EOS ends, unsent
        assert result.text == tokenizer.decode(result.token_ids)
        assert len(batched) == len(logits)
        for step, (ours, theirs) in enumerate(zip(batched, logits)):
            top2 = theirs.topk(2).values
            assert top2[0] - top2[1] > 2 * tolerance, f"{prompt!r} step {step}: a near tie, pick another prompt"
            assert (ours - theirs).abs().max() <= tolerance, (prompt, step)
    # and generate itself chooses those tokens
    for prompt, (tokens, _) in zip(PROMPTS[:4], solos[:4]):
        ids = tokenizer.encode(prompt)
        out = generate(model, torch.tensor([ids]), len(tokens), eos_id=eos, vocab_size=vocab)
        assert out[0, len(ids):].tolist() == tokens


def test_fixed_batch_shape_is_bitwise_independent_of_the_other_requests(base):
    model, tokenizer = base
    rng = random.Random(0)
    settings_ = [SamplingParams(max_tokens=rng.randint(4, 30), temperature=rng.choice([0.0, 0.7, 1.2]),
                                top_k=rng.choice([None, 5, 50]), top_p=rng.choice([None, 0.9]), seed=i)
                 for i in range(len(PROMPTS))]
    alone = []
    for prompt, params in zip(PROMPTS[:5], settings_[:5]):
        engine = Engine(model, tokenizer, max_slots=16, batch_shape="fixed")
        seen = spy_logits(engine)
        alone.append((submit_all(engine, [prompt], [params], tokenizer)[0], list(seen.values())[0]))
    engine = Engine(model, tokenizer, max_slots=16, batch_shape="fixed")
    seen = spy_logits(engine)
    order = list(range(len(PROMPTS)))
    rng.shuffle(order)  # the five land in other rows, beside other requests, admitted at other steps
    together = submit_all(engine, [PROMPTS[i] for i in order], [settings_[i] for i in order], tokenizer)
    for i, (result, logits) in enumerate(alone):
        j = order.index(i)
        assert together[j].token_ids == result.token_ids and together[j].text == result.text
        mine = next(v for request, v in seen.items() if request.prompt_ids == tokenizer.encode(PROMPTS[i]))
        assert len(mine) == len(logits) and all(torch.equal(a, b) for a, b in zip(mine, logits)), PROMPTS[i]


# --------------------------------------------------------------------------- the scheduler
def test_a_short_request_finishes_while_a_long_one_runs_and_a_waiting_one_takes_its_row(base):
    model, tokenizer = base
    engine = Engine(model, tokenizer, max_slots=2)
    long = engine.submit(tokenizer.encode("Call me"), SamplingParams(max_tokens=40))
    short = engine.submit(tokenizer.encode("The whale"), SamplingParams(max_tokens=3))
    waiting = engine.submit(tokenizer.encode("Ahab"), SamplingParams(max_tokens=3))
    with torch.inference_mode():
        engine.step()  # both rows taken (a token each from its prefill, a second from the decode), the third waits
        assert engine.slots == [long, short] and engine.queued == 1
        engine.step()  # the short one's third token: it leaves at once
        assert engine.slots == [long, None] and len(short.token_ids) == 3 and engine.queued == 1
        engine.step()  # the waiting one takes the free row at the next step
    assert engine.slots == [long, waiting] and engine.queued == 0
    with torch.inference_mode():
        run = 0
        while engine.running and run < 100:
            engine.step()
            run += 1
    assert [len(r.token_ids) for r in (long, short, waiting)] == [40, 3, 3]


def test_a_cancelled_request_frees_its_row_at_the_next_step(base):
    model, tokenizer = base
    engine = Engine(model, tokenizer, max_slots=4)
    request = engine.submit(tokenizer.encode("Call me"), SamplingParams(max_tokens=100))
    other = engine.submit(tokenizer.encode("Ahab"), SamplingParams(max_tokens=100))
    with torch.inference_mode():
        for _ in range(3):
            engine.step()
        request.cancel()
        engine.step()
    assert engine.slots[0] is None and engine.slots[1] is other
    events = []
    while not request.events.empty():
        events.append(request.events.get_nowait())
    assert events[-1].finish_reason == "cancelled" and len(request.token_ids) == 4  # 1 + 3 steps, none after
    assert engine.stats.finished["cancelled"] == 1
    waiting = engine.submit(tokenizer.encode("x"), SamplingParams(max_tokens=5))
    waiting.cancel()  # cancelled before it got a row: never admitted
    with torch.inference_mode():
        engine.step()
    assert engine.slots[0] is None and waiting.events.get_nowait().finish_reason == "cancelled"


def test_the_thread_serves_and_stop_cancels_what_is_left(base):
    model, tokenizer = base
    engine = Engine(model, tokenizer, max_slots=1, max_waiting=4)
    with engine:
        done = engine.submit(tokenizer.encode("Call me"), SamplingParams(max_tokens=5)).result(timeout=60)
        assert done.finish_reason == "length" and len(done.token_ids) == 5
        running = engine.submit(tokenizer.encode("Ahab"), SamplingParams(max_tokens=200))
        queued = engine.submit(tokenizer.encode("x"), SamplingParams(max_tokens=200))
        deadline = time.monotonic() + 30
        while not running.token_ids and time.monotonic() < deadline:
            time.sleep(0.01)
    assert running.result(timeout=5).finish_reason == "cancelled"
    assert queued.result(timeout=5).finish_reason == "cancelled"
    assert not any(t.name == "llmscratch-engine" for t in threading.enumerate())


def test_a_failing_step_ends_its_requests_with_an_error_and_the_engine_goes_on(base):
    model, tokenizer = base
    engine = Engine(model, tokenizer, max_slots=2)
    broken = engine.submit(tokenizer.encode("Call me"), SamplingParams(max_tokens=20))
    real_forward = model.forward
    with torch.inference_mode():
        engine.step()
        model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("out of memory (simulated)"))
        try:
            engine.step()
        finally:
            del model.forward
    assert model.forward == real_forward and engine.running == 0
    events = [broken.events.get_nowait() for _ in range(broken.events.qsize())]
    assert events[-1].finish_reason == "error" and "out of memory (simulated)" in events[-1].error
    after = submit_all(engine, ["Ahab"], [SamplingParams(max_tokens=4)], tokenizer)[0]
    assert after.finish_reason == "length" and len(after.token_ids) == 4


# --------------------------------------------------------------------------- limits and bad input
def test_the_queue_is_bounded_and_bad_requests_are_refused_at_the_door(base):
    model, tokenizer = base
    engine = Engine(model, tokenizer, max_slots=1, max_waiting=2)
    for _ in range(2):
        engine.submit([1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(QueueFull, match="2 requests are already waiting"):
        engine.submit([1, 2], SamplingParams(max_tokens=1))
    context = model.config.context_length
    with pytest.raises(ValueError, match=f"context is {context} tokens.*{context + 1}"):
        engine.submit([1] * 10, SamplingParams(max_tokens=context - 9))
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], SamplingParams())
    with pytest.raises(ValueError, match="outside 0..4095"):
        engine.submit([4096], SamplingParams())
    for bad, message in [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
                         (dict(top_p=0.0), "top_p"), (dict(top_k=0), "top_k"), (dict(stop=("",)), "stop")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="batch_shape"):
        Engine(model, tokenizer, batch_shape="padded")


class WithoutEndOfText:
    """A tokenizer as the engine sees it, with no end-of-text id: a request can only end at its length."""

    eot_token = None

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.n_vocab = tokenizer.n_vocab

    def encode(self, text):
        return self.tokenizer.encode(text)

    def decode_bytes(self, ids):
        return self.tokenizer.decode_bytes(ids)


def test_a_request_that_fills_the_context_exactly_ends_at_its_length(base):
    model, tokenizer = base
    prompt = "Call me Ishmael."
    room = model.config.context_length - len(tokenizer.encode(prompt))
    plain = WithoutEndOfText(tokenizer)
    result = submit_all(Engine(model, plain, max_slots=2), [prompt], [SamplingParams(max_tokens=room)], plain)[0]
    assert result.finish_reason == "length" and len(result.token_ids) == room


def test_a_request_whose_first_sample_fails_ends_in_an_error_and_the_thread_serves_on(base):
    model, tokenizer = base
    engine = Engine(model, tokenizer, max_slots=2)
    engine.model = lambda ids, *args, **kwargs: torch.full((*ids.shape, model.config.vocab_size), float("nan"))
    with engine:
        failed = engine.submit(tokenizer.encode("Call me"), SamplingParams(max_tokens=5, temperature=1.0, seed=0))
        assert failed.result(timeout=60).finish_reason == "error"
        engine.model = model
        after = engine.submit(tokenizer.encode("Ahab"), SamplingParams(max_tokens=5, temperature=1.0, seed=0))
        assert after.result(timeout=60).finish_reason == "length"
        assert engine._thread.is_alive() and engine.running == 0


def test_a_waiting_request_whose_client_left_gives_its_place_to_the_next(base):
    model, tokenizer = base
    engine = Engine(model, tokenizer, max_slots=1, max_waiting=1)
    gone = engine.submit([1, 2], SamplingParams(max_tokens=1))
    gone.cancel()
    running = engine.submit([1, 2], SamplingParams(max_tokens=50))  # not QueueFull: the place was free again
    assert gone.events.get_nowait().finish_reason == "cancelled" and engine.queued == 1
    engine.step()  # running takes the only row
    waiting = engine.submit([3, 4], SamplingParams(max_tokens=5))
    waiting.cancel()
    engine.step()  # no row is free, yet the request that left is out of the queue at once
    assert engine.slots == [running] and engine.queued == 0
    assert waiting.events.get_nowait().finish_reason == "cancelled"


def test_text_after_a_stop_string_never_leaks_even_half_a_character():
    class Bytes:  # a tokenizer whose token 0 is "X" and the first two bytes of "€"
        eot_token = None

        def decode_bytes(self, ids):
            return b"X\xe2\x82"

    request = Request([1], SamplingParams(max_tokens=3, stop=("X",)), None, Bytes())
    assert request.add_token(0, eos_id=None) == "stop"
    request.finish("stop")
    events = [request.events.get_nowait() for _ in range(request.events.qsize())]
    assert "".join(e.text for e in events) == "" and events[-1].finish_reason == "stop"


# --------------------------------------------------------------------------- text and stop strings
@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab#\n", max_size=40), cuts=st.lists(st.integers(0, 40), max_size=8),
       stops=st.lists(st.text(alphabet="ab#\n", min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_text_releases_exactly_the_text_before_the_first_stop(text, cuts, stops):
    pieces, last = [], 0
    for cut in sorted(c for c in cuts if c <= len(text)) + [len(text)]:
        pieces.append(text[last:cut])
        last = cut
    stop_text, shown, stopped = StopText(stops), [], False
    for piece in pieces:
        released, stopped = stop_text.feed(piece)
        shown.append(released)
        if stopped:
            break
    if not stopped:
        released, stopped = stop_text.flush()
        shown.append(released)
    first = min((text.find(s) for s in stops if s in text), default=len(text))
    assert "".join(shown) == text[:first]
    assert stopped == any(s in text for s in stops)


@pytest.mark.parametrize("pieces, stops, shown", [
    (["#a", "a"], ["a", "#aa"], ""),  # "a" completes first, but "#aa" starts first: found by hypothesis
    (["#a", "b"], ["a", "#aa"], "#"),  # "#aa" never completes: "a" ends the text after all
    (["#a"], ["a", "#aa"], "#"),  # the text ends while "#aa" could still have begun: only flush can tell
    (["xab", "c"], ["b", "abc"], "x"),
    (["ab", "cd"], ["bcd", "cx"], "a"),
])
def test_a_stop_that_starts_first_wins_over_one_that_completes_first(pieces, stops, shown):
    stop_text, released = StopText(stops), []
    for piece in pieces:
        text, stopped = stop_text.feed(piece)
        released.append(text)
        if stopped:
            break
    else:
        text, stopped = stop_text.flush()
        released.append(text)
    assert stopped and "".join(released) == shown


def test_a_stop_string_ends_the_answer_before_it(base):
    model, tokenizer = base
    free = submit_all(Engine(model, tokenizer), ["Call me Ishmael."], [SamplingParams(max_tokens=30)], tokenizer)[0]
    stop = free.text[8:11]  # three characters from inside the free answer
    cut = submit_all(Engine(model, tokenizer), ["Call me Ishmael."], [SamplingParams(max_tokens=30, stop=(stop,))],
                     tokenizer)[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]


def test_a_chat_of_one_turn_is_the_instruction_prompt_and_bad_chats_are_named():
    assert format_chat([{"role": "user", "content": "Name a whale."}]) == format_prompt(
        {"instruction": "Name a whale.", "input": ""})
    two = format_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}])
    assert two == ("Be brief.\n\n### Instruction:\nHi\n\n### Response:\nHello\n\n"
                   "### Instruction:\nBye\n\n### Response:\n")
    for messages, message in [([{"role": "assistant", "content": "x"}], "must answer a user"),
                              ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}],
                               "only come first"),
                              ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                               "last message must be the user's"),
                              ([{"role": "tool", "content": "x"}], "role 'tool'")]:
        with pytest.raises(ValueError, match=message):
            format_chat(messages)


@pytest.mark.parametrize("form", ["bfloat16", "int8", "int4"])
def test_bfloat16_and_quantized_models_answer_as_generate_does(base, form):
    from llmscratch.model.quantize import quantize

    model, tokenizer = base
    served = copy.deepcopy(model).to(torch.bfloat16) if form == "bfloat16" else quantize(model, form, 64, head=True)
    prompts = PROMPTS[:6]
    results = submit_all(Engine(served, tokenizer), prompts, [SamplingParams(max_tokens=12)] * len(prompts), tokenizer)
    for prompt, result in zip(prompts, results):
        ids = tokenizer.encode(prompt)
        out = generate(served, torch.tensor([ids]), 12, eos_id=tokenizer.eot_token, vocab_size=tokenizer.n_vocab)
        assert result.token_ids == [i for i in out[0, len(ids):].tolist() if i != tokenizer.eot_token], prompt


# --------------------------------------------------------------------------- the cache's size, told and checked at start
LONG_CONTEXT = 40_960  # a Hugging Face folder's (issue 50): 9.4 GB a slot for its model, 10 MiB for this tiny one


class ByteTokenizer:
    """What the engine asks of a tokenizer, for models of any vocabulary."""

    eot_token, n_vocab = 0, 256

    def decode_bytes(self, ids):
        return bytes(ids)


def forbid_big_allocations(monkeypatch, elements: int = 2**22) -> None:
    """torch.zeros and torch.empty of more than ``elements`` fail the test: the engine must refuse before allocating."""
    def guard(name):
        original = getattr(torch, name)

        def guarded(*size, **kwargs):
            shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
            assert math.prod(shape) <= elements, f"torch.{name}{tuple(shape)} was called before the size was checked"
            return original(*size, **kwargs)

        monkeypatch.setattr(torch, name, guarded)

    guard("zeros")
    guard("empty")


def pool_bytes(engine: Engine) -> int:
    return sum(t.nbytes for group in engine.cache.groups for t in group.keys + group.values)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma"])
def test_without_a_budget_the_cache_takes_what_the_slots_need_within_half_the_free_memory(monkeypatch, kind):
    model, tokenizer = tiny(kind, context_length=LONG_CONTEXT), ByteTokenizer()
    one = engine_module.kv_cache_bytes(model, 1, LONG_CONTEXT)
    monkeypatch.setattr(engine_module, "available_memory", lambda device: 12 * one)
    forbid_big_allocations(monkeypatch, elements=6 * one // 4 // 2 + 1)  # float32: half of 12 sequences, per tensor
    engine = Engine(model, tokenizer)  # the default 16 slots need 16 sequences' worth: 6 are given
    assert engine.cache_bytes == pool_bytes(engine) <= 6 * one + 2 * one // 100
    assert "6 sequences of 40,960 positions fit" in engine.cache_description, engine.cache_description
    monkeypatch.setattr(engine_module, "available_memory", lambda device: 10**12)
    small = Engine(tiny(kind), tokenizer, max_slots=3)  # plenty free: what 3 sequences of the context need
    assert small.cache_bytes == pool_bytes(small)
    assert "3 sequences of 40 positions fit" in small.cache_description, small.cache_description


def test_a_budget_beyond_half_the_free_memory_is_refused_before_allocating(monkeypatch):
    model = tiny("llama", context_length=LONG_CONTEXT)
    one = engine_module.kv_cache_bytes(model, 1, LONG_CONTEXT)
    monkeypatch.setattr(engine_module, "available_memory", lambda device: 12 * one)
    forbid_big_allocations(monkeypatch)
    with pytest.raises(ValueError) as refused:
        Engine(model, ByteTokenizer(), kv_memory=7 * one)
    for part in [f"{7 * one:,} bytes", "free on cpu", "lower --kv-memory"]:
        assert part in str(refused.value), (part, str(refused.value))


def test_a_context_too_long_for_one_sequence_says_so_and_a_bfloat16_model_is_not_told_to_use_bfloat16(monkeypatch):
    model = tiny("gpt2", context_length=LONG_CONTEXT).to(torch.bfloat16)
    monkeypatch.setattr(engine_module, "available_memory", lambda device: 20_000)  # a block of 16 positions fits
    forbid_big_allocations(monkeypatch)
    with pytest.raises(ValueError, match=r"lower --max-model-len \(one sequence .*\) or use a device with more memory$"):
        Engine(model, ByteTokenizer(), max_slots=2)
    engine = Engine(model, ByteTokenizer(), max_slots=2, max_model_len=8)  # short sequences fit: it serves them
    assert engine.context_length == 8


def test_a_pool_too_small_for_one_request_is_a_clear_error_at_submission():
    model = tiny("llama")
    budget = engine_module.kv_cache_bytes(model, 1, 16, block_size=4)  # room for 16 positions, 4 blocks
    engine = Engine(model, ByteTokenizer(), max_slots=2, kv_memory=budget, block_size=4)
    assert "one sequence of at most 16 positions fits" in engine.cache_description, engine.cache_description
    engine.submit([1, 2, 3], SamplingParams(max_tokens=13))  # 16 positions: fits
    with pytest.raises(ValueError, match=r"cannot hold one sequence of 17 positions \(3 of prompt, 14 of completion"):
        engine.submit([1, 2, 3], SamplingParams(max_tokens=14))


def test_the_memory_free_on_a_cpu_is_known_and_at_most_what_linux_says():
    free = available_memory("cpu")
    assert isinstance(free, int) and free > 0
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        said = next(int(line.split()[1]) for line in meminfo.read_text().splitlines() if line.startswith("MemAvailable"))
        assert free <= said * 1024 * 1.5  # read at another moment: other processes come and go


@pytest.mark.cuda
def test_a_cache_too_large_for_the_gpu_is_refused_naming_its_free_memory(monkeypatch):
    model = tiny("llama", context_length=LONG_CONTEXT).cuda()
    free = available_memory(model.token_embedding.weight.device)
    assert 0 < free <= torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(ValueError, match=r"free on cuda:0 .*--kv-memory"):
        Engine(model, ByteTokenizer(), kv_memory=free)
    engine = Engine(model, ByteTokenizer(), max_slots=2)
    assert engine.cache_bytes == pool_bytes(engine) <= free // 2
