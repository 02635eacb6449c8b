"""Generation: greedy against transformers, cache against no cache, the samplers, EOS, context, text."""

import math
import os

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must never reach for the hub here

import transformers  # noqa: E402  (a test-only dependency, in requirements.txt)
from model_fixtures import LATER_SHAPES, randomize, successor_model  # noqa: E402

from llmscratch.model.config import GPTConfig  # noqa: E402
from llmscratch.model.generate import (
    compiled_decode_one_token,
    generate,
    generate_text,
    sample_next_token,
    scaled_logits,
    stream,
    stream_text,
    top_k_filter,
    top_p_filter,
)
from llmscratch.model.gpt import GPT
from llmscratch.model.weights import load_hf  # noqa: E402
from llmscratch.text.tokenizer import BPETokenizer, gpt2_encoding  # noqa: E402

TINY = {
    "gpt2": dict(vocab_size=97, context_length=32, d_model=32, n_layers=2, n_heads=4),
    "llama": dict(vocab_size=89, context_length=32, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2,
                  d_ff=80, norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False, bias=False,
                  tie_embeddings=False, rope_theta=50_000.0),
}
TINY.update({kind: dict(shape, context_length=32) for kind, shape in LATER_SHAPES.items()})


def tiny(kind: str, **overrides) -> GPT:
    model = GPT(GPTConfig(**{**TINY[kind], **overrides}))
    randomize(model, seed=0, scale=0.2)
    return model.eval()


def prompts(batch: int, length: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("kind", sorted(TINY))
def test_greedy_with_cache_equals_greedy_without(kind):
    model = tiny(kind)
    idx = prompts(3, 6, model.config.vocab_size)
    cached = generate(model, idx, 27)  # 6 + 27 - 1 = 32 = context_length: the cache's limit
    uncached = generate(model, idx, 27, use_cache=False)
    assert torch.equal(cached, uncached)
    assert cached.shape == (3, 33) and torch.equal(cached[:, :6], idx)
    assert all(len(set(row.tolist())) > 3 for row in cached[:, 6:])  # not one repeated token


def hf_gpt2():
    config = transformers.GPT2Config(vocab_size=311, n_positions=64, n_embd=48, n_layer=3, n_head=4,
                                     bos_token_id=None, eos_token_id=None, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config).eval()
    randomize(model, seed=1, scale=0.1)
    return model


def hf_llama():
    config = transformers.LlamaConfig(
        vocab_size=293, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=96,
        rope_theta=123_456.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config).eval()
    randomize(model, seed=2, scale=0.2)
    return model


@pytest.mark.parametrize("build", [hf_gpt2, hf_llama], ids=["gpt2", "llama-gqa"])
@pytest.mark.slow
def test_greedy_matches_transformers(tmp_path, build):
    reference = build()
    reference.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    idx = prompts(3, 8, ours.config.vocab_size)
    with torch.no_grad():  # no eos_token_id in the config: transformers runs all 40 steps too
        expected = reference.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=40,
                                      do_sample=False)
        top2 = reference(expected).logits[:, 7:-1].topk(2, dim=-1).values  # (B, 40, 2)
    # The check is only meaningful without near-ties, where rounding could pick either token.
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-4
    assert expected.shape == (3, 48)
    assert all(len(set(row.tolist())) > 3 for row in expected[:, 8:])  # not one repeated token
    assert torch.equal(generate(ours, idx, 40), expected)
    assert torch.equal(generate(ours, idx, 40, use_cache=False), expected)


@pytest.mark.slow
def test_compiled_decoding_compiles_once_and_matches_eager_and_transformers(tmp_path):
    """compile=True: one graph for 50 decoded tokens, the tokens of the eager path and of transformers."""
    reference = hf_gpt2()  # learned positions: the position table is read at a tensor too
    reference.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    idx = prompts(2, 8, ours.config.vocab_size, seed=4)
    with torch.no_grad():
        expected = reference.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=50,
                                      do_sample=False)
        top2 = reference(expected).logits[:, 7:-1].topk(2, dim=-1).values  # (B, 50, 2)
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-4  # no near-ties that rounding could flip
    torch._dynamo.reset()
    counters.clear()
    compiled = generate(ours, idx, 50, compile=True)
    assert counters["stats"]["unique_graphs"] == 1  # 49 cached steps, one compilation
    assert torch.equal(compiled, expected)
    assert torch.equal(generate(ours, idx, 50), expected)
    # Past the context (64 positions), the window slides as without the cache.
    idx = prompts(1, 40, ours.config.vocab_size, seed=5)
    assert torch.equal(generate(ours, idx, 30, compile=True), generate(ours, idx, 30, use_cache=False))


