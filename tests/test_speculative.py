"""Speculative decoding: greedy equals the target's own greedy tokens, and sampling follows the target's distribution.

The accept/reject rule is checked exactly (every outcome's probability, for a 5-token vocabulary) and
by sampling (a chi-square test at the 0.1% level, fixed seeds), and two wrong rules are shown to fail
that same test. End to end, the first tokens sampled through a draft follow the target's exact joint
distribution, computed by hand from full forwards without a cache.
"""

import itertools
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from model_fixtures import LATER_SHAPES, randomize
from processes import run

from llmscratch.deployment import speculative
from llmscratch.deployment.speculative import (accept_draft, accept_greedy, acceptance_probability,
                                               expected_tokens_per_round, predicted_speedup, residual_distribution,
                                               speculative_generate)
from llmscratch.model.config import GPTConfig
from llmscratch.model.generate import generate
from llmscratch.model.gpt import GPT

TINY = {  # a GPT-2-style model and a Llama-style one with grouped-query attention and RoPE
    "gpt2": dict(vocab_size=97, context_length=32, d_model=32, n_layers=2, n_heads=4),
    "llama": dict(vocab_size=89, context_length=32, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2,
                  d_ff=80, norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False, bias=False,
                  tie_embeddings=False, rope_theta=50_000.0),
}
SIGNIFICANCE = 0.001  # every chi-square test below rejects "the samples follow p" below this p-value


def tiny(kind: str, seed: int = 0, **overrides) -> GPT:
    model = GPT(GPTConfig(**{**TINY[kind], **overrides}))
    randomize(model, seed=seed, scale=0.2)
    return model.eval()


def noisy_copy(model: GPT, seed: int, scale: float) -> GPT:
    """The model with noise added to every weight: a draft that agrees with it often, not always."""
    copy = GPT(model.config)
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copy.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return copy.eval()


