"""Chapter 6's exercise checks: the worked answers pass, plausible wrong answers fail with the right hint."""

import math
from difflib import SequenceMatcher
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from exercise_suite import ExerciseSuite, solutions

from llmscratch.alignment.grpo import clipped_objective, group_advantages, pass_at_k
from llmscratch.alignment.metrics import longest_common_subsequence, rouge_l, rouge_tokens, wilson_interval
from llmscratch.alignment.preference import collate_pairs, dpo_loss, sequence_logprobs
from llmscratch.exercises import ch06
from llmscratch.exercises.ch06_references import (clipped_objective64, dpo64, group_advantages64, ipo_loss64,
                                                  longest_common_substring, response_logprobs64, simpo_loss64, wilson64)
from llmscratch.exercises.fixtures import tiny_gpt
from llmscratch.model.losses import IGNORE_INDEX

sol = solutions(ch06)


def verdict(answer, name):
    return ch06.CHAPTER.check(answer, name, quiet=True)


# --------------------------------------------------------------------------- wrong answers
def scores_with(tie_wins=False, count=False, per_pair=False, undivided=False):
    """preference_scores with one slip: a tie as a win, a count, the mean of per-pair ratios, no division by beta."""
    def answer(chosen, rejected, tokens, beta):
        scores = sol.preference_scores(chosen, rejected, tokens, beta)
        wins = (chosen >= rejected) if tie_wins else (chosen > rejected)
        scores["accuracy"] = wins.float().sum().item() if count else wins.float().mean().item()
        if per_pair:
            scores["chosen_log_ratio_per_token"] = (chosen / beta / tokens).mean().item()
        if undivided:
            scores["chosen_log_ratio_per_token"] = (chosen.sum() / tokens.sum()).item()
        return scores
    return answer


def wilson_with(**slip):
    return lambda successes, trials, z=1.96: wilson64(successes, trials, z, **slip)


def normal_approximation(successes, trials, z=1.96):
    p = successes / trials
    half = z * math.sqrt(p * (1 - p) / trials)
    return p - half, p + half


def logprobs_with(shift=0, masked=True, mean=False, normalised=True, no_grad=False):
    """response_logprobs with one slip, computed from the model's logits."""
    def answer(model, inputs, targets):
        with torch.set_grad_enabled(not no_grad):
            return response_logprobs64(model(inputs), targets, shift=shift, masked=masked, mean=mean,
                                       normalised=normalised).float()
    return answer


