"""The paged KV cache (llmscratch.model.paged) against references that do not page: a forward without cache, the
contiguous ``KVCache``, an uninterrupted engine run, ``generate`` alone.

Most comparisons run in float64, where paging, chunking and sharing change nothing but the order of a few sums:
logits agree to ~1e-12, so a tolerance of 1e-9 catches any key read from the wrong block (which moves them by ~1e-1).
The float32 comparison of chunked and one-shot prefill uses test_engine.py's derived rule instead: 4x the largest
gap between the model's float32 and float64 logits on the same tokens.
"""

import copy
import math

import pytest
import torch
from model_fixtures import LATER_SHAPES, randomize

from llmscratch.deployment import engine as engine_module
from llmscratch.deployment.engine import Engine
from llmscratch.deployment.requests import SamplingParams
from llmscratch.model.config import GPTConfig
from llmscratch.model.generate import generate
from llmscratch.model.gpt import GPT
from llmscratch.model.paged import NULL_BLOCK, NoFreeBlocks, PagedKVCache

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]

TINY = {
    "gpt2": {"vocab_size": 97, "context_length": 40, "d_model": 32, "n_layers": 2, "n_heads": 4},
    "llama": {"vocab_size": 89, "context_length": 40, "d_model": 48, "n_layers": 2, "n_heads": 6, "n_kv_heads": 2,
              "d_ff": 80, "norm": "rmsnorm", "mlp": "swiglu", "position": "rope", "qkv_bias": False, "bias": False,
              "tie_embeddings": False},
}
# Gemma 3's mix: a window of 5 (sliding, full, sliding), shorter than most sequences here; and an MoE
TINY.update({kind: dict(shape, context_length=40) for kind, shape in LATER_SHAPES.items()})
KINDS = sorted(TINY)
EXACT = {"atol": 1e-9, "rtol": 0}  # float64: what paging may change is summation order, ~1e-12 here
BLOCK = 4


def tiny(kind: str, dtype=torch.float64, **overrides) -> GPT:
    model = GPT(GPTConfig(**{**TINY[kind], **overrides}))
    randomize(model, seed=0, scale=0.2)
    return model.to(dtype).eval()


def random_tokens(model: GPT, n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(model.config.vocab_size, (n,), generator=generator).tolist()


@torch.inference_mode()
def whole(model: GPT, tokens: list[int]) -> torch.Tensor:
    """The logits (T, V) of every position, from one forward without cache: the reference."""
    return model(torch.tensor([tokens]))[0]


@torch.inference_mode()
def feed(model: GPT, cache: PagedKVCache, seq_ids: list, chunks: list[list[int]]) -> list[torch.Tensor]:
    """One step of the paged cache: each sequence's chunk at its next positions; each chunk's logits (T_i, V)."""
    ids, positions = cache.prepare(seq_ids, chunks)
    logits = model(ids, cache.layers, input_pos=positions)  # (B, T, V)
    cache.commit(seq_ids)
    return [logits[i, : len(chunk)] for i, chunk in enumerate(chunks)]


def new_cache(model: GPT, sequences: int = 4, **options) -> PagedKVCache:
    return PagedKVCache(model, sequences=sequences, block_size=BLOCK, **options)


def assert_logits_of(model: GPT, tokens: list[int], logits: torch.Tensor, start: int = 0) -> None:
    """logits (T, V) are those of tokens[start : start + T] in a forward of tokens alone, without cache."""
    expected = whole(model, tokens)[start: start + logits.size(0)]
    torch.testing.assert_close(logits, expected, **EXACT)


def chunks_of(tokens: list[int], size: int) -> list[list[int]]:
    return [tokens[i: i + size] for i in range(0, len(tokens), size)]


# --------------------------------------------------------------------------- attention over blocks
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fused", [True, False])
def test_paged_attention_equals_a_contiguous_cache_and_a_forward_without_cache(kind, fused):
    model = tiny(kind, fused_attention=fused)
    prompts = [random_tokens(model, n, seed) for seed, n in enumerate([7, 12, 3])]  # blocks full, partial, one
    cache = new_cache(model)
    for seq_id in range(3):
        cache.add(seq_id, ())
    seen = feed(model, cache, [0, 1, 2], prompts)  # one prefill, rows padded to the longest
    sequences = [list(p) for p in prompts]
    for step in range(9):  # a batch of decoding steps, each row at its own position
        tokens = [random_tokens(model, 1, 100 + 3 * step + row) for row in range(3)]
        for row, logits in enumerate(feed(model, cache, [0, 1, 2], tokens)):
            seen[row] = torch.cat([seen[row], logits])
            sequences[row] += tokens[row]
    for row, fed in enumerate(sequences):
        assert_logits_of(model, fed, seen[row])
        contiguous = model.make_kv_caches(1, len(fed))
        with torch.inference_mode():  # the teaching cache, fed the same schedule: prompt, then one at a time
            reference = [model(torch.tensor([prompts[row]]), contiguous)[0]]
            reference += [model(torch.tensor([[t]]), contiguous, start_pos=p)[0]
                          for p, t in enumerate(fed) if p >= len(prompts[row])]
        torch.testing.assert_close(seen[row], torch.cat(reference), **EXACT)


def float64_gap(model: GPT, tokens: list[int]) -> float:
    """The largest |float32 - float64| logit of the model on these tokens (no cache)."""
    model64 = copy.deepcopy(model).double()
    return (whole(model, tokens).double() - whole(model64, tokens)).abs().max().item()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 16])