def prompt(length: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("kind", sorted(TINY))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_gives_the_targets_own_tokens(kind, k):
    target = tiny(kind)
    drafts = {"random": tiny(kind, seed=1), "noisy copy": noisy_copy(target, seed=2, scale=0.02), "itself": target}
    rates = {}
    for prompt_len, new_tokens in [(1, 13), (4, 17), (9, 10)]:  # 13, 17, 10: no multiple of k + 1 = 2, 4, 6 but 10
        idx = prompt(prompt_len, target.config.vocab_size, seed=prompt_len)
        expected = generate(target, idx, new_tokens)
        for name, draft in drafts.items():
            out = speculative_generate(target, draft, idx, new_tokens, k=k)
            assert torch.equal(out.tokens, expected), (name, prompt_len)
            rates.setdefault(name, []).append(out.stats.acceptance_rate)
    assert all(rate == 1.0 for rate in rates["itself"])
    assert max(rates["random"]) < 0.5  # a draft that disagrees often ...
    assert 0.0 < min(rates["noisy copy"]) and max(rates["noisy copy"]) < 1.0  # ... and one that agrees some of the time


@pytest.mark.parametrize("kind", sorted(TINY))
@pytest.mark.parametrize("prompt_len, new_tokens", [(18, 14), (31, 1), (25, 7)])
def test_greedy_up_to_the_context_limit(kind, prompt_len, new_tokens):
    """prompt + new tokens == context_length (32): the last round drafts fewer guesses, no position overflows."""
    target = tiny(kind)
    idx = prompt(prompt_len, target.config.vocab_size, seed=3)
    expected = generate(target, idx, new_tokens)
    for draft in (noisy_copy(target, seed=4, scale=0.02), target):
        assert torch.equal(speculative_generate(target, draft, idx, new_tokens, k=4).tokens, expected)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_with_sliding_window_layers_gives_the_targets_own_tokens(k):
    """Gemma-like layers of a 5-key window beside a full one: rolled-back guesses stay masked until overwritten,
    in the window's layers as in the full one (40 positions, three blocks of 16), and greedy is the target's own."""
    config = GPTConfig(**{**LATER_SHAPES["gemma"], "context_length": 48})
    target = GPT(config)
    randomize(target, seed=0, scale=0.2)
    target.eval()
    for prompt_len, new_tokens in [(2, 38), (21, 19), (33, 15)]:
        idx = prompt(prompt_len, config.vocab_size, seed=prompt_len)
        expected = generate(target, idx, new_tokens)
        for draft in (noisy_copy(target, seed=7, scale=0.05), target):
            out = speculative_generate(target, draft, idx, new_tokens, k=k)
            assert torch.equal(out.tokens, expected), prompt_len
            assert out.stats.rejected > 0 or draft is target


def test_counts_of_a_draft_that_is_always_right():
    """k = 3, 13 new tokens: three full rounds of 4 tokens, then one of a single token with nothing drafted."""
    target = tiny("llama")
    stats = speculative_generate(target, target, prompt(5, 89), 13, k=3).stats
    assert (stats.rounds, stats.drafted, stats.accepted, stats.rejected) == (4, 9, 9, 0)
    assert stats.target_forwards == 1 + 4  # the prompt's prefill, then one verification per round
    # prefill, then 3 guesses per full round; after a round that kept everything, the first step feeds 2 tokens
    assert stats.draft_forwards == 1 + 9
    assert stats.acceptance_rate == stats.token_acceptance == 1.0


def test_generation_stops_after_eos_as_generate_does():
    target = tiny("gpt2")
    idx = prompt(3, 97, seed=5)
    free = generate(target, idx, 20)
    eos_id = int(free[0, 3 + 6])  # the 7th new token
    first = (free[0, 3:] == eos_id).nonzero()[0, 0].item()  # its first occurrence (maybe earlier)
    expected = generate(target, idx, 20, eos_id=eos_id)
    assert torch.equal(expected, free[:, :3 + first + 1])
    for draft in (target, noisy_copy(target, seed=6, scale=0.02)):
        assert torch.equal(speculative_generate(target, draft, idx, 20, k=4, eos_id=eos_id).tokens, expected)


def test_zero_new_tokens_returns_the_prompt():
    target = tiny("gpt2")
    idx = prompt(4, 97)
    out = speculative_generate(target, target, idx, 0)
    assert torch.equal(out.tokens, idx) and out.stats.rounds == 0 and math.isnan(out.stats.acceptance_rate)


# --------------------------------------------------------------------------- the rule, exactly
def rule_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(p, q) pairs over 5 tokens, in float64."""
    def probs(*values):
        values = torch.tensor(values, dtype=torch.float64)
        return values / values.sum()

    return {
        "p differs from q": (probs(0.4, 0.3, 0.15, 0.1, 0.05), probs(0.1, 0.2, 0.3, 0.15, 0.25)),
        "q has zeros where p has mass": (probs(0.3, 0.3, 0.2, 0.1, 0.1), probs(0.6, 0.0, 0.4, 0.0, 0.0)),
        "p has zeros where q has mass": (probs(0.0, 0.5, 0.0, 0.5, 0.0), probs(0.2, 0.2, 0.2, 0.2, 0.2)),
        "p equals q": (probs(0.1, 0.2, 0.3, 0.4, 0.0), probs(0.1, 0.2, 0.3, 0.4, 0.0)),
        "one-hot, different tokens": (probs(0, 0, 1, 0, 0), probs(0, 1, 0, 0, 0)),
    }


def test_the_rules_pieces_by_their_formulas():
    for p, q in rule_cases().values():
        tokens = torch.arange(5)
        ratio = [min(1.0, pi / qi) if qi > 0 else 1.0 for pi, qi in zip(p.tolist(), q.tolist())]
        assert acceptance_probability(p[tokens], q[tokens]).tolist() == pytest.approx(ratio, abs=1e-12)
        residual = [max(0.0, pi - qi) for pi, qi in zip(p.tolist(), q.tolist())]
        expected = [r / sum(residual) for r in residual] if sum(residual) > 0 else p.tolist()
        assert residual_distribution(p, q).tolist() == pytest.approx(expected, abs=1e-12)


def outcome_probabilities(ps: list[torch.Tensor], qs: list[torch.Tensor]) -> dict[tuple, float]:
    """Every outcome of one round with k = len(qs) guesses, as the emitted tokens, and its probability.

    Guess i is drawn from q_i and kept with acceptance_probability; the first rejected one is
    replaced by a draw from residual_distribution; after k kept guesses a bonus comes from p_{k+1}.
    """
    k, vocab = len(qs), len(ps[0])
    outcomes: dict[tuple, float] = {}
    for n in range(k + 1):  # guesses kept
        for kept in itertools.product(range(vocab), repeat=n):
            reach = 1.0
            for i, x in enumerate(kept):
                reach *= float(qs[i][x] * acceptance_probability(ps[i][x:x + 1], qs[i][x:x + 1])[0])
            if n < k:  # guess n + 1 is rejected: its rejected mass, then a token from the residual
                rejected = float((qs[n] * (1 - acceptance_probability(ps[n], qs[n]))).sum())
                last = rejected * residual_distribution(ps[n], qs[n])
            else:
                last = ps[k]
            for y in range(vocab):
                if reach * last[y] > 0:
                    emitted = kept + (y,)
                    outcomes[emitted] = outcomes.get(emitted, 0.0) + reach * float(last[y])
    return outcomes


@pytest.mark.parametrize("case", sorted(rule_cases()))
def test_each_emitted_token_follows_p_exactly(case):
    """k = 2 with the case's (p, q) first, then other pairs: the emitted token at position i, given
    the round reached it, has probability p_i, for every token and position."""
    p, q = rule_cases()[case]
    others = list(rule_cases().values())
    ps, qs = [p, others[1][0], others[2][0]], [q, others[0][1]]
    outcomes = outcome_probabilities(ps, qs)
    assert sum(outcomes.values()) == pytest.approx(1.0, abs=1e-12)
    for position in range(3):
        for prefix in itertools.product(range(5), repeat=position):  # tokens emitted before, all kept guesses
            reached = {o: pr for o, pr in outcomes.items() if len(o) > position and o[:position] == prefix}
            total = sum(reached.values())
            if total == 0:
                continue
            emitted = [sum(pr for o, pr in reached.items() if o[position] == y) / total for y in range(5)]
            assert emitted == pytest.approx(ps[position].tolist(), abs=1e-12), (position, prefix)


def test_greedy_rule_is_the_sampling_rule_with_one_hot_probabilities():
    generator = torch.Generator().manual_seed(0)
    for seed in range(50):
        draws = torch.randint(4, (7,), generator=torch.Generator().manual_seed(seed))
        target_tokens, draft_tokens = draws[:4], draws[4:]  # k = 3, vocabulary of 4: matches are frequent
        one_hot = torch.eye(4, dtype=torch.float64)
        assert accept_draft(one_hot[target_tokens], one_hot[draft_tokens], draft_tokens, generator) == \
            accept_greedy(target_tokens, draft_tokens)


# --------------------------------------------------------------------------- the rule, by sampling
def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """P(X >= the statistic) for counts against probabilities; cells expected below 5 merged into one.

    A cell of probability 0 must be empty (otherwise 0.0 is returned). The chi-square tail is the
    regularised upper incomplete gamma function: P(X >= x) = Q(dof / 2, x / 2).
    """
    observed, expected_probs = observed.double(), expected_probs.double()
    if observed[expected_probs == 0].sum() > 0:
        return 0.0
    expected = expected_probs * observed.sum()
    small = (expected < 5) & (expected > 0)
    big = expected >= 5
    cells_observed = torch.cat([observed[big], observed[small].sum().reshape(1)])
    cells_expected = torch.cat([expected[big], expected[small].sum().reshape(1)])
    keep = cells_expected > 0
    statistic = ((cells_observed[keep] - cells_expected[keep]) ** 2 / cells_expected[keep]).sum()
    dof = int(keep.sum()) - 1
    if dof == 0:  # one possible outcome, and every sample is it
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def test_chi_square_p_value_against_the_table():
    # The table's critical values: 13.277 (dof 4, 1%) and 29.588 (dof 10, 0.1%): built as counts with that statistic.
    for dof, critical, level in [(4, 13.277, 0.01), (10, 29.588, 0.001)]:
        n = 10_000
        expected = torch.full((dof + 1,), n / (dof + 1), dtype=torch.float64)
        shift = math.sqrt(critical * expected[0] / 2)  # one cell up, one down: statistic = 2 shift^2 / expected
        observed = expected.clone()
        observed[0] += shift
        observed[1] -= shift
        assert chi_square_p_value(observed, expected / n) == pytest.approx(level, rel=1e-3)


def sample_rounds(ps: list[torch.Tensor], qs: list[torch.Tensor], rounds: int, seed: int) -> list[list[int]]:
    """The tokens accept_draft emits in each of ``rounds`` rounds with guesses drawn from qs."""
    generator = torch.Generator().manual_seed(seed)
    guesses = torch.stack([torch.multinomial(q, rounds, replacement=True, generator=generator) for q in qs], dim=1)
    target_probs, draft_probs = torch.stack(ps), torch.stack(qs)  # (k+1, V), (k, V)
    emitted = []
    for row in guesses:  # (k,)
        n, token = accept_draft(target_probs, draft_probs, row, generator)
        emitted.append(row[:n].tolist() + [token])
    return emitted


def position_p_values(ps: list[torch.Tensor], qs: list[torch.Tensor], rounds: int = 10_000,
                      seed: int = 0) -> list[float]:
    """Each position's chi-square p-value: the tokens emitted there (in rounds that reached it) against p_i."""
    emitted = sample_rounds(ps, qs, rounds, seed)
    values = []
    for position, p in enumerate(ps):
        tokens = torch.tensor([tokens[position] for tokens in emitted if len(tokens) > position], dtype=torch.long)
        if len(tokens) >= 200:  # enough rounds reached it to test
            values.append(chi_square_p_value(torch.bincount(tokens, minlength=len(p)), p))
    return values


@pytest.mark.parametrize("case", sorted(rule_cases()))
def test_sampled_tokens_follow_p(case):
    p, q = (t.float() for t in rule_cases()[case])
    others = list(rule_cases().values())
    ps, qs = [p, others[0][0].float(), others[1][0].float()], [q, q]  # k = 2
    values = position_p_values(ps, qs)
    assert len(values) >= 1 and min(values) > SIGNIFICANCE, values


WRONG_RULES = {
    "always accept": ("acceptance_probability", lambda p, q: torch.ones_like(p)),
    "resample from p, not max(0, p - q)": ("residual_distribution", lambda p, q: p),
}


@pytest.mark.parametrize("wrong", sorted(WRONG_RULES))
def test_a_wrong_rule_fails_the_same_check(wrong, monkeypatch):
    name, replacement = WRONG_RULES[wrong]
    monkeypatch.setattr(speculative, name, replacement)
    p, q = (t.float() for t in rule_cases()["p differs from q"])
    assert min(position_p_values([p, p, p], [q, q])) < SIGNIFICANCE


def test_tokens_per_round_follow_the_cost_model():
    """With the same p and q at every position each guess is kept with probability a = sum min(p, q),
    independently: the mean tokens per round is expected_tokens_per_round(a, k) (here within 2%)."""
    p, q = (t.float() for t in rule_cases()["p differs from q"])
    a = float(torch.minimum(p, q).sum())
    for k in (1, 4):
        emitted = sample_rounds([p] * (k + 1), [q] * k, 5_000, seed=k)
        mean = sum(len(tokens) for tokens in emitted) / len(emitted)
        assert mean == pytest.approx(expected_tokens_per_round(a, k), rel=0.02)
        assert expected_tokens_per_round(a, k) == pytest.approx(sum(a ** i for i in range(k + 1)))
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert predicted_speedup(0.5, 2, draft_cost=0.1, verify_cost=1.3) == pytest.approx(1.75 / 1.5)


# --------------------------------------------------------------------------- sampling, end to end
def target_joint(model: GPT, idx: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """P(first new token, second new token) (V, V) when the model alone samples, from full forwards, by hand."""
    def probs(ids: torch.Tensor) -> torch.Tensor:  # (V,): softmax of the last logits / temperature, top-k kept
        with torch.no_grad():
            logits = model(ids)[0, -1].double() / temperature
        if top_k is not None:
            logits[logits < logits.sort(descending=True).values[top_k - 1]] = -math.inf
        return torch.softmax(logits, dim=-1)

    first = probs(idx)
    vocab = len(first)
    return torch.stack([first[x] * probs(torch.cat([idx, torch.tensor([[x]])], dim=1)) for x in range(vocab)])


SMALL = dict(vocab_size=5, context_length=8, d_model=8, n_layers=1, n_heads=2)


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.8, 3)])
def test_sampled_text_follows_the_targets_distribution(temperature, top_k):
    """k = 2, 3 new tokens: the first two tokens' joint frequencies (1,000 generations) against the exact joint."""
    target, draft = GPT(GPTConfig(**SMALL)), GPT(GPTConfig(**SMALL))
    randomize(target, seed=0, scale=0.5)
    randomize(draft, seed=1, scale=0.5)
    idx = torch.tensor([[3]])
    joint = target_joint(target.eval(), idx, temperature, top_k).flatten()  # (25,)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(25, dtype=torch.long)
    accepted = 0
    for _ in range(1_000):
        out = speculative_generate(target, draft.eval(), idx, 3, k=2, temperature=temperature, top_k=top_k,
                                   generator=generator)
        first, second = out.tokens[0, 1:3].tolist()
        counts[5 * first + second] += 1
        accepted += out.stats.accepted
    assert chi_square_p_value(counts, joint) > SIGNIFICANCE
    assert 0 < accepted < 2 * 1_000  # both paths taken: guesses kept and guesses rejected


