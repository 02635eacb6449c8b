"""Speculative decoding: a small draft model guesses k tokens, the large target model checks them in one forward.

A forward reads every weight once, however many tokens it is fed; where decoding one sequence is
bound by those reads, a forward of k + 1 tokens costs little more than a forward of one. So a cheap
draft proposes x_1..x_k one by one, the target scores the last token and all k guesses at once,
and the accept/reject rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023) keeps
a prefix of them and adds one token of its own. The tokens come out distributed exactly as the
target alone samples them (``generate`` with the same temperature, top-k and top-p): the draft
changes the speed, never the text's distribution, and with greedy decoding never the text (up to
rounding: a forward of k + 1 tokens may break a near-tie otherwise than a forward of one).

Cost model (Leviathan et al.'s, with the verification's cost measured rather than assumed to be
one step). With a per-token acceptance probability a, k drafted tokens, a draft step costing c
target steps and a (k+1)-token target forward costing v target steps, a round yields on average
(1 - a^(k+1)) / (1 - a) tokens (k + 1 when a = 1) for the price of k*c + v target steps, so the
speed-up over the target alone is that ratio (``predicted_speedup``).

Both models keep their keys and values in a paged KV cache (``llmscratch.model.paged``), the one
``generate`` and the engine use, with every block of the sequence given out at once (``freeze``), as
``generate`` does: a feed is then the model's forward and nothing else, and rolling a cache back after
rejected guesses is only moving where the next round writes: a query sees no key past its own position, so
the rejected keys are masked until they are overwritten.
"""

import dataclasses
import math

import torch

from llmscratch.model.checks import check_prompt, check_request, check_sampling
from llmscratch.model.generate import sampling_probs
from llmscratch.model.gpt import GPT, evaluating
from llmscratch.model.paged import PagedKVCache


# --------------------------------------------------------------------------- the cost model
def expected_tokens_per_round(acceptance: float, k: int) -> float:
    """Mean tokens a round yields when each of k guesses is accepted with probability ``acceptance``."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)  # 1 + a + a^2 + ... + a^k


def predicted_speedup(acceptance: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """Tokens/s of speculative decoding over the target's alone: tokens per round over a round's cost.

    draft_cost (c): a draft step's time over a target step's; verify_cost (v): the target's
    forward of k + 1 tokens over its one-token forward.
    """
    return expected_tokens_per_round(acceptance, k) / (k * draft_cost + verify_cost)


# --------------------------------------------------------------------------- the accept/reject rule
def acceptance_probability(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for each guess x, given p(x) and q(x) as tensors (k,).

    A token of q(x) = 0 is never drawn as a guess: it gets 1, a number rather than 0/0.
    """
    ratio = torch.where(draft_probs > 0, target_probs / draft_probs, 1.0)  # (k,)
    return ratio.clamp(max=1.0)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) over the vocabulary (V,): where a rejected guess is resampled from.

    The mass p has beyond q. If there is none (p == q, where no guess is ever rejected but rounding
    may still reject one), p itself.
    """
    residual = (target_probs - draft_probs).clamp(min=0.0)  # (V,)
    total = residual.sum()
    return residual / total if total > 0 else target_probs


def accept_draft(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                 generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling's rule: (n, token), the first n guesses kept, then one token of the target's.

    target_probs (k+1, V): p_1..p_{k+1}, the target's next-token probabilities after the context
    and after each guess; draft_probs (k, V): q_1..q_k, from which draft_tokens (k,) were drawn.
    Guess i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection
    the token is drawn from normalize(max(0, p_i - q_i)); if all k pass, a bonus from p_{k+1}.
    Each token then follows p_i exactly: accepted with q(x) min(1, p(x)/q(x)) = min(q(x), p(x)),
    resampled with the rest, the total rejected mass times the residual = max(0, p(x) - q(x)).
    """
    k = draft_tokens.size(0)
    rows = torch.arange(k, device=draft_tokens.device)  # (k,)
    accept = acceptance_probability(target_probs[rows, draft_tokens], draft_probs[rows, draft_tokens])  # (k,)
    uniforms = torch.rand(k, generator=generator, device=target_probs.device)  # (k,) in [0, 1)
    rejected = (uniforms >= accept).nonzero()  # (r, 1)
    n = int(rejected[0, 0]) if len(rejected) else k
    last = residual_distribution(target_probs[n], draft_probs[n]) if n < k else target_probs[k]  # (V,)
    return n, int(torch.multinomial(last, num_samples=1, generator=generator))