def test_prefill_in_chunks_equals_one_shot_in_float64_and_within_the_derived_tolerance_in_float32(kind, chunk):
    for dtype in (torch.float64, torch.float32):
        model = tiny(kind, dtype)
        tokens = random_tokens(model, 19, seed=3)
        one_shot, chunked = new_cache(model), new_cache(model)
        one_shot.add("a", tokens)
        chunked.add("a", tokens)
        expected = feed(model, one_shot, ["a"], [tokens])[0]
        logits = torch.cat([feed(model, chunked, ["a"], [piece])[0] for piece in chunks_of(tokens, chunk)])
        if dtype == torch.float64:
            torch.testing.assert_close(logits, expected, **EXACT)
            assert_logits_of(model, tokens, logits)
        else:
            tolerance = 4 * float64_gap(model, tokens)
            assert 0 < tolerance < 1e-3, tolerance  # float32 rounding of a tiny model, not a broken one
            assert (logits - expected).abs().max().item() <= tolerance


# --------------------------------------------------------------------------- sharing without seeing
@pytest.mark.parametrize("kind", KINDS)
def test_forked_sequences_never_see_each_others_tokens(kind):
    model = tiny(kind)
    prompt = random_tokens(model, 6, seed=1)  # a full block, then a partly filled one that both share
    cache = new_cache(model)
    cache.add("a", prompt)
    feed(model, cache, ["a"], [prompt])
    cache.fork("a", "b")
    a, b = list(prompt), list(prompt)
    for step in range(8):  # both write into the shared block first: each must get its own copy
        ta, tb = random_tokens(model, 1, 10 + step), random_tokens(model, 1, 50 + step)
        if ta == tb:
            tb = [(tb[0] + 1) % model.config.vocab_size]
        logits_a, logits_b = feed(model, cache, ["a", "b"], [ta, tb])
        a, b = a + ta, b + tb
        assert_logits_of(model, a, logits_a, start=len(a) - 1)
        assert_logits_of(model, b, logits_b, start=len(b) - 1)
    cache.fork("b", "c")  # a fork of a fork, fed alone: the others' blocks stay theirs
    tc = random_tokens(model, 3, seed=99)
    assert_logits_of(model, b + tc, feed(model, cache, ["c"], [tc])[0], start=len(b))
    tb = random_tokens(model, 1, seed=98)
    assert_logits_of(model, b + tb, feed(model, cache, ["b"], [tb])[0], start=len(b))