def test_sampled_text_with_a_wrong_rule_fails_the_same_check(monkeypatch):
    monkeypatch.setattr(speculative, "acceptance_probability", lambda p, q: torch.ones_like(p))
    target, draft = GPT(GPTConfig(**SMALL)), GPT(GPTConfig(**SMALL))
    randomize(target, seed=0, scale=0.5)
    randomize(draft, seed=1, scale=0.5)
    idx = torch.tensor([[3]])
    joint = target_joint(target.eval(), idx, 1.0, None).flatten()
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(25, dtype=torch.long)
    for _ in range(500):
        first, second = speculative_generate(target, draft.eval(), idx, 3, k=2, temperature=1.0,
                                             generator=generator).tokens[0, 1:3].tolist()
        counts[5 * first + second] += 1
    assert chi_square_p_value(counts, joint) < SIGNIFICANCE


def test_sampling_is_reproducible_with_a_seed():
    target = tiny("llama")
    draft = noisy_copy(target, seed=1, scale=0.02)
    idx = prompt(3, 89)

    def sample(seed):
        return speculative_generate(target, draft, idx, 12, k=3, temperature=1.0, top_p=0.9,
                                    generator=torch.Generator().manual_seed(seed)).tokens

    assert torch.equal(sample(1), sample(1))
    assert not torch.equal(sample(1), sample(2))