def accept_greedy(target_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int]:
    """The rule at temperature 0: keep guesses while they are the target's argmax, then take its argmax.

    target_tokens (k+1,): the target's argmax after the context and after each guess; draft_tokens (k,).
    (The sampling rule with one-hot p and q: min(1, p/q) is 1 on a match and 0 otherwise.)
    """
    k = draft_tokens.size(0)
    mismatches = (draft_tokens != target_tokens[:k]).nonzero()  # (r, 1)
    n = int(mismatches[0, 0]) if len(mismatches) else k
    return n, int(target_tokens[n])


# --------------------------------------------------------------------------- decoding
@dataclasses.dataclass(frozen=True)
class SpeculativeStats:
    """What a speculative generation did. Forwards count every call of a model, its prompt's prefill included."""

    rounds: int  # target verifications
    drafted: int  # guesses the draft made
    accepted: int  # guesses the target kept
    rejected: int  # rounds that ended on a rejected guess (at most one per round)
    target_forwards: int
    draft_forwards: int

    @property
    def acceptance_rate(self) -> float:
        """Share of the drafted tokens that were kept (NaN if none was drafted)."""
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def token_acceptance(self) -> float:
        """Estimate of the cost model's a: kept guesses over guesses judged (those after a rejection never are)."""
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else math.nan


@dataclasses.dataclass(frozen=True)
class SpeculativeOutput:
    tokens: torch.Tensor  # (1, T + n): the prompt and its continuation, as ``generate`` returns them
    stats: SpeculativeStats


def speculative_generate(target: GPT, draft: GPT, idx: torch.Tensor, max_new_tokens: int, *, k: int = 4,
                         temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                         eos_id: int | None = None, generator: torch.Generator | None = None) -> SpeculativeOutput:
    """``generate(target, idx, max_new_tokens, ...)`` for one prompt idx (1, T), sped up by the draft's guesses.

    Each round the draft guesses up to k tokens (fewer at the end, so that nothing past
    max_new_tokens is computed), the target checks them in one forward, and ``accept_greedy``
    (temperature 0) or ``accept_draft`` keeps a prefix plus one token: greedy gives the target's
    own tokens, sampling their distribution (the sampling settings shape p and q alike, as
    ``sample_next_token`` does). Generation stops after eos_id. T + max_new_tokens must fit both
    models' context (no sliding past it). Both models are in eval mode for the call.
    """
    _check_models(target, draft, idx, k)
    check_sampling(temperature, top_k, top_p)
    idx = check_prompt(target, idx)
    check_request(target.config, max_new_tokens, eos_id, None, None)
    total = idx.size(1) + max_new_tokens
    context = min(target.config.context_length, draft.config.context_length)
    if total > context:
        raise ValueError(f"prompt ({idx.size(1)} tokens) + max_new_tokens ({max_new_tokens}) = {total} must fit "
                         f"the models' context of {context} positions")
    with torch.inference_mode(), evaluating(target), evaluating(draft):
        tokens, stats = _decode(target, draft, idx, total, k, temperature, top_k, top_p, eos_id, generator)
    return SpeculativeOutput(torch.tensor([tokens], device=idx.device), stats)  # (1, T + n)