def gather_minus_100(model, inputs, targets):
    """Picks the targets straight away: gather fails on the -100s."""
    picked = F.log_softmax(model(inputs), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (picked * (targets != IGNORE_INDEX)).sum(-1)


def dpo_with(**slip):
    def answer(pc, pr, rc, rr, beta, label_smoothing=0.0):
        loss, chosen, rejected = sol.dpo_loss_and_rewards(pc, pr, rc, rr, beta, label_smoothing)
        wrong = dpo64(pc, pr, rc, rr, beta, label_smoothing, **slip)
        return loss + (wrong[0].float() - loss.detach()), chosen, rejected  # the wrong value, the right gradient
    return answer


def dpo_flipped_weights(pc, pr, rc, rr, beta, label_smoothing=0.0):
    """Label smoothing's two weights exchanged: at label_smoothing 0 it scores the flipped label only."""
    margin = beta * ((pc - rc) - (pr - rr))
    losses = -label_smoothing * F.logsigmoid(margin) - (1 - label_smoothing) * F.logsigmoid(-margin)
    return losses.mean(), beta * (pc - rc).detach(), beta * (pr - rr).detach()


def dpo_naive(pc, pr, rc, rr, beta, label_smoothing=0.0):
    """-log(sigmoid(x)): right until the margin is about -100, then inf."""
    margin = beta * ((pc - rc) - (pr - rr))
    losses = -(1 - label_smoothing) * torch.log(torch.sigmoid(margin)) - label_smoothing * torch.log(
        torch.sigmoid(-margin))
    return losses.mean(), beta * (pc - rc).detach(), beta * (pr - rr).detach()


def dpo_rewards_with(unscaled=False, attached=False, item=False):
    def answer(pc, pr, rc, rr, beta, label_smoothing=0.0):
        loss, chosen, rejected = sol.dpo_loss_and_rewards(pc, pr, rc, rr, beta, label_smoothing)
        if unscaled:
            chosen, rejected = chosen / beta, rejected / beta
        if attached:
            chosen, rejected = beta * (pc - rc), beta * (pr - rr)
        if item:
            loss = torch.tensor(loss.item())
        return loss, chosen, rejected
    return answer


def rouge_with(words=rouge_tokens, harmonic=True, in_order=True, contiguous=False):
    """rouge_l_f1 with one slip: words split on spaces, a plain mean, words in any order, a contiguous run."""
    def answer(prediction, reference):
        predicted, wanted = words(prediction), words(reference)
        if contiguous:
            common = longest_common_substring(predicted, wanted)
        elif in_order:
            common = longest_common_subsequence(predicted, wanted)
        else:
            common = sum(min(predicted.count(w), wanted.count(w)) for w in set(predicted))
        if common == 0:
            return 0.0
        precision, recall = common / len(predicted), common / len(wanted)
        return 2 * precision * recall / (precision + recall) if harmonic else (precision + recall) / 2
    return answer


def rouge_by_difflib(prediction, reference):
    """SequenceMatcher's matching blocks taken for the LCS: right on most texts, short where a long run cuts one off."""
    predicted, wanted = rouge_tokens(prediction), rouge_tokens(reference)
    common = sum(block.size for block in SequenceMatcher(None, predicted, wanted).get_matching_blocks())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(wanted)
    return 2 * precision * recall / (precision + recall)


def rouge_unguarded(prediction, reference):
    predicted, wanted = rouge_tokens(prediction), rouge_tokens(reference)
    common = round(rouge_l(prediction, reference)["recall"] * len(wanted)) if predicted and wanted else 0
    precision, recall = common / len(predicted), common / len(wanted)
    return 2 * precision * recall / (precision + recall)


def ipo_with(**slip):
    def answer(pc, pr, rc, rr, beta):
        right = sol.ipo_loss(pc, pr, rc, rr, beta)
        return right + (ipo_loss64(pc, pr, rc, rr, beta, **slip).float() - right.detach())
    return answer


def ipo_detached(pc, pr, rc, rr, beta):
    return sol.ipo_loss(pc.detach(), pr.detach(), rc, rr, beta)


def simpo_with(by_width=False, use_reference=False, **slip):
    def answer(policy, batch, beta, gamma):
        logprobs, counts = sequence_logprobs(policy, batch.inputs, batch.targets)
        if by_width:
            counts = torch.full_like(counts, batch.inputs.size(1))
        if use_reference and batch.reference_logprobs is not None:
            logprobs = logprobs - batch.reference_logprobs
        return simpo_loss64(logprobs, counts, beta, gamma, **slip).float()
    return answer


def simpo_no_grad(policy, batch, beta, gamma):
    with torch.no_grad():
        return sol.simpo_step_loss(policy, batch, beta, gamma)


def advantages_with(**slip):
    """group_advantages with one slip (float32, as a reader's would be)."""
    return lambda rewards: group_advantages64(rewards, **slip).float()


def advantages_patched_nan(rewards):
    """No eps, the NaN of a group that scored alike replaced by 0 afterwards: 1e-4 off everywhere else."""
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    return torch.nan_to_num(centred / rewards.std(dim=-1, keepdim=True))


def objective_with(**slip):
    """clipped_objective with one slip, keeping the graph back to logprobs."""
    def answer(logprobs, old_logprobs, advantages, clip):
        values, grad = clipped_objective64(logprobs, old_logprobs, advantages, clip, **slip)
        # the slip's values, and its gradient with respect to logprobs
        return (values + grad * (logprobs - logprobs.detach())).float()
    return answer


def objective_detached(logprobs, old_logprobs, advantages, clip):
    return sol.clipped_objective(logprobs.detach(), old_logprobs, advantages, clip)


def objective_clip_detached(logprobs, old_logprobs, advantages, clip):
    """The clipped term detached: torch.minimum splits the gradient where both terms are equal."""
    ratio = torch.exp(logprobs - old_logprobs)
    gain = advantages[:, None]
    return torch.minimum(ratio * gain, ratio.clamp(1 - clip, 1 + clip).detach() * gain)


def pass_factorials(n, correct, k):
    """C(n - c, k) by factorials, no guard: factorial(n - c - k) of a negative number raises."""
    def comb(a, b):
        return math.factorial(a) // (math.factorial(b) * math.factorial(a - b))
    return 1 - comb(n - correct, k) / comb(n, k)


def pass_float_factorials(n, correct, k):
    """Factorials in floats: inf beyond 170!, so inf / inf = NaN."""
    def factorial(m):
        product = 1.0
        for i in range(2, m + 1):
            product *= i
        return product
    if n - correct < k:
        return 1.0
    comb = lambda a, b: factorial(a) / (factorial(b) * factorial(a - b))  # noqa: E731
    return 1 - comb(n - correct, k) / comb(n, k)


def pass_gamma(n, correct, k):
    """Factorials by math.gamma: an OverflowError beyond 170!."""
    if n - correct < k:
        return 1.0
    comb = lambda a, b: math.gamma(a + 1) / (math.gamma(b + 1) * math.gamma(a - b + 1))  # noqa: E731
    return 1 - comb(n - correct, k) / comb(n, k)


def pass_float_combs(n, correct, k):
    """The binomials as floats: fine at n = 200, an OverflowError once C(n, k) passes 1e308."""
    if n - correct < k:
        return 1.0
    return 1 - float(math.comb(n - correct, k)) / float(math.comb(n, k))


def pass_float32(n, correct, k):
    """The product form in float32: off by about 1e-7."""
    if n - correct < k:
        return 1.0
    terms = 1 - k / torch.arange(n - correct + 1, n + 1, dtype=torch.float32)
    return 1 - torch.prod(terms).item()


def pass_guard(n, correct, k):
    """The guard off by one: 1.0 already at n - c = k, where one draw of k holds no right answer."""
    return 1.0 if n - correct <= k else sol.pass_at_k(n, correct, k)


WRONG = [  # (exercise, wrong answer, the smallest failing input it must report, the hint it must get)
    ("preference_scores", scores_with(tie_wins=True), "chosen_rewards [0.0], rejected_rewards [0.0]", "a tie is a miss"),
    ("preference_scores", scores_with(count=True), "chosen_tokens [2, 5, 1]", "a share of the pairs"),
    ("preference_scores", scores_with(per_pair=True), "chosen_tokens [2, 5, 1]", "not the mean of each pair's ratio"),
    ("preference_scores", scores_with(undivided=True), "chosen_rewards [0.2]", "divide by beta"),
    ("wilson_bounds", normal_approximation, "wilson_bounds(0, 1, z=1.96)", "the normal approximation"),
    ("wilson_bounds", wilson_with(shifted_centre=False), "wilson_bounds(0, 1, z=1.96)", "the centre moves"),
    ("wilson_bounds", wilson_with(second_term=False), "wilson_bounds(0, 1, z=1.96)", "z^2 / (4 n^2)"),
    ("wilson_bounds", wilson_with(divided=False), "wilson_bounds(0, 1, z=1.96)", "divide the half-width"),
    ("response_logprobs", logprobs_with(shift=1), "lengths [(1, 1, 1)]", "already shifted"),
    ("response_logprobs", logprobs_with(masked=False), "lengths [(3, 1, 2)]", "drop the masked positions"),
    ("response_logprobs", logprobs_with(mean=True), "lengths [(1, 1, 1)]", "not their mean"),
    ("response_logprobs", logprobs_with(normalised=False), "lengths [(1, 1, 1)]", "log_softmax"),
    ("response_logprobs", logprobs_with(no_grad=True), "the gradient of your result's sum", "keep the graph"),
    ("response_logprobs", gather_minus_100, "lengths [(3, 1, 2)]", "gather cannot take -100"),
    ("dpo_loss_and_rewards", dpo_with(scale_inside=False), "policy = reference", "not the loss"),
    ("dpo_loss_and_rewards", dpo_with(reference=False), "beta=0.1, label_smoothing=0.0: the loss", "subtract the reference"),
    ("dpo_loss_and_rewards", dpo_with(swapped=True), "beta=0.1, label_smoothing=0.0: the loss", "chosen minus rejected"),
    ("dpo_loss_and_rewards", dpo_with(reduce="sum"), "beta=0.5", "the mean over the pairs"),
    ("dpo_loss_and_rewards", dpo_flipped_weights, "(policy = reference, one pair): the gradient", "the wrong sign"),
    ("dpo_loss_and_rewards", lambda pc, pr, rc, rr, beta, label_smoothing=0.0: sol.dpo_loss_and_rewards(
        pc, pr, rc, rr, beta), "label_smoothing=0.1", "with label_smoothing eps"),
    ("dpo_loss_and_rewards", dpo_naive, "margins of +-4981", "F.logsigmoid"),
    ("dpo_loss_and_rewards", dpo_rewards_with(unscaled=True), "beta=0.1, label_smoothing=0.0: the chosen rewards",
     "the reward is beta times the log-ratio"),
    ("dpo_loss_and_rewards", dpo_rewards_with(attached=True), "policy = reference", "detach the rewards"),
    ("dpo_loss_and_rewards", dpo_rewards_with(item=True), "the gradient of the loss", "no .item()"),
    ("rouge_l_f1", rouge_unguarded, "rouge_l_f1('', 'the whale')", "guard each division"),
    ("rouge_l_f1", rouge_with(words=str.split), "rouge_l_f1('The Whale!', 'the whale')", "split into words"),
    ("rouge_l_f1", rouge_with(in_order=False), "rouge_l_f1('b a', 'a b')", "in any order"),
    ("rouge_l_f1", rouge_with(contiguous=True), "rouge_l_f1('a b c d', 'a c b d')", "consecutive words"),
    ("rouge_l_f1", rouge_by_difflib, "rouge_l_f1('the white whale swam away at sea', 'swam away, the great",
     "difflib.SequenceMatcher's matching blocks are not the longest common subsequence"),
    ("rouge_l_f1", rouge_with(harmonic=False), "rouge_l_f1('the whale swam under the ship'", "harmonic mean"),
    ("ipo_loss", ipo_with(beta_inside=True), "on target", "without beta in front"),
    ("ipo_loss", ipo_with(target=lambda beta: 1 / beta), "policy = reference", "not 1 / beta"),
    ("ipo_loss", ipo_with(target=lambda beta: 0.0), "policy = reference", "with no target"),
    ("ipo_loss", ipo_with(swapped=True), "on target", "chosen minus rejected"),
    ("ipo_loss", ipo_with(reduce="sum"), "beta=0.5", "the mean over the pairs"),
    ("ipo_loss", ipo_detached, "policy = reference", "no .item()"),
    ("simpo_step_loss", simpo_with(normalised=False), "lengths [(1, 1, 1)]", "divides each response's summed"),
    ("simpo_step_loss", simpo_with(by_width=True), "lengths [(3, 1, 4)]", "not by the row's length T"),
    ("simpo_step_loss", simpo_with(gamma_sign=-1.0), "lengths [(1, 1, 1)]", "subtract gamma"),
    ("simpo_step_loss", simpo_with(gamma_scaled=True), "lengths [(1, 1, 1)]", "after the scaling"),
    ("simpo_step_loss", simpo_with(swapped=True), "lengths [(1, 1, 1)]", "rows :B of the batch are the chosen"),
    ("simpo_step_loss", simpo_with(reduce="sum"), "lengths [(2, 3, 1), (4, 1, 2)]", "the mean over the pairs"),
    ("simpo_step_loss", simpo_with(use_reference=True), "precomputed reference_logprobs", "needs no reference"),
    ("simpo_step_loss", simpo_no_grad, "precomputed reference_logprobs", "keep the graph"),
    ("group_advantages", advantages_with(over="batch"), "the second group's answers all scored alike",
     "not by those of the whole batch"),
    ("group_advantages", advantages_with(over="prompts"), "one prompt, two answers", "the group is a row"),
    ("group_advantages", advantages_with(keepdim=False), "the second group's answers all scored alike", "keepdim"),
    ("group_advantages", lambda r: (r - r.mean(-1)) / (r.std(-1) + 1e-4), "the second group's answers all scored",
     "keepdim"),
    ("group_advantages", advantages_with(correction=0), "one prompt, two answers", "Bessel's correction"),
    ("group_advantages", advantages_with(eps=0.0), "one prompt, two answers", "not NaN (0 / 0)"),
    ("group_advantages", advantages_patched_nan, "one prompt, two answers", "divide by the std + 1e-4"),
    ("group_advantages", advantages_with(scaled=False), "one prompt, two answers", "GRPO scales the centred rewards"),
    ("group_advantages", advantages_with(eps_inside=True), "one prompt, two answers", "outside the square root"),
    ("clipped_objective", objective_with(combine="max"), "ratios 1.5 and 0.5", "not the max"),
    ("clipped_objective", objective_with(combine="clipped only"), "ratios 1.5 and 0.5", "the clipped term alone"),
    ("clipped_objective", objective_with(combine="unclipped"), "ratios 1.5 and 0.5", "r A alone keeps pushing"),
    ("clipped_objective", objective_with(clipped="advantage"), "ratios 1.5 and 0.5", "not the advantage"),
    ("clipped_objective", objective_with(clipped="product"), "ratios 1.5 and 0.5", "not clip(r A)"),
    ("clipped_objective", objective_with(ratio="quotient"), "the ratio is 1): the gradient",
     "not logprobs / old_logprobs"),
    ("clipped_objective", objective_with(ratio="difference"), "the ratio is 1", "the log of the ratio"),
    ("clipped_objective", objective_with(per_token=False), "ratios 1.5 and 0.5", "advantages[:, None]"),
    ("clipped_objective", lambda lp, old, a, clip: sol.clipped_objective(lp, old, a, clip).mean(),
     "the ratio is 1", "the shape is wrong"),
    ("clipped_objective", objective_with(sign=-1.0), "the ratio is 1", "the loss is its negative"),
    ("clipped_objective", objective_detached, "the ratio is 1): the gradient", "no .detach()"),
    ("clipped_objective", objective_clip_detached, "the ratio is 1): the gradient", "keep the clipped term's graph"),
    ("pass_at_k", lambda n, c, k: 1 - (1 - c / n) ** k, "pass_at_k(2, 1, 2)", "with replacement"),
    ("pass_at_k", lambda n, c, k: c / n, "pass_at_k(2, 1, 2)", "pass@1, whatever k"),
    ("pass_at_k", pass_guard, "pass_at_k(1, 0, 1)", "only when n - c < k"),
    ("pass_at_k", pass_factorials, "pass_at_k(1, 1, 1)", "every draw of k holds a right answer"),
    ("pass_at_k", lambda n, c, k: math.comb(n - c, k) / math.comb(n, k), "pass_at_k(1, 1, 1)", "1 minus it"),
    ("pass_at_k", lambda n, c, k: math.comb(c, k) / math.comb(n, k), "pass_at_k(2, 1, 2)", "not that all are"),
    ("pass_at_k", pass_float_factorials, "pass_at_k(200, 13, 10)", "n! overflows a float"),
    ("pass_at_k", pass_gamma, "pass_at_k(200, 13, 10)", "n! overflows a float"),
    ("pass_at_k", pass_float_combs, "pass_at_k(2000, 5, 1000)", "keep the binomials as Python ints"),
    ("pass_at_k", pass_float32, "pass_at_k(", "compute in float64"),
]


class TestChapter6(ExerciseSuite):
    chapter, folder, wrong = ch06, "ch06-alignment", WRONG


# --------------------------------------------------------------------------- chapter 6 only
def test_the_references_of_the_usual_mistakes_start_from_the_package():
    generator = torch.Generator().manual_seed(0)
    pairs = [([1, 2, 3], [4], [5, 6]), ([7], [8, 9, 10], [11])]
    batch = collate_pairs(pairs, 63)
    model = tiny_gpt(seed=1, lively=True)
    with torch.no_grad():
        expected, counts = sequence_logprobs(model, batch.inputs, batch.targets)
        assert torch.allclose(response_logprobs64(model(batch.inputs), batch.targets).float(), expected, atol=1e-5)
    four = [-torch.rand(3, generator=generator) * 20 for _ in range(4)]
    for smoothing in (0.0, 0.2):
        for got, want in zip(dpo64(*four, 0.3, smoothing), dpo_loss(*four, 0.3, smoothing)):
            assert torch.allclose(got.float(), want, atol=1e-6)
    assert all(math.isclose(a, b, abs_tol=1e-12) for n in (1, 7, 40) for k in (0, 1, n // 2, n)
               for a, b in zip(wilson64(k, n, 1.96), wilson_interval(k, n)))
    h = (four[0] - four[2]) - (four[1] - four[3])
    assert torch.allclose(ipo_loss64(*four, 0.25), ((h.double() - 2.0) ** 2).mean())
    n = batch.n_pairs
    margin = expected[:n] / counts[:n] - expected[n:] / counts[n:]
    assert torch.allclose(simpo_loss64(expected, counts, 2.0, 0.5).float(), -F.logsigmoid(2.0 * margin - 0.5).mean())


def test_the_grpo_references_start_from_the_package():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randint(2, (5, 6), generator=generator) + 0.5 * torch.randint(2, (5, 6), generator=generator)
    rewards[0] = 1.0  # a group that scored alike
    assert torch.allclose(group_advantages64(rewards).float(), group_advantages(rewards), atol=1e-6)
    assert torch.allclose(group_advantages64(rewards, scaled=False).float(), group_advantages(rewards, scale=False))
    old = -torch.rand(4, 7, generator=generator) * 4
    new = (old + 0.5 * torch.randn(4, 7, generator=generator)).requires_grad_()
    advantages = torch.randn(4, generator=generator)
    values, grad = clipped_objective64(new, old, advantages, 0.2)
    expected = clipped_objective(new, old, advantages, 0.2)
    assert torch.allclose(values.float(), expected.detach(), atol=1e-6)
    assert torch.allclose(grad.float(), torch.autograd.grad(expected.sum(), new)[0], atol=1e-6)
    # the package's product form against the exact fraction of the two binomials
    for n, c, k in [(1, 0, 1), (5, 2, 3), (10, 7, 4), (200, 13, 150), (2000, 5, 1000), (2000, 1995, 3)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert math.isclose(pass_at_k(n, c, k), float(exact), rel_tol=1e-12, abs_tol=1e-12)


def test_the_grpo_cases_reach_the_edges_they_are_meant_to():
    # a group that scored alike gets 0, not NaN; without eps it would be 0 / 0
    assert group_advantages(torch.tensor([[1.0, 1.0]])).eq(0).all()
    assert advantages_with(eps=0.0)(torch.tensor([[1.0, 1.0]])).isnan().all()
    # ratios 1.5 and 0.5 with advantages 1.5 and -0.5: each of the four regions of the clip, the min picking both terms
    old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    new = (old + torch.tensor([[1.5, 0.5], [1.5, 0.5]]).log()).requires_grad_()
    objective = clipped_objective(new, old, torch.tensor([1.5, -0.5]), 0.2)
    (grad,) = torch.autograd.grad(objective.sum(), new)
    assert torch.allclose(objective, torch.tensor([[1.8, 0.75], [-0.75, -0.4]]))
    assert (grad == 0).tolist() == [[True, False], [False, True]]
    # 200! is past a float, C(200, 100) is not; C(2000, 1000) is past it too
    assert math.isnan(pass_float_factorials(200, 13, 10)) and math.isfinite(pass_float_combs(200, 13, 150))
    with pytest.raises(OverflowError):
        pass_float_combs(2000, 5, 1000)


def test_the_cases_reach_the_edges_they_are_meant_to():
    assert sol.rouge_l_f1("", "x") == 0.0 and sol.rouge_l_f1("a b c d", "a c b d") == 0.75
    assert sol.wilson_bounds(0, 10)[0] == 0.0 and sol.wilson_bounds(10, 10)[1] == 1.0
    # the extreme DPO case: the naive -log(sigmoid(x)) is inf there, the package's loss finite
    loss, _, _ = dpo_loss(torch.tensor([-1.0, -5000.0]), torch.tensor([-5000.0, -1.0]), torch.tensor([-20.0, -20.0]),
                          torch.tensor([-20.0, -20.0]), 1.0)
    assert math.isfinite(loss.item()) and not math.isfinite(dpo_naive(
        torch.tensor([-1.0, -5000.0]), torch.tensor([-5000.0, -1.0]), torch.tensor([-20.0, -20.0]),
        torch.tensor([-20.0, -20.0]), 1.0)[0].item())


def test_a_wrong_answer_that_returns_the_wrong_kind_of_thing_is_a_verdict_not_a_traceback():
    assert "return the two bounds" in verdict(lambda s, n, z=1.96: 0.5, "wilson_bounds").detail
    assert "return three tensors" in verdict(lambda *args: torch.tensor(0.0), "dpo_loss_and_rewards").detail
    assert "keys" in verdict(lambda *args: [0.5], "preference_scores").detail
    assert "a number" in verdict(lambda p, r: "0.5", "rouge_l_f1").detail
    assert "ZeroDivisionError" in verdict(lambda *args: 1 / 0, "simpo_step_loss").detail
    assert "a number" in verdict(lambda n, c, k: "0.5", "pass_at_k").detail
    assert "not a tensor" in verdict(lambda rewards: rewards.tolist(), "group_advantages").detail
    assert "not a tensor" in verdict(lambda lp, old, a, clip: None, "clipped_objective").detail