def test_each_compiled_decoding_step_is_made_once_per_process():
    """However the variant is asked for; the one with CUDA graphs is another function."""
    plain = compiled_decode_one_token()
    assert compiled_decode_one_token(False) is plain and compiled_decode_one_token(cuda_graphs=False) is plain
    graphs = compiled_decode_one_token(cuda_graphs=True)
    assert compiled_decode_one_token(True) is graphs and graphs is not plain


def first_steps(rows: torch.Tensor, token: int) -> list[float]:
    """For each row of new tokens (B, n), the step at which token first appears (inf if never)."""
    return [row.tolist().index(token) if token in row.tolist() else math.inf for row in rows]


@pytest.mark.parametrize("build", [hf_gpt2, hf_llama], ids=["gpt2", "llama-gqa"])
@pytest.mark.slow
def test_rows_stopping_at_eos_match_transformers(tmp_path, build):
    """A batch whose rows reach EOS at different steps: the same tokens and padding as transformers."""
    reference = build()
    reference.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    idx = prompts(4, 6, ours.config.vocab_size, seed=3)
    free_running = generate(ours, idx, 30)[:, 6:]  # (4, 30)
    # An EOS that some rows produce at different steps and some rows maybe never.
    eos = next(token for token in free_running[1, 2:].tolist() if len(set(first_steps(free_running, token))) >= 3)
    pad = 1 if eos == 0 else 0
    with torch.no_grad():
        expected = reference.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=30,
                                      do_sample=False, eos_token_id=eos, pad_token_id=pad)
    got = generate(ours, idx, 30, eos_id=eos, pad_id=pad)
    assert torch.equal(got, expected)
    finish = first_steps(got[:, 6:], eos)
    assert len(set(finish)) >= 3  # rows really stopped at different steps (or never)
    for row, step in zip(got[:, 6:].tolist(), finish):
        if step < math.inf:
            assert set(row[step + 1:]) <= {pad}


# --------------------------------------------------------------------------- samplers
def test_top_k_filter_keeps_the_k_largest():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    for k in (1, 5, 30, 100):
        filtered = top_k_filter(logits, k)
        for row, out in zip(logits.tolist(), filtered.tolist()):
            keep = set(sorted(range(30), key=lambda i: -row[i])[:k])
            assert all((out[i] == row[i]) if i in keep else out[i] == -math.inf for i in range(30))


def brute_force_nucleus(probs: list[float], p: float) -> set[int]:
    """The fewest tokens, most likely first (ties: lower id first), whose mass reaches p."""
    ranked = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    mass = 0.0
    for count, token in enumerate(ranked, start=1):
        mass += probs[token]
        if mass >= p:
            return set(ranked[:count])
    return set(ranked)


def test_top_p_filter_keeps_the_smallest_set_reaching_p():
    generator = torch.Generator().manual_seed(0)
    cases = [torch.randn(12, generator=generator) * scale for scale in (0.1, 1.0, 3.0, 10.0)]
    cases += [torch.randint(3, (12,), generator=generator).float() for _ in range(4)]  # many ties
    cases += [torch.zeros(12), torch.arange(100).remainder(3).eq(0).float()]  # long runs of ties
    checked = 0
    for logits in cases:
        probs = torch.softmax(logits, dim=-1).tolist()
        ranked = sorted(probs, reverse=True)
        prefix_masses = [sum(ranked[:n]) for n in range(1, len(ranked) + 1)]
        for p in torch.rand(20, generator=generator).tolist() + [1.0, 1e-9]:
            if p < 1.0 and min(abs(p - mass) for mass in prefix_masses) < 1e-5:
                continue  # within float rounding of a boundary, either answer is right
            kept = {i for i, x in enumerate(top_p_filter(logits, p).tolist()) if x != -math.inf}
            assert kept == brute_force_nucleus(probs, p), (logits, p)
            assert top_p_filter(logits, p)[sorted(kept)].equal(logits[sorted(kept)])
            checked += 1
    assert checked > 160
    assert top_p_filter(torch.zeros(12), 0.3).isfinite().tolist() == [True] * 4 + [False] * 8