# --------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("change, message", [
    (dict(idx=torch.tensor([[1, 2], [3, 4]])), r"batch size 1\), got a batch of 2"),
    (dict(k=0), "k .* must be an integer >= 1, got 0"),
    (dict(k=2.5), "k .* must be an integer >= 1, got 2.5"),
    (dict(k=True), "k .* must be an integer >= 1, got True"),
    (dict(draft="other vocabulary"), "the draft's vocab_size=50 must equal the target's 97"),
    (dict(max_new_tokens=31), r"prompt \(2 tokens\) \+ max_new_tokens \(31\) = 33 must fit the models' context of 32"),
    (dict(draft="shorter context"), "= 7 must fit the models' context of 6"),
    (dict(max_new_tokens=-1), "max_new_tokens must be >= 0, got -1"),
    (dict(temperature=-1.0), "temperature must be >= 0 .*got -1.0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\] .*got 0.0"),
    (dict(eos_id=97), "eos_id=97 is not a token id"),
    (dict(idx=torch.tensor([[1, 97]])), "ids 1..97, outside 0..96"),
    (dict(idx=torch.zeros(1, 2)), "LongTensor.*got torch.float32"),
])
def test_bad_arguments_are_named(change, message):
    target = tiny("gpt2")
    drafts = {"other vocabulary": tiny("gpt2", vocab_size=50), "shorter context": tiny("gpt2", context_length=6)}
    arguments = {"target": target, "draft": target, "idx": torch.tensor([[1, 2]]), "max_new_tokens": 5, **change}
    arguments["draft"] = drafts.get(arguments["draft"], arguments["draft"])
    with pytest.raises(ValueError, match=message):
        speculative_generate(**arguments)


@pytest.mark.timeout(120)
def test_the_benchmark_refuses_a_draft_of_another_vocabulary(tmp_path):
    """Exit status 2 and a message naming the vocabularies, before any training or timing."""
    from llmscratch.model.checkpoint import export_model

    export_model(tiny("gpt2"), tmp_path / "other.safetensors")
    root = Path(__file__).resolve().parents[1]
    done = run([sys.executable, "-m", "benchmarks.bench_speculative", "--draft", str(tmp_path / "other.safetensors")],
               timeout=90, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "needs the target's 4096-token vocabulary" in done.stderr and "Traceback" not in done.stderr