def _check_models(target: GPT, draft: GPT, idx: torch.Tensor, k: int) -> None:
    """ValueError naming the value unless k >= 1, idx holds one row and the models share vocabulary and device."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (tokens drafted per round) must be an integer >= 1, got {k!r}")
    if isinstance(idx, torch.Tensor) and idx.dim() == 2 and idx.size(0) != 1:
        raise ValueError(f"speculative decoding takes one prompt (batch size 1), got a batch of {idx.size(0)} "
                         f"(idx of shape {tuple(idx.shape)}); loop over the rows")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft's vocab_size={draft.config.vocab_size} must equal the target's "
                         f"{target.config.vocab_size}: both must score the same token ids")
    devices = (target.token_embedding.weight.device, draft.token_embedding.weight.device)
    if devices[0] != devices[1]:
        raise ValueError(f"the target (on {devices[0]}) and the draft (on {devices[1]}) must be on one device")


def _feed(model: GPT, cache: PagedKVCache, ids: list[int], start: int) -> torch.Tensor:
    """Logits (t, V) of the t ids fed at positions start..start+t-1, their keys and values cached there."""
    positions = torch.arange(start, start + len(ids), device=cache.device)  # (t,)
    return model(torch.tensor([ids], device=cache.device), cache.layers, input_pos=positions)[0]  # (t, V)


def _cache(model: GPT, total: int) -> PagedKVCache:
    """The paged cache of ``_decode``'s one sequence, every block given out at once (``PagedKVCache.freeze``): a feed
    is the model's forward alone, no bookkeeping between; the last position ever fed is total - 2."""
    length = total - 1
    cache = PagedKVCache(model, sequences=1, max_model_len=length, lookahead=length, prefix_sharing=False,
                         forget=False)
    cache.add(0, ())
    cache.reserve(0, length)
    cache.freeze([0], length)
    return cache


def _decode(target, draft, idx, total, k, temperature, top_k, top_p, eos_id, generator):
    """The rounds of ``speculative_generate`` on checked arguments: (every token as a list, the stats)."""
    tokens = idx[0].tolist()
    counts = dict(rounds=0, drafted=0, accepted=0, rejected=0, target_forwards=0, draft_forwards=0)
    if len(tokens) == total:
        return tokens, SpeculativeStats(**counts)
    # Each model's cache holds the positions it has seen: all tokens but the last, which the next round feeds.
    target_cache, draft_cache = _cache(target, total), _cache(draft, total)
    if len(tokens) > 1:
        _feed(target, target_cache, tokens[:-1], 0)
        _feed(draft, draft_cache, tokens[:-1], 0)
        counts["target_forwards"] += 1
        counts["draft_forwards"] += 1
    target_seen = draft_seen = len(tokens) - 1
    greedy = temperature == 0.0
    while len(tokens) < total:
        guesses = min(k, total - len(tokens) - 1)  # a full round then yields at most the tokens still wanted
        # The draft guesses one token at a time; its first forward also feeds what it has not seen:
        # the last token, and after a round that kept every guess, its last guess too.
        pending, drafted, draft_probs = tokens[draft_seen:], [], []
        for _ in range(guesses):
            logits = _feed(draft, draft_cache, pending, draft_seen)[-1:]  # (1, V)
            draft_seen += len(pending)
            if greedy:
                guess = int(logits.argmax())
            else:
                draft_probs.append(sampling_probs(logits, temperature, top_k, top_p)[0])  # (V,)
                guess = int(torch.multinomial(draft_probs[-1], num_samples=1, generator=generator))
            drafted.append(guess)
            pending = [guess]
        # The target scores the last token and every guess in one forward: p_1..p_{guesses+1}.
        logits = _feed(target, target_cache, tokens[target_seen:] + drafted, target_seen)  # (guesses+1, V)
        guess_ids = torch.tensor(drafted, dtype=torch.long, device=logits.device)  # (guesses,)
        if greedy:
            n, token = accept_greedy(logits.argmax(dim=-1), guess_ids)
        else:
            target_probs = sampling_probs(logits, temperature, top_k, top_p)  # (guesses+1, V)
            stacked = torch.stack(draft_probs) if draft_probs else target_probs[:0]  # (guesses, V)
            n, token = accept_draft(target_probs, stacked, guess_ids, generator)
        counts.update(rounds=counts["rounds"] + 1, drafted=counts["drafted"] + guesses,
                      accepted=counts["accepted"] + n, rejected=counts["rejected"] + (n < guesses),
                      target_forwards=counts["target_forwards"] + 1,
                      draft_forwards=counts["draft_forwards"] + guesses)
        new = drafted[:n] + [token]
        if eos_id is not None and eos_id in new:
            tokens += new[:new.index(eos_id) + 1]
            break
        tokens += new
        # Roll back: positions from len(tokens) - 1 on hold rejected guesses (or nothing yet), and are
        # overwritten by the next round before anything attends to them (a query sees only up to its own position).
        target_seen, draft_seen = len(tokens) - 1, min(draft_seen, len(tokens) - 1)
    return tokens, SpeculativeStats(**counts)