def test_sampling_follows_the_softmax_probabilities():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    n = 20_000
    generator = torch.Generator().manual_seed(0)

    def frequencies(**sampling):
        draws = sample_next_token(logits.expand(n, 5), generator=generator, **sampling)
        return torch.bincount(draws, minlength=5).double() / n

    def softmax(values):  # by hand, in float64
        exps = [math.exp(v) for v in values]
        return torch.tensor([e / sum(exps) for e in exps], dtype=torch.float64)

    # 0.015 is over 4 standard deviations of a frequency over 20,000 draws.
    assert (frequencies(temperature=1.0) - softmax(logits.tolist())).abs().max() < 0.015
    scaled = [v / 2.0 for v in logits.tolist()]
    assert (frequencies(temperature=2.0) - softmax(scaled)).abs().max() < 0.015
    third = sorted(scaled)[-3]
    top3 = softmax([v if v >= third else -math.inf for v in scaled])  # the top 3 renormalised
    assert (frequencies(temperature=2.0, top_k=3) - top3).abs().max() < 0.015
    probs = softmax(logits.tolist())  # 0.563, 0.207, 0.126, 0.028, 0.076: the top 3 hold 0.896
    nucleus = torch.tensor([probs[0], probs[1], probs[2], 0, 0], dtype=torch.float64) / probs[:3].sum()
    assert (frequencies(temperature=1.0, top_p=0.85) - nucleus).abs().max() < 0.015


def test_top_k_one_and_a_tiny_top_p_are_greedy():
    model = tiny("llama")
    idx = prompts(3, 5, model.config.vocab_size)
    greedy = generate(model, idx, 20)
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(generate(model, idx, 20, temperature=1.5, top_k=1, generator=generator), greedy)
    assert torch.equal(generate(model, idx, 20, temperature=1.5, top_p=1e-6, generator=generator), greedy)


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-30])
def test_a_tiny_temperature_samples_the_largest_logits(temperature):
    """As the temperature goes to 0, sampling becomes greedy (ties: any of the largest); never NaN."""
    logits = torch.tensor([[2.0, 1.0, 2.0 - 1e-6, -3.0], [0.5, 3.0, 3.0, -1.0], [-5.0, -1.0, -1.0, -1.0]])
    generator = torch.Generator().manual_seed(0)
    draws = sample_next_token(logits.expand(200, 3, 4).reshape(600, 4).contiguous(), temperature,
                              generator=generator).view(200, 3)
    assert draws[:, 0].eq(0).all()  # one largest logit: greedy
    assert set(draws[:, 1].tolist()) == {1, 2}  # tied largest logits: both drawn
    assert set(draws[:, 2].tolist()) == {1, 2, 3}
    model = tiny("llama")
    idx = prompts(3, 5, model.config.vocab_size)
    assert torch.equal(generate(model, idx, 10, temperature=1e-45, generator=generator), generate(model, idx, 10))