@pytest.mark.parametrize("kind", KINDS)
def test_truncate_and_rewrite_changes_only_the_sequence_truncated(kind):
    model = tiny(kind)
    prompt = random_tokens(model, 10, seed=2)
    cache = new_cache(model, rollback=8)  # a window keeps the 8 positions truncate may take back
    cache.add("a", prompt)
    feed(model, cache, ["a"], [prompt])
    cache.fork("a", "b")
    cache.truncate("b", 3)  # inside the first block, which "a" still holds: b's rewrite must copy it
    rewrite = random_tokens(model, 5, seed=20)
    assert_logits_of(model, prompt[:3] + rewrite, feed(model, cache, ["b"], [rewrite])[0], start=3)
    more = random_tokens(model, 2, seed=21)
    assert_logits_of(model, prompt + more, feed(model, cache, ["a"], [more])[0], start=len(prompt))
    a = prompt + more
    cache.truncate("a", 6)  # a block of its own, full and named by its hash, rewritten: the old prefix is gone
    rewrite = [(t + 1) % model.config.vocab_size for t in a[6:8]]
    assert_logits_of(model, a[:6] + rewrite, feed(model, cache, ["a"], [rewrite])[0], start=6)
    cache.add("c", prompt[:9])  # starts with the tokens a had before the rewrite: only the first block is theirs
    assert cache.pages["c"].length == BLOCK
    assert_logits_of(model, prompt[:9], feed(model, cache, ["c"], [prompt[BLOCK:9]])[0], start=BLOCK)


# --------------------------------------------------------------------------- shared prefixes
@pytest.mark.parametrize("kind", KINDS)
def test_a_shared_prefix_is_taken_from_the_cache_and_gives_the_logits_of_the_whole(kind):
    model = tiny(kind)
    first = random_tokens(model, 11, seed=4)
    cache = new_cache(model)
    assert cache.add("a", first) == 0  # nothing cached yet
    feed(model, cache, ["a"], [first])
    second = first[: 2 * BLOCK] + random_tokens(model, 5, seed=5)
    cached = cache.add("b", second)
    assert cached == 2 * BLOCK
    assert_logits_of(model, second, feed(model, cache, ["b"], [second[cached:]])[0], start=cached)
    third = [(first[1] + 1) % model.config.vocab_size if i == 1 else t for i, t in enumerate(second)]
    assert cache.add("c", third) == 0  # a token differs inside the first block: no block is the same
    assert cache.add("d", first[: 2 * BLOCK]) == BLOCK  # never the whole prompt: its last token must be fed
    cache.free("a")
    cache.free("b")
    assert cache.add("e", second) == 3 * BLOCK  # freed, a's first two blocks and b's third stay cached
    assert_logits_of(model, second, feed(model, cache, ["e"], [second[3 * BLOCK:]])[0], start=3 * BLOCK)


def test_prefix_sharing_off_caches_nothing():
    model = tiny("llama")
    cache = new_cache(model, prefix_sharing=False)
    tokens = random_tokens(model, 11, seed=4)
    cache.add("a", tokens)
    feed(model, cache, ["a"], [tokens])
    assert cache.add("b", tokens) == 0