@pytest.mark.parametrize("temperature", [5e-324, 1e-45, 1e-30, 1e-3, 0.7, 1.0, 3.0])
def test_scaling_by_the_temperature_without_float64_matches_float64(temperature):
    """What sampling does on MPS (no float64 there): the same probabilities, never NaN, however small the
    temperature; and no float64 tensor is made."""
    logits = torch.tensor([[2.0, 1.0, 2.0 - 1e-6, -3.0], [0.5, 3.0, 3.0, -1.0], [30.0, -20.0, 29.5, 0.0]])

    class NoFloat64(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            assert not (isinstance(out, torch.Tensor) and out.dtype == torch.float64), func
            return out

    with NoFloat64():
        narrow = torch.softmax(scaled_logits(logits, temperature, torch.float32), dim=-1)
    wide = torch.softmax(scaled_logits(logits, temperature, torch.float64), dim=-1)
    assert not narrow.isnan().any()
    assert torch.allclose(narrow, wide, rtol=1e-5, atol=1e-6), (narrow, wide)


@pytest.mark.slow
def test_sampling_is_reproducible_with_a_seed():
    model = tiny("gpt2")
    idx = prompts(3, 5, model.config.vocab_size)

    def sample(seed, **options):
        return generate(model, idx, 20, temperature=1.2, generator=torch.Generator().manual_seed(seed), **options)

    assert torch.equal(sample(1), sample(1))
    assert not torch.equal(sample(1), sample(2))
    assert torch.equal(sample(3, top_k=20, top_p=0.9), sample(3, top_k=20, top_p=0.9, use_cache=False))


@pytest.mark.parametrize("kind", sorted(TINY))
@pytest.mark.parametrize("use_cache", [True, False])
def test_samples_per_prompt_continue_each_prompt_as_its_repeated_rows_would(kind, use_cache):
    model = tiny(kind).double()
    idx = prompts(3, 5, model.config.vocab_size)

    def sample(batch, **options):
        return generate(model, batch, 30, temperature=1.3, eos_id=7, use_cache=use_cache,
                        generator=torch.Generator().manual_seed(4), **options)  # 5 + 30 > 32: past the cache too

    shared = sample(idx, samples_per_prompt=4)
    assert shared.shape[0] == 12 and torch.equal(shared, sample(idx.repeat_interleave(4, dim=0)))
    assert len({tuple(row) for row in shared[:4, 5:].tolist()}) > 1  # the samples of one prompt differ
    greedy = generate(model, idx, 10, use_cache=use_cache, samples_per_prompt=2)
    assert torch.equal(greedy, generate(model, idx, 10, use_cache=use_cache).repeat_interleave(2, dim=0))
    with pytest.raises(ValueError, match="samples_per_prompt must be at least 1, got 0"):
        generate(model, idx, 3, samples_per_prompt=0)


# --------------------------------------------------------------------------- EOS and streaming
CHAIN = {1: 2, 2: 3, 3: 4, 4: 5, 5: 6, 6: 7, 7: 8, 8: 8}  # 8 repeats forever


@pytest.mark.parametrize("use_cache", [True, False])
def test_each_row_stops_at_its_own_eos_and_is_padded(use_cache):
    model = successor_model(CHAIN, vocab_size=50)
    idx = torch.tensor([[0, 1], [0, 3], [0, 6]])
    out = generate(model, idx, 6, eos_id=5, pad_id=0, use_cache=use_cache)
    assert out[:, 2:].tolist() == [[2, 3, 4, 5, 0, 0], [4, 5, 0, 0, 0, 0], [7, 8, 8, 8, 8, 8]]
    padded_with_eos = generate(model, idx, 6, eos_id=5, use_cache=use_cache)  # pad_id defaults to eos_id
    assert padded_with_eos[:, 2:].tolist() == [[2, 3, 4, 5, 5, 5], [4, 5, 5, 5, 5, 5], [7, 8, 8, 8, 8, 8]]


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_ends_early_when_every_row_is_done(use_cache):
    model = successor_model(CHAIN, vocab_size=50)
    idx = torch.tensor([[1], [3], [5]])  # an EOS in the prompt does not finish a row
    out = generate(model, idx, 10, eos_id=6, pad_id=0, use_cache=use_cache)
    assert out.tolist() == [[1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 0, 0], [5, 6, 0, 0, 0, 0]]
    assert generate(model, idx, 10, use_cache=use_cache).shape == (3, 11)  # without eos_id: all 10


def test_stream_yields_the_tokens_of_generate():
    model = tiny("llama")
    idx = prompts(2, 4, model.config.vocab_size)
    options = dict(temperature=0.9, top_k=40, top_p=0.95, eos_id=7)
    expected = generate(model, idx, 25, generator=torch.Generator().manual_seed(5), **options)
    steps = list(stream(model, idx, 25, generator=torch.Generator().manual_seed(5), **options))
    assert all(step.shape == (2,) for step in steps)
    assert torch.equal(torch.stack(steps, dim=1), expected[:, 4:])


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_bfloat16_model_generates_the_same_tokens(use_cache):
    """Weights, activations and KV cache in bf16: the spelling model's margins survive the rounding."""
    model = successor_model(CHAIN, vocab_size=50)
    idx = torch.tensor([[0, 1], [0, 3], [0, 6]])
    expected = generate(model, idx, 6, eos_id=5, pad_id=0, use_cache=use_cache)
    got = generate(model.to(torch.bfloat16), idx, 6, eos_id=5, pad_id=0, use_cache=use_cache)
    assert torch.equal(got, expected)


def test_eval_mode_for_the_call_then_the_previous_mode():
    model = tiny("gpt2", dropout=0.5).train()
    idx = prompts(2, 4, model.config.vocab_size)
    out = generate(model, idx, 10)
    assert model.training  # restored
    assert torch.equal(out, generate(model.eval(), idx, 10))  # dropout was off while generating
    assert not model.training
    assert not out.is_inference()  # an ordinary tensor the caller may modify in place
    steps = stream(model.train(), idx, 10)
    next(steps)
    assert not model.training and not torch.is_inference_mode_enabled()  # only inside the steps
    steps.close()
    assert model.training


# --------------------------------------------------------------------------- context
@pytest.mark.parametrize("kind", sorted(TINY))
def test_without_cache_the_window_slides_over_the_last_context_length_tokens(kind):
    model = tiny(kind)  # context_length 32
    idx = prompts(2, 40, model.config.vocab_size)  # already longer than the context
    expected = idx
    with torch.no_grad():
        for _ in range(10):  # nanoGPT's loop
            next_ids = model(expected[:, -32:])[:, -1].argmax(dim=-1, keepdim=True)
            expected = torch.cat([expected, next_ids], dim=1)
    assert torch.equal(generate(model, idx, 10, use_cache=False), expected)


@pytest.mark.parametrize("kind", sorted(TINY))
@pytest.mark.parametrize("prompt_len, new_tokens", [(20, 13), (20, 14), (20, 30), (32, 5), (40, 6)])
def test_with_cache_past_the_context_the_window_slides_as_without(kind, prompt_len, new_tokens):
    """context_length 32: the cache is used while the sequence fits, then the window slides."""
    model = tiny(kind)
    idx = prompts(2, prompt_len, model.config.vocab_size, seed=prompt_len)
    cached = generate(model, idx, new_tokens)
    assert cached.shape == (2, prompt_len + new_tokens)
    assert torch.equal(cached, generate(model, idx, new_tokens, use_cache=False))


@pytest.mark.parametrize("change, message", [
    (dict(max_new_tokens=-1), "max_new_tokens must be >= 0, got -1"),
    (dict(temperature=-0.5), "temperature must be >= 0 .*got -0.5"),
    (dict(temperature=float("nan")), "temperature must be >= 0 .*got nan"),
    (dict(top_k=0), "top_k must be at least 1 .*got 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\] .*got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\] .*got 1.5"),
    (dict(idx=torch.tensor([1, 2, 3])), r"shape \(batch, prompt_length\).*got \(3,\)"),
    (dict(idx=torch.zeros(1, 0, dtype=torch.long)), r"got \(1, 0\)"),
    (dict(idx=torch.zeros(1, 3)), "LongTensor.*got torch.float32"),
    (dict(idx=torch.tensor([[1, 97]])), "ids 1..97, outside 0..96"),
    (dict(eos_id=97), "eos_id=97 is not a token id"),
    (dict(eos_id=3, pad_id=-1), "pad_id=-1 is not a token id"),
    (dict(pad_id=0), "pad_id=0 needs an eos_id"),
    (dict(compile="fast"), "compile must be False, True or 'cuda-graphs', got 'fast'"),
    (dict(compile=None), "compile must be False, True or 'cuda-graphs', got None"),
    (dict(compile="cuda-graphs"), "compile='cuda-graphs' needs a model on a CUDA device; this one is on cpu"),
])
def test_bad_arguments_are_named(change, message):
    model = tiny("gpt2")
    arguments = {"idx": torch.tensor([[1, 2]]), "max_new_tokens": 3, **change}
    with pytest.raises(ValueError, match=message):
        generate(model, **arguments)
    with pytest.raises(ValueError, match=message):
        stream(model, **arguments)  # checked at the call, before the first token is asked for


def test_zero_new_tokens_returns_the_prompt():
    idx = torch.tensor([[3, 4, 5]])
    assert torch.equal(generate(tiny("gpt2"), idx, 0), idx)


# --------------------------------------------------------------------------- text
TEXT = "Hello, wörld! 🦙 <|endoftext|> It's 2024."


@pytest.fixture(scope="module")
def gpt2_tokenizer():
    return BPETokenizer.gpt2()


def test_a_special_token_written_in_the_prompt_is_one_id(gpt2_tokenizer):
    """"<|endoftext|>" in a prompt is GPT-2's token 50256, not the 6 ids of its characters."""
    ids = gpt2_tokenizer.encode(TEXT, allowed_special="all")
    assert ids == gpt2_encoding().encode(TEXT, allowed_special={"<|endoftext|>"}) and 50256 in ids
    prompt = TEXT[:TEXT.index("<|") + len("<|endoftext|>")]  # ends with the special token
    model = successor_model({50256: ids[ids.index(50256) + 1]}, vocab_size=50257)  # after it: " It"
    for tokenizer in (gpt2_tokenizer, gpt2_encoding()):
        assert generate_text(model, tokenizer, prompt, 1) == prompt + " It"


def test_stream_text_yields_whole_characters_and_stops_at_eos(gpt2_tokenizer):
    ids = gpt2_tokenizer.encode(TEXT, allowed_special="all")
    assert len(set(ids)) == len(ids)  # each token has one successor in the spelling model
    # The llama emoji is 4 bytes over several tokens: single tokens are not whole characters.
    assert any("\ufffd" in gpt2_tokenizer.decode([token]) for token in ids)
    successor = dict(zip(ids, ids[1:] + [ids[-1]]))
    model = successor_model(successor, vocab_size=50257)
    steps = len(ids) - 1  # "Hello" is the first token; the model spells out the rest
    pieces = list(stream_text(model, gpt2_tokenizer, "Hello", steps))
    assert "".join(pieces) == TEXT[len("Hello"):]
    assert all(pieces) and not any("\ufffd" in piece for piece in pieces)
    assert generate_text(model, gpt2_tokenizer, "Hello", steps) == TEXT
    eos = gpt2_tokenizer.eot_token
    assert generate_text(model, gpt2_tokenizer, "Hello", steps, eos_id=eos) == TEXT[:TEXT.index("<|")]


def test_vocab_size_keeps_padding_ids_out(gpt2_tokenizer):
    """A model padded beyond its tokenizer (vocabulary rounded up for speed) never emits a padding id."""
    model = tiny("llama")  # 89 ids; say the tokenizer knows the first 40
    idx = prompts(4, 3, 40)
    sampled = generate(model, idx, 30, temperature=3.0, generator=torch.Generator().manual_seed(0), vocab_size=40)
    assert sampled[:, 3:].max() < 40
    unrestricted = generate(model, idx, 30, temperature=3.0, generator=torch.Generator().manual_seed(0))
    assert unrestricted[:, 3:].max() >= 40  # the restriction did something
    expected = idx
    with torch.no_grad():
        for _ in range(10):
            next_ids = model(expected)[:, -1, :40].argmax(dim=-1, keepdim=True)  # (B, 1)
            expected = torch.cat([expected, next_ids], dim=1)
    assert torch.equal(generate(model, idx, 10, vocab_size=40), expected)
    with pytest.raises(ValueError, match="vocab_size=90 must be between 1 and the model's 89"):
        generate(model, idx, 3, vocab_size=90)
    # stream_text restricts to the tokenizer by itself: GPT-2's 50,257 tokens in a model of 50,304.
    padded = GPT(GPTConfig(**{**TINY["gpt2"], "vocab_size": 50304}))
    randomize(padded, seed=0, scale=0.3)
    with torch.no_grad():
        padded.token_embedding.weight[50257:] = 0.0
        padded.token_embedding.weight[50257:, 0] = 100.0  # padding rows the head would pick every time
    text = generate_text(padded, gpt2_tokenizer, "Hello", 5, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert len(text) > len("Hello")
    with pytest.raises(ValueError, match="out of range"):  # without the restriction: undecodable ids
        generate_text(padded, gpt2_tokenizer, "Hello", 5, vocab_size=None)