# --------------------------------------------------------------------------- windows that forget
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_a_sliding_window_keeps_only_the_blocks_it_can_see_and_gives_the_rest_back(chunk):
    model = tiny("gemma")  # window 5: layers 0 and 2 slide, layer 1 sees everything
    window = model.config.sliding_window
    cache = new_cache(model, sequences=2)
    sliding = next(g for g in cache.groups if g.window == window)
    full = next(g for g in cache.groups if g.window is None)
    start = sliding.available()
    tokens = random_tokens(model, 37, seed=6)
    cache.add("a", tokens)
    logits = []
    for piece in chunks_of(tokens, chunk):
        logits.append(feed(model, cache, ["a"], [piece])[0])
        table = cache.pages["a"].tables[cache.groups.index(sliding)]
        assert sum(b != NULL_BLOCK for b in table) <= math.ceil(window / BLOCK) + 1, table
        assert sliding.available() >= start - (math.ceil(window / BLOCK) + 1)
    assert_logits_of(model, tokens, torch.cat(logits))
    assert NULL_BLOCK not in cache.pages["a"].tables[cache.groups.index(full)]  # the full layer keeps every block
    cache.free("a")
    assert sliding.available() == start


# --------------------------------------------------------------------------- the pool's accounting
@pytest.mark.parametrize("kind", KINDS)
def test_every_block_comes_back_after_free(kind):
    model = tiny(kind)
    cache = new_cache(model)
    start = [g.available() for g in cache.groups]
    prompt = random_tokens(model, 13, seed=7)
    cache.add("a", prompt)
    feed(model, cache, ["a"], [prompt])
    cache.add("b", prompt)  # shares a's first blocks
    feed(model, cache, ["b"], [prompt[cache.length("b"):]])
    cache.fork("a", "c")
    feed(model, cache, ["a", "c"], [[1, 2], [3]])
    cache.truncate("c", 5)
    feed(model, cache, ["c"], [[4, 5, 6]])
    assert cache.usage() > 0
    for seq_id in ["a", "b", "c"]:
        cache.free(seq_id)
    assert [g.available() for g in cache.groups] == start
    assert cache.usage() == 0
    assert all(refs == 0 for g in cache.groups for refs in g.refs)


def test_cached_blocks_nobody_holds_are_evicted_least_recently_used_first():
    model = tiny("gpt2")
    cache = new_cache(model, sequences=1, max_model_len=3 * BLOCK)  # 3 blocks in all
    (group,) = cache.groups
    first = random_tokens(model, 2 * BLOCK + 1, seed=8)
    cache.add("a", first)
    feed(model, cache, ["a"], [first])  # blocks x (named), y (named), z
    cache.free("a")  # x and y stay cached, idle in that order; z is free
    assert group.available() == 3 and len(group.idle) == 2
    assert cache.add("touch", first[: BLOCK + 1]) == BLOCK  # x used again: now the most recent
    cache.free("touch")
    other = random_tokens(model, BLOCK + 1, seed=9)  # 2 blocks: the free z, then the least recently used, y
    assert cache.add("b", other) == 0
    assert cache.usage() == 0  # nothing held yet: x, y idle, z free
    assert_logits_of(model, other, feed(model, cache, ["b"], [other])[0])
    cache.free("b")
    assert cache.add("c", first) == BLOCK  # x survived, y was taken
    assert_logits_of(model, first, feed(model, cache, ["c"], [first[BLOCK:]])[0], start=BLOCK)


def test_a_pool_that_cannot_hold_a_step_says_so_before_it_and_refuses_it():
    model = tiny("llama")
    cache = new_cache(model, sequences=1, max_model_len=2 * BLOCK)  # 2 blocks
    cache.add("a", ())
    cache.add("b", ())
    feed(model, cache, ["a"], [[1] * BLOCK])  # one block taken, one left
    assert cache.can_feed({"b": BLOCK}) and not cache.can_feed({"b": BLOCK + 1})
    with pytest.raises(NoFreeBlocks):
        cache.prepare(["b"], [[1] * (BLOCK + 1)])


# --------------------------------------------------------------------------- the engine
class Tokenizer:
    """What the engine asks of a tokenizer, without an end of text: every request runs to its max_tokens."""

    eot_token, n_vocab = None, 256

    def decode_bytes(self, ids):
        return bytes(ids)


def run(engine: Engine, prompts: list[list[int]], max_tokens: int, steps: int = 3000) -> list[list[int]]:
    """Submit every prompt, step the engine in this thread until all end (bounded); each request's tokens."""
    requests = [engine.submit(prompt, SamplingParams(max_tokens=max_tokens)) for prompt in prompts]
    for _ in range(steps):
        if not engine.running and not engine.queued:
            break
        engine.step()
    else:
        raise AssertionError(f"the requests did not finish within {steps} steps")
    assert [r.result(timeout=1).finish_reason for r in requests] == ["length"] * len(requests)
    return [r.token_ids for r in requests]


def alone(model: GPT, prompt: list[int], max_tokens: int) -> list[int]:
    return generate(model, torch.tensor([prompt]), max_tokens)[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_the_engine_and_generate_agree(kind):
    model = tiny(kind)
    prompts = [random_tokens(model, n, seed) for seed, n in enumerate([3, 9, 14, 6])]
    engine = Engine(model, Tokenizer(), max_slots=3, block_size=BLOCK)
    assert run(engine, prompts, 12) == [alone(model, p, 12) for p in prompts]


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_preemption_and_readmission_give_the_tokens_of_an_uninterrupted_run(kind):
    model = tiny(kind)
    budget = int(1.5 * engine_module.kv_cache_bytes(model, 1, model.config.context_length, block_size=BLOCK))
    engine = Engine(model, Tokenizer(), max_slots=3, kv_memory=budget, block_size=BLOCK)
    prompts = [random_tokens(model, n, seed) for seed, n in enumerate([6, 8, 5])]
    tokens = run(engine, prompts, 24)  # 3 x 30 positions: 3 x 8 blocks, in a pool of 15 for the full layers
    assert engine.stats.preempted > 0
    assert tokens == [alone(model, p, 24) for p in prompts]
    assert engine.cache.usage() == 0


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_chunked_prefill_in_the_engine_gives_the_tokens_of_one_shot_prefill(kind):
    model = tiny(kind)
    prompts = [random_tokens(model, n, seed) for seed, n in enumerate([17, 4, 11])]
    chunked = run(Engine(model, Tokenizer(), max_slots=3, block_size=BLOCK, prefill_chunk=3), prompts, 10)
    assert chunked == run(Engine(model, Tokenizer(), max_slots=3, block_size=BLOCK), prompts, 10)
    assert chunked == [alone(model, p, 10) for p in prompts]


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_prefix_sharing_in_the_engine_skips_the_shared_blocks_and_keeps_the_tokens(kind):
    model = tiny(kind)
    prefix = random_tokens(model, 2 * BLOCK, seed=11)  # two blocks: a system prompt
    prompts = [prefix + random_tokens(model, n, seed) for seed, n in enumerate([3, 5, 1])]
    results = {}
    for sharing in (True, False):
        engine = Engine(model, Tokenizer(), max_slots=3, block_size=BLOCK, prefix_sharing=sharing)
        first = run(engine, prompts[:1], 6)  # its blocks are named when it is prefilled: the others find them
        results[sharing] = first + run(engine, prompts[1:], 6)
        assert (engine.stats.cached_tokens > 0) == sharing, engine.stats.cached_tokens
    assert results[True] == results[False] == [alone(model, p, 6) for p in prompts]


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_requests_arriving_together_with_one_prefix_compute_it_once(kind):
    """The first is prefilled; the others wait a step for its blocks, then take them (what a GRPO group or a burst
    of chats with one system prompt does), and answer as generate does."""
    model = tiny(kind)
    prefix = random_tokens(model, 3 * BLOCK, seed=21)
    prompts = [prefix + random_tokens(model, 2, seed) for seed in range(4)]
    engine = Engine(model, Tokenizer(), max_slots=4, block_size=BLOCK)
    assert run(engine, prompts, 5) == [alone(model, p, 5) for p in prompts]
    assert engine.stats.cached_tokens == 3 * len(prefix)


def test_a_pool_too_small_for_one_request_is_refused_at_submission_and_a_window_makes_long_ones_fit():
    model = tiny("gemma", layer_types=None)  # every layer slides: a sequence needs one window, whatever its length
    budget = engine_module.kv_cache_bytes(model, 1, 4 * BLOCK, block_size=BLOCK, prefill_chunk=BLOCK)
    engine = Engine(model, Tokenizer(), max_slots=2, kv_memory=budget, block_size=BLOCK, prefill_chunk=BLOCK)
    prompt = random_tokens(model, 10, seed=13)
    length = model.config.context_length  # 40 positions, in a pool sized for 16 of them
    assert run(engine, [prompt], length - 10) == [alone(model, prompt, length - 10)]
    full = tiny("gemma", layer_types=None, sliding_window=None)  # the same layers, all full: 16 positions at most
    budget = engine_module.kv_cache_bytes(full, 1, 4 * BLOCK, block_size=BLOCK, prefill_chunk=BLOCK)
    engine = Engine(full, Tokenizer(), max_slots=2, kv_memory=budget, block_size=BLOCK, prefill_chunk=BLOCK)
    with pytest.raises(ValueError, match=r"cannot hold one sequence of 17 positions \(3 of prompt, 14 of completion"):
        engine.submit([1, 2, 3], SamplingParams(max_tokens=14))
    prompt = random_tokens(full, 3, seed=12)
    assert run(engine, [prompt], 13) == [alone(full, prompt, 13)]  # 16 positions: fits


def test_a_budget_below_one_full_length_sequence_gives_the_windows_their_share_first():
    """Sliding and full layers mixed: a budget for one 16-position sequence holds one of 16 positions (the windows
    get what one sequence needs, the full layers the rest), not the 4 a proportional split would leave."""
    mixed = tiny("gemma")
    budget = engine_module.kv_cache_bytes(mixed, 1, 4 * BLOCK, block_size=BLOCK, prefill_chunk=BLOCK)
    engine = Engine(mixed, Tokenizer(), max_slots=2, kv_memory=budget, block_size=BLOCK, prefill_chunk=BLOCK)
    assert engine.cache.longest() == 4 * BLOCK, engine.cache_description
    prompt = random_tokens(mixed, 3, seed=14)
    assert run(engine, [prompt], 13) == [alone(mixed, prompt, 13)]
    with pytest.raises(ValueError, match=r"cannot hold one sequence of 17 positions"):
        engine.submit([1, 2, 3], SamplingParams(max_tokens=14))


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_rows_in_order_are_read_in_place_and_give_what_the_gather_gives(kind):
    """generate's cache: rows reserved one after the other are read as a view of the pool; the same logits as
    gathering them (rows forked from one prompt are not in order, and are gathered)."""
    model = tiny(kind)
    prompts = [random_tokens(model, 7, seed) for seed in range(3)]
    logits = {}
    for in_place in (True, False):
        cache = PagedKVCache(model, sequences=3, block_size=BLOCK, max_model_len=16, lookahead=16, forget=False)
        for row in range(3):
            cache.add(row, ())
            if in_place:
                cache.reserve(row, 16)
        feed(model, cache, list(range(3)), prompts)
        cache.freeze(list(range(3)), 16)
        assert all((group.in_place is not None) == in_place for group in cache.groups)
        steps = []
        with torch.no_grad():
            for position in range(7, 12):
                token = torch.tensor([[position], [position + 1], [position + 2]])
                steps.append(model(token, cache.layers, input_pos=torch.tensor([position]))[:, -1])
        logits[in_place] = torch.stack(steps)
    torch.testing.assert_close(logits[True], logits[False], **EXACT)
    with torch.no_grad():
        expected = [whole(model, p + list(range(7 + r, 12 + r)))[7:12] for r, p in enumerate(prompts)]
    torch.testing.assert_close(logits[True], torch.stack(expected, dim=1), **EXACT)
