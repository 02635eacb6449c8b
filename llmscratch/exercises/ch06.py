"""Chapter 6's exercises: alignment, checked against ``llmscratch.alignment.preference``, ``.grpo`` and ``.metrics``.

Write it yourself: the watched numbers of a DPO run (reward accuracy, margin, log-ratio per token), a
Wilson interval, the log-probability of each response with its prompt masked, the DPO loss and rewards
from four log-probabilities (label smoothing included), ROUGE-L's F1 by the longest common
subsequence, and GRPO's pieces: the group advantages, the clipped objective (its values and its
gradient) and the unbiased pass@k. Extend the package: IPO's loss, and SimPO's reference-free loss in
the form ``fit`` takes.
"""

import math
from collections import Counter

import torch

from llmscratch.alignment.grpo import clipped_objective, group_advantages, pass_at_k
from llmscratch.alignment.metrics import longest_common_subsequence, rouge_l, rouge_tokens, wilson_interval
from llmscratch.alignment.preference import (PreferenceBatch, collate_pairs, dpo_loss, preference_metrics,
                                             sequence_logprobs)
from llmscratch.exercises.ch06_references import (clipped_objective64, dpo64, group_advantages64, ipo_loss64,
                                                  longest_common_substring, matching_blocks, normal_interval,
                                                  response_logprobs64, simpo_loss64, wilson64)
from llmscratch.exercises.checking import (Chapter, Mismatch, attempt, describe, diagnose, diagnose_nonfinite,
                                           expect_close, fresh_generator, number_of, random_bool, random_float,
                                           random_int, random_seed)
from llmscratch.exercises.fixtures import VOCAB, tiny_gpt

CHAPTER = Chapter("ch06", "Alignment: preference tuning with DPO, RL with verifiable rewards, and evaluations "
                           "that measure them")
EOS = VOCAB - 1  # the tiny models' end-of-text id: the vocabulary's last
NONFINITE_HINT = ("your loss has inf or NaN: -log(sigmoid(x)) underflows to -log(0) once x is below about -100 "
                  "(float32); F.logsigmoid(x) computes the same and stays finite for any margin")
GATHER_HINT = ("gather cannot take -100 as an index: replace the masked targets by 0 first "
               "(targets.masked_fill(~keep, 0)) and drop their values afterwards")


def _pair_batch(lengths: list[tuple[int, int, int]], generator: torch.Generator) -> PreferenceBatch:
    """collate_pairs of random pairs: (prompt, chosen, rejected) of the given lengths, ids below EOS."""
    pairs = [tuple(torch.randint(EOS, (n,), generator=generator).tolist() for n in sizes) for sizes in lengths]
    return collate_pairs(pairs, EOS)


def _fresh_lengths(generator: torch.Generator) -> list[tuple[int, int, int]]:
    """The (prompt, chosen, rejected) lengths of 1 to 3 random pairs: a batch no table of the fixed ones holds."""
    return [(random_int(generator, 1, 5), random_int(generator, 1, 4), random_int(generator, 1, 4))
            for _ in range(random_int(generator, 1, 3))]


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


# --------------------------------------------------------------------------- write it yourself
SCORES = ("accuracy", "chosen_reward", "rejected_reward", "margin", "chosen_log_ratio_per_token")


@CHAPTER.exercise("preference_scores", title="Reward accuracy, margin and log-ratio per token of a DPO batch",
                  difficulty="warm-up", section="3.1 Held-out pairs, before and after", kind="write it yourself",
                  forbidden=("llmscratch.alignment.preference.preference_metrics",))
def check_preference_scores(answer) -> int:
    generator = torch.Generator().manual_seed(1)
    cases = [([0.0], [0.0], [1], 0.1), ([0.2], [-0.1], [3], 0.1), ([0.5, 0.5, -0.3], [0.5, 0.1, 0.3], [2, 5, 1], 0.5)]
    fresh = fresh_generator()  # the last two: cases no table of the fixed ones holds
    draws = [(8, 0.1, generator), (32, 0.02, generator)]
    draws += [(random_int(fresh, 1, 32), random_float(fresh, 0.01, 1.0), fresh) for _ in range(2)]
    for size, beta, source in draws:
        cases.append((torch.randn(size, generator=source).mul(0.3).tolist(),
                      torch.randn(size, generator=source).mul(0.3).tolist(),
                      torch.randint(1, 12, (size,), generator=source).tolist(), beta))
    for chosen_list, rejected_list, tokens_list, beta in cases:
        chosen, rejected = torch.tensor(chosen_list), torch.tensor(rejected_list)  # (B,) each
        tokens = torch.tensor(tokens_list)  # (B,)
        case = f"chosen_rewards {chosen_list}, rejected_rewards {rejected_list}, chosen_tokens {tokens_list}, beta={beta}"
        got = attempt(answer, chosen.clone(), rejected.clone(), tokens.clone(), beta, case=case)
        if not (isinstance(got, dict) and all(key in got for key in SCORES)):
            raise Mismatch(case, f"a dict with the keys {SCORES}", describe(got),
                           "return {'accuracy': ..., 'chosen_reward': ..., 'rejected_reward': ..., 'margin': ..., "
                           "'chosen_log_ratio_per_token': ...}")
        expected = {key: value.item() for key, value in preference_metrics(chosen, rejected, tokens, beta).items()}
        c64, r64, t64 = chosen.double(), rejected.double(), tokens.double()
        mistakes = {
            "accuracy": {"a tie is a miss: count a pair only when its chosen reward is strictly higher":
                         lambda: (c64 >= r64).double().mean(),
                         "the accuracy is a share of the pairs, not their number": lambda: (c64 > r64).double().sum()},
            "margin": {"the margin is chosen minus rejected": lambda: (r64 - c64).mean()},
            "chosen_log_ratio_per_token": {
                "the rewards are beta times the log-ratios: divide by beta to get nats per token":
                    lambda: c64.sum() / t64.sum(),
                "divide the rewards by beta, do not multiply": lambda: c64.sum() * beta / t64.sum(),
                "divide the sum over all chosen responses by all their tokens, not the mean of each pair's ratio":
                    lambda: (c64 / beta / t64).mean()}}
        defaults = {"accuracy": "the share of pairs whose chosen reward is strictly higher than the rejected one",
                    "chosen_reward": "the mean of the chosen rewards", "rejected_reward": "the mean of the rejected "
                    "rewards", "margin": "the mean of chosen minus rejected rewards",
                    "chosen_log_ratio_per_token": "sum of the chosen rewards / beta / sum of chosen_tokens"}
        for key in SCORES:
            value = number_of(got[key], f"{case}: {key}", "a number (a float or a 0-d tensor)")
            hint = diagnose(torch.tensor(value, dtype=torch.float64), mistakes.get(key, {}), defaults[key])
            expect_close(value, expected[key], case=f"{case}: {key}", hint=hint, atol=1e-6, rtol=1e-5)
    return len(cases)


@CHAPTER.exercise("wilson_bounds", title="A Wilson interval for an accuracy", difficulty="warm-up",
                  section="5.1 Multiple choice by log-likelihood", kind="write it yourself",
                  forbidden=("llmscratch.alignment.metrics.wilson_interval",))
def check_wilson_bounds(answer) -> int:
    cases = [(0, 1, 1.96), (1, 1, 1.96), (1, 2, 1.96), (0, 10, 1.96), (10, 10, 1.96), (3, 10, 1.96), (50, 72, 1.96),
             (1, 1000, 1.96), (7, 20, 1.0), (13, 40, 2.576)]  # (successes, trials, z)
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    for trials in torch.randint(2, 500, (3,), generator=fresh).tolist():
        cases.append((int(torch.randint(trials + 1, (1,), generator=fresh)), trials, 1.96))
    for successes, trials, z in cases:
        case = f"wilson_bounds({successes}, {trials}, z={z})"
        got = attempt(answer, successes, trials, z, case=case, errors={
            "ZeroDivisionError": "every division here is by trials or by 1 + z^2 / trials, never 0 for trials >= 1",
            "math domain error": "the square root's argument, p (1 - p) / n + z^2 / (4 n^2), is never negative: "
                                 "check the signs"})
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise Mismatch(case, "(low, high)", describe(got), "return the two bounds, low first")
        bounds = torch.tensor([number_of(bound, case, "two numbers (low, high)") for bound in got], dtype=torch.float64)
        hint = diagnose(bounds, {
            "that is the normal approximation p +- z sqrt(p (1 - p) / n): at 0 or n successes it is a single point, "
            "and it leaves [0, 1]; Wilson's centre and half-width both have z^2 / n terms":
                lambda: torch.tensor(normal_interval(successes, trials, z), dtype=torch.float64),
            "clipping the normal approximation to [0, 1] is not Wilson's interval: its centre and half-width both "
            "have z^2 / n terms": lambda: torch.tensor(normal_interval(successes, trials, z, clipped=True),
                                                      dtype=torch.float64),
            "the centre moves towards 1/2: (p + z^2 / (2n)) / (1 + z^2 / n), not p":
                lambda: torch.tensor(wilson64(successes, trials, z, shifted_centre=False), dtype=torch.float64),
            "inside the square root add z^2 / (4 n^2) to p (1 - p) / n: it keeps the interval open at 0 and n":
                lambda: torch.tensor(wilson64(successes, trials, z, second_term=False), dtype=torch.float64),
            "divide the half-width by 1 + z^2 / n too, as the centre":
                lambda: torch.tensor(wilson64(successes, trials, z, divided=False), dtype=torch.float64),
        }, "centre (p + z^2/2n) / (1 + z^2/n), half-width z sqrt(p (1 - p) / n + z^2 / 4n^2) / (1 + z^2/n)", atol=1e-9)
        expected = torch.tensor(wilson_interval(successes, trials, z), dtype=torch.float64)
        expect_close(bounds, expected, case=case, hint=hint, atol=1e-9, rtol=1e-9)
    return len(cases)


@CHAPTER.exercise("response_logprobs", title="The log-probability of each response, its prompt masked",
                  difficulty="medium", section="2.2 The log-probability of an answer", kind="write it yourself",
                  forbidden=("llmscratch.alignment.preference.sequence_logprobs",))
def check_response_logprobs(answer) -> int:
    generator = torch.Generator().manual_seed(3)
    cases = [(False, [(1, 1, 1)]), (False, [(3, 1, 2)]), (True, [(2, 3, 1), (4, 1, 2)]),
             (True, [(5, 2, 4), (1, 3, 3), (3, 1, 1)])]  # (Llama-style?, (prompt, chosen, rejected) lengths per pair)
    cases = [(index, *case, generator) for index, case in enumerate(cases)]  # the weights' seed first, the ids' source
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(random_seed(fresh), random_bool(fresh), _fresh_lengths(fresh), fresh) for _ in range(2)]
    for seed, llama, lengths, source in cases:
        model = tiny_gpt(llama, seed=seed, lively=True)
        batch = _pair_batch(lengths, source)
        inputs, targets = batch.inputs, batch.targets  # (2B, T) each
        case = (f"a {'Llama-style' if llama else 'GPT-2'} model, collate_pairs of pairs of lengths {lengths}: "
                f"inputs {inputs.tolist()}, targets {targets.tolist()}")
        got = attempt(answer, model, inputs.clone(), targets.clone(), case=case,
                       errors={"out of bounds": GATHER_HINT, "-100": GATHER_HINT})
        with torch.no_grad():
            logits = model(inputs)  # (2B, T, V)
            expected, _ = sequence_logprobs(model, inputs, targets)  # (2B,)
        hint = diagnose(got, {
            "the targets are already shifted (targets[:, t] is the token after inputs[:, t]): read the target at t "
            "in the logits at t, not at t - 1": lambda: response_logprobs64(logits, targets, shift=1),
            "drop the masked positions (targets == -100: the prompt and the padding) after gather; masked_fill(~keep, "
            "0) only makes them valid indices": lambda: response_logprobs64(logits, targets, masked=False),
            "sum the log-probabilities of the response's tokens (the log of their product), not their mean":
                lambda: response_logprobs64(logits, targets, mean=True),
            "turn the logits into log-probabilities first: log_softmax over the vocabulary":
                lambda: response_logprobs64(logits, targets, normalised=False),
        }, "row n is the sum, over the positions t where targets[n, t] != -100, of "
           "log_softmax(model(inputs)[n, t])[targets[n, t]]", atol=1e-4)
        expect_close(got, expected, case=case, hint=hint, atol=1e-4)
        if source is generator:
            graph_case = model, inputs, targets, case  # the gradient is checked on the last fixed case
    model, inputs, targets, case = graph_case
    case += ": the gradient of your result's sum"
    model.zero_grad(set_to_none=True)
    got = attempt(answer, model, inputs.clone(), targets.clone(), case=case)
    if not (isinstance(got, torch.Tensor) and got.requires_grad):
        raise Mismatch(case, "a result that backward() can differentiate", describe(got),
                       "keep the graph (no torch.no_grad(), no .detach()): DPO backpropagates through these sums")
    attempt(got.sum().backward, case=case)
    got_grads = _flat_grads(model)
    model.zero_grad(set_to_none=True)
    sequence_logprobs(model, inputs, targets)[0].sum().backward()
    expect_close(got_grads, _flat_grads(model), case=case, hint="the gradient must be that of the summed "
                 "log-probabilities", atol=1e-5)
    return len(cases) + 1


def _four_logprobs(size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Summed log-probabilities of B pairs: the reference's, and the policy's a little way from them."""
    reference = -torch.rand(2, size, generator=generator) * 29 - 1  # (2, B) in [-30, -1]
    policy = reference + 3 * torch.randn(2, size, generator=generator)
    return [policy[0], policy[1], reference[0], reference[1]]


@CHAPTER.exercise("dpo_loss_and_rewards", title="The DPO loss and the implicit rewards from four log-probabilities",
                  difficulty="medium", section="2.3 The loss from four log-probabilities", kind="write it yourself",
                  forbidden=("llmscratch.alignment.preference.dpo_loss",
                             "llmscratch.alignment.preference.implicit_rewards"))
def check_dpo_loss_and_rewards(answer) -> int:
    generator = torch.Generator().manual_seed(4)
    same = torch.tensor([-5.0])
    extreme = [torch.tensor([-1.0, -5000.0]), torch.tensor([-5000.0, -1.0]), torch.tensor([-20.0, -20.0]),
               torch.tensor([-20.0, -20.0])]  # margins of +4981 and -4981
    cases = [([same] * 4, 0.1, 0.0, "policy = reference, one pair"), (_four_logprobs(1, generator), 0.1, 0.0, ""),
             (_four_logprobs(3, generator), 0.5, 0.0, ""), (_four_logprobs(4, generator), 0.1, 0.1, ""),
             (_four_logprobs(8, generator), 1.0, 0.3, ""), (extreme, 1.0, 0.0, "margins of +-4981")]
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(_four_logprobs(random_int(fresh, 1, 8), fresh), random_float(fresh, 0.05, 1.0),
               random_float(fresh, 0.0, 0.4), "") for _ in range(2)]
    for logprobs, beta, smoothing, note in cases:
        names = ("policy_chosen", "policy_rejected", "reference_chosen", "reference_rejected")
        case = (", ".join(f"{name} {describe(t)}" for name, t in zip(names, logprobs))
                + f", beta={beta}, label_smoothing={smoothing}" + (f" ({note})" if note else ""))
        policy = [logprobs[0].clone().requires_grad_(), logprobs[1].clone().requires_grad_()]
        got = attempt(answer, policy[0], policy[1], logprobs[2].clone(), logprobs[3].clone(), beta, smoothing,
                      case=case)
        if not (isinstance(got, (tuple, list)) and len(got) == 3):
            raise Mismatch(case, "(loss, chosen_rewards, rejected_rewards)", describe(got),
                           "return three tensors: the mean loss, the chosen rewards (B,), the rejected rewards (B,)")
        loss, chosen_rewards, rejected_rewards = got
        leaves = [logprobs[0].clone().requires_grad_(), logprobs[1].clone().requires_grad_()]
        expected = dpo_loss(*leaves, logprobs[2], logprobs[3], beta, smoothing)
        hint = diagnose_nonfinite(loss, {
            "beta scales the margin inside the sigmoid, -log sigmoid(beta * margin), not the loss":
                lambda: dpo64(*logprobs, beta, smoothing, scale_inside=False)[0],
            "scale the margin by beta: -log sigmoid(beta * margin)": lambda: dpo64(*logprobs, 1.0, smoothing)[0],
            "subtract the reference: the margin is (log pi - log ref)(chosen) - (log pi - log ref)(rejected)":
                lambda: dpo64(*logprobs, beta, smoothing, reference=False)[0],
            "the margin is chosen minus rejected: the loss must fall as the chosen answer gains (with label smoothing "
            "eps: (1 - eps) on -log sigmoid(beta * margin), eps on -log sigmoid(-beta * margin))":
                lambda: dpo64(*logprobs, beta, smoothing, swapped=True)[0],
            "the loss is the mean over the pairs, not the sum": lambda: dpo64(*logprobs, beta, smoothing, reduce="sum")[0],
            "with label_smoothing eps the loss is (1 - eps) * -log sigmoid(beta * margin) + eps * -log "
            "sigmoid(-beta * margin)": lambda: dpo64(*logprobs, beta, 0.0)[0],
        }, "the mean over the pairs of -log sigmoid(beta * margin) (with label smoothing as above)", hint=NONFINITE_HINT)
        expect_close(loss, expected[0], case=case + ": the loss", hint=hint, atol=1e-5)
        _check_loss_gradient(loss, policy, expected[0], leaves, case)
        for name, got_rewards, expected_rewards, log_ratio, other in (
                ("chosen", chosen_rewards, expected[1], logprobs[0] - logprobs[2], expected[2]),
                ("rejected", rejected_rewards, expected[2], logprobs[1] - logprobs[3], expected[1])):
            hint = diagnose(got_rewards, {
                "the reward is beta times the log-ratio: beta * (log pi - log ref)": lambda: log_ratio,
                "the reward is beta * (log pi - log ref): subtract the reference's log-probability":
                    lambda: beta * logprobs[0 if name == "chosen" else 1],
                "return the chosen rewards first, then the rejected ones": lambda: other,
            }, f"the {name} rewards are beta * (policy_{name} - reference_{name}), one per pair")
            expect_close(got_rewards, expected_rewards, case=f"{case}: the {name} rewards", hint=hint, atol=1e-5)
            if got_rewards.requires_grad:
                raise Mismatch(f"{case}: the {name} rewards", "detached rewards (requires_grad False)",
                               "rewards that require grad", "detach the rewards: they are what the run is watched "
                               "by, and no gradient should flow through them")
    return len(cases)


def _check_loss_gradient(loss, policy: list[torch.Tensor], expected_loss, leaves: list[torch.Tensor],
                         case: str) -> None:
    """The reader's loss must backpropagate to the policy's log-probabilities as the expected one does."""
    case += ": the gradient of the loss with respect to the policy's log-probabilities"
    if not loss.requires_grad:
        raise Mismatch(case, "a loss that backward() can differentiate", "a tensor without grad_fn",
                       "compute the loss with torch operations (no .item(), no torch.no_grad(), no .detach() of the "
                       "policy's log-probabilities): the policy learns through it")
    got = attempt(torch.autograd.grad, loss, policy, allow_unused=True, case=case)
    got = torch.cat([torch.zeros_like(p) if g is None else g for g, p in zip(got, policy)])
    expected = torch.cat(torch.autograd.grad(expected_loss, leaves))
    hint = diagnose(got, {
        "the gradient has the wrong sign: the margin is chosen minus rejected, and the loss must fall as it grows":
            lambda: -expected,
        "the loss is the mean over the pairs, not the sum": lambda: expected * len(leaves[0]),
    }, "the gradient must be that of the mean loss", atol=1e-6)
    expect_close(got, expected, case=case, hint=hint, atol=1e-6)


def _rouge_f1(precision: float, recall: float) -> float:
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def _f1_of(common: int, predicted: list, wanted: list) -> float:
    return _rouge_f1(common / len(predicted), common / len(wanted)) if predicted and wanted else 0.0


ROUGE_WORDS = ["the", "whale", "ship", "ahab", "sea", "white"]


@CHAPTER.exercise("rouge_l_f1", title="ROUGE-L F1 by the longest common subsequence", difficulty="medium",
                  section="5.3 Free answers: ROUGE-L and BLEU", kind="write it yourself",
                  forbidden=("llmscratch.alignment.metrics.rouge_l",))
def check_rouge_l_f1(answer) -> int:
    generator = torch.Generator().manual_seed(5)
    cases = [("", "the whale"), ("whale", "whale"), ("The Whale!", "the whale"), ("b a", "a b"),
             ("a b c d", "a c b d"), ("the the the", "the cat sat"),
             ("the whale swam under the ship", "the white whale swam beneath the ship"),
             ("Ahab, 42 years at sea.", "42 years of Ahab at sea"),
             # the longest run ("swam away") cuts off "the white whale", which the LCS keeps: difflib's blocks miss it
             ("the white whale swam away at sea", "swam away, the great white old whale, at sea")]
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    for source in [generator] * 6 + [fresh] * 4:
        cases.append(tuple(" ".join(ROUGE_WORDS[i] for i in torch.randint(len(ROUGE_WORDS), (n,), generator=source))
                           for n in torch.randint(1, 11, (2,), generator=source).tolist()))
    for prediction, reference in cases:
        case = f"rouge_l_f1({prediction!r}, {reference!r})"
        got = number_of(attempt(answer, prediction, reference, case=case, errors={
            "ZeroDivisionError": "a text with no words, or no word in common, scores 0: guard each division"}),
            case, "a number, the F1")
        predicted, wanted = rouge_tokens(prediction), rouge_tokens(reference)
        scores = rouge_l(prediction, reference)
        overlap = sum((Counter(predicted) & Counter(wanted)).values())
        split_p, split_r = prediction.split(), reference.split()
        hint = diagnose(torch.tensor(got, dtype=torch.float64), {
            "that is the longest common run of consecutive words: a subsequence may skip words, "
            "(\"a b c d\", \"a c b d\") share \"a b d\"": lambda: torch.tensor(
                _f1_of(longest_common_substring(predicted, wanted), predicted, wanted), dtype=torch.float64),
            "difflib.SequenceMatcher's matching blocks are not the longest common subsequence: it takes the "
            "longest run first and never matches across it; compute the LCS by dynamic programming":
                lambda: torch.tensor(_f1_of(matching_blocks(predicted, wanted), predicted, wanted),
                                     dtype=torch.float64),
            "that counts words in common in any order (ROUGE-1); ROUGE-L counts them in order, by the longest "
            "common subsequence": lambda: torch.tensor(_f1_of(overlap, predicted, wanted), dtype=torch.float64),
            "split into words as rouge_tokens does: lower case, and every run of characters other than a-z and 0-9 "
            "separates words": lambda: torch.tensor(
                _f1_of(longest_common_subsequence(split_p, split_r), split_p, split_r), dtype=torch.float64),
            "F1 is the harmonic mean 2PR / (P + R), not (P + R) / 2": lambda: torch.tensor(
                (scores["precision"] + scores["recall"]) / 2, dtype=torch.float64),
        }, "F1 = 2PR / (P + R), with P = LCS / words of the prediction, R = LCS / words of the reference "
           "(0 when the LCS is 0)", atol=1e-9)
        expect_close(got, scores["f"], case=case, hint=hint, atol=1e-9, rtol=1e-9)
    return len(cases)


# --------------------------------------------------------------------------- GRPO: advantages, objective, pass@k
KEEPDIM_HINT = ("keep the group's dimension: rewards.mean(dim=-1, keepdim=True) is (P, 1) and broadcasts over the "
                "G answers; without keepdim the (P,) means line up with the answers instead")
PER_TOKEN_HINT = ("advantages is (N,), one per answer: advantages[:, None] (N, 1) gives every token of answer n its "
                  "advantage; (N,) against (N, T) lines up with the tokens instead")
OVERFLOW_HINT = ("n! overflows a float beyond n = 170, and C(n, k) beyond about n = 1030 (C(2000, 1000) is about "
                 "10^600): keep the binomials as Python ints (math.comb(n - c, k) / math.comb(n, k) divides them "
                 "exactly), or take the product form 1 - prod(1 - k / i for i in n - c + 1 .. n)")
PRECISION_HINT = ("close, but not within 1e-9: compute in float64 (Python floats, or dtype=torch.float64); float32 "
                  "keeps 7 digits, and a product of many terms loses more")
ALL_RIGHT_HINT = ("when n - c < k every draw of k holds a right answer: pass@k is 1.0 (C(n - c, k) is 0 there; a "
                  "factorial of n - c - k < 0 is not defined)")


def _rewards(prompts: int, group_size: int, weight: float, generator: torch.Generator) -> list[list[float]]:
    """P groups of G rewards as the package scores answers: 1 for a right one, plus ``weight`` for the right form.

    The weights are 1/4 or 1/2, so that a group whose answers all scored alike has a mean exact in float32.
    """
    right = torch.randint(2, (prompts, group_size), generator=generator)
    formed = torch.randint(2, (prompts, group_size), generator=generator)
    return (right + weight * formed).tolist()


@CHAPTER.exercise("group_advantages", title="GRPO's group advantages: each reward against its group's",
                  difficulty="warm-up", section="7.2 Group advantages", kind="write it yourself",
                  forbidden=("llmscratch.alignment.grpo.group_advantages",))
def check_group_advantages(answer) -> int:
    generator = torch.Generator().manual_seed(8)
    cases = [([[1.0, 0.0]], "one prompt, two answers"),
             ([[1.0, 0.0], [1.0, 1.0]], "the second group's answers all scored alike"),
             ([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.5, 0.5, 1.5, 1.0]], "three prompts of four answers"),
             (_rewards(4, 8, 0.5, generator), ""), (_rewards(8, 16, 0.25, generator), ""),
             (torch.rand(2, 5, generator=generator).mul(100).round().div(100).tolist(), "rewards of any value")]
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(_rewards(random_int(fresh, 1, 6), random_int(fresh, 2, 12), 0.25 * random_int(fresh, 1, 2), fresh), "")
              for _ in range(2)]
    for rewards_list, note in cases:
        rewards = torch.tensor(rewards_list)  # (P, G)
        case = f"group_advantages(torch.tensor({rewards_list}))" + (f" ({note})" if note else "")
        got = attempt(answer, rewards.clone(), case=case, errors={"must match the size": KEEPDIM_HINT})
        hint = diagnose(got, {
            "the group is a row: take the mean and std over dim -1 (each prompt's G answers), not over dim 0":
                lambda: group_advantages64(rewards, over="prompts"),
            "normalise each group by its own mean and std (dim -1), not by those of the whole batch: one prompt's "
            "rewards say nothing about another's, and an easy prompt would make every answer of a hard one look bad":
                lambda: group_advantages64(rewards, over="batch"),
            KEEPDIM_HINT: lambda: group_advantages64(rewards, keepdim=False),
            "torch's std divides by G - 1 (Bessel's correction, its default): rewards.std(dim=-1, keepdim=True); "
            "correction=0 (numpy's default) divides by G": lambda: group_advantages64(rewards, correction=0),
            "divide by the std + 1e-4: the eps keeps a group whose answers all scored alike at 0 (0 / 1e-4), "
            "not NaN (0 / 0)": lambda: group_advantages64(rewards, eps=0.0),
            "divide by the group's std + 1e-4: GRPO scales the centred rewards (leaving them unscaled is Dr. GRPO's "
            "choice, scale=False)": lambda: group_advantages64(rewards, scaled=False),
            "add eps to the std, outside the square root: std + 1e-4, not sqrt(var + 1e-4)":
                lambda: group_advantages64(rewards, eps_inside=True),
        }, "")
        hint = hint or diagnose_nonfinite(got, {}, "(reward - its group's mean) / (its group's std + 1e-4), the mean "
                                          "and std over dim -1 with keepdim=True", hint=(
            "a group whose answers all scored alike has std 0: add eps (1e-4) to the std, so that its advantages "
            "are 0 / 1e-4 = 0, not 0 / 0 = NaN"))
        expect_close(got, group_advantages(rewards), case=case, hint=hint, atol=1e-6, rtol=1e-5)
    return len(cases)


CLIPPED_SLIPS = {  # the hint of each usual mistake -> its switch of clipped_objective64
    "take the min of r A and clip(r) A, not the max: the objective is pessimistic, it never credits the policy for "
    "moving past the clip": dict(combine="max"),
    "the clipped term alone is not enough: min(r A, clip(r) A) keeps r A (and its gradient) where the ratio went "
    "past the clip against the advantage (r < 1 - clip with A > 0, r > 1 + clip with A < 0)":
        dict(combine="clipped only"),
    "clip the ratio: min(r A, clip(r, 1 - clip, 1 + clip) A); r A alone keeps pushing (and its gradient keeps "
    "flowing) after the ratio went past 1 + clip with A > 0 or below 1 - clip with A < 0": dict(combine="unclipped"),
    "clip the ratio r to [1 - clip, 1 + clip], not the advantage: the clip bounds how far the policy moves from the "
    "one that sampled": dict(clipped="advantage"),
    "clip the ratio alone, then multiply by the advantage: clip(r, 1 - clip, 1 + clip) * A, not clip(r A)":
        dict(clipped="product"),
    "the ratio of probabilities is exp(logprobs - old_logprobs), not logprobs / old_logprobs: log-probabilities "
    "subtract where probabilities divide": dict(ratio="quotient"),
    "r = exp(logprobs - old_logprobs): the difference of log-probabilities is the log of the ratio, not the ratio":
        dict(ratio="difference"),
    PER_TOKEN_HINT: dict(per_token=False),
    "return the objective, to be maximised: the loss is its negative, taken later": dict(sign=-1.0),
    "keep the clipped term's graph too (no .detach()): inside the clip both terms are equal, and torch.minimum "
    "splits the gradient between them": dict(detached_clip=True),
}


def _float64(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


def _policy_logprobs(answers: int, tokens: int, spread: float, generator: torch.Generator) -> list[torch.Tensor]:
    """Per-token log-probabilities (N, T) of the policy that sampled and of the one trained, a little way apart,
    and one advantage per answer (N,)."""
    old = -torch.rand(answers, tokens, generator=generator) * 4 - 0.1  # (N, T) in [-4.1, -0.1]
    new = (old + spread * torch.randn(answers, tokens, generator=generator)).clamp(max=-1e-3)  # (N, T)
    return [new, old, torch.randn(answers, generator=generator)]


@CHAPTER.exercise("clipped_objective", title="PPO's clipped objective per token, and its gradient",
                  difficulty="medium", section="7.3 The clipped objective", kind="write it yourself",
                  forbidden=("llmscratch.alignment.grpo.clipped_objective",))
def check_clipped_objective(answer) -> int:
    generator = torch.Generator().manual_seed(9)
    old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    apart = [old + torch.tensor([[1.5, 0.5], [1.5, 0.5]]).log(), old, torch.tensor([1.5, -0.5])]
    cases = [([torch.tensor([[-1.0]]), torch.tensor([[-1.0]]), torch.tensor([1.0])], 0.2,
              "the policy that sampled: the ratio is 1"),
             (apart, 0.2, "ratios 1.5 and 0.5, past the clip either way, advantages 1.5 and -0.5"),
             (_policy_logprobs(3, 4, 0.4, generator), 0.2, ""), (_policy_logprobs(4, 6, 0.5, generator), 0.1, ""),
             (_policy_logprobs(5, 3, 0.3, generator), 0.3, "")]
    cases[-1][0][2][0] = 0.0  # an answer whose group scored alike: no advantage
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(_policy_logprobs(random_int(fresh, 1, 5), random_int(fresh, 1, 8), 0.4, fresh),
               random_float(fresh, 0.1, 0.4), "") for _ in range(2)]
    for (logprobs, old_logprobs, advantages), clip, note in cases:
        case = (f"logprobs {describe(logprobs)}, old_logprobs {describe(old_logprobs)}, advantages "
                f"{describe(advantages)}, clip={clip}" + (f" ({note})" if note else ""))
        leaf = logprobs.clone().requires_grad_()
        got = attempt(answer, leaf, old_logprobs.clone(), advantages.clone(), clip, case=case,
                      errors={"must match the size": PER_TOKEN_HINT})
        expected_leaf = logprobs.clone().requires_grad_()
        expected = clipped_objective(expected_leaf, old_logprobs, advantages, clip)  # (N, T)
        slips = _clipped_slips(logprobs, old_logprobs, advantages, clip)
        hint = diagnose(got, {text: lambda values=values: values for text, (values, _) in slips.items()},
                        "min(r A, clip(r, 1 - clip, 1 + clip) A) per token, with r = exp(logprobs - old_logprobs) "
                        "and A = advantages[:, None]")
        expect_close(got, expected.detach(), case=case, hint=hint, atol=1e-5, rtol=1e-5)
        _check_objective_gradient(got, leaf, torch.autograd.grad(expected.sum(), expected_leaf)[0],
                                  {text: grad for text, (_, grad) in slips.items()}, case)
    return len(cases)


def _clipped_slips(logprobs, old_logprobs, advantages, clip: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each usual mistake's hint -> its values and gradient on this case (those that cannot be computed left out)."""
    slips = {}
    for text, slip in CLIPPED_SLIPS.items():
        try:
            slips[text] = clipped_objective64(logprobs, old_logprobs, advantages, clip, **slip)
        except RuntimeError:  # advantages against the tokens: (N,) and (N, T) do not broadcast unless N = T
            continue
    return slips


def _check_objective_gradient(got, leaf: torch.Tensor, expected: torch.Tensor, slips: dict[str, torch.Tensor],
                              case: str) -> None:
    """The gradient of the reader's objective's sum with respect to logprobs must be the expected one; ``slips``
    maps each usual mistake's hint to its gradient."""
    case += ": the gradient of your objective's sum with respect to logprobs"
    if not got.requires_grad:
        raise Mismatch(case, "an objective that backward() can differentiate", "a tensor without grad_fn",
                       "compute it with torch operations on logprobs (no .detach(), no torch.no_grad(), no .item()): "
                       "the policy learns through it")
    (grad,) = attempt(torch.autograd.grad, got.sum(), leaf, allow_unused=True, case=case)
    grad = torch.zeros_like(leaf) if grad is None else grad
    hint = diagnose(grad, {text: lambda slip=slip: slip for text, slip in slips.items()},
                    "the gradient is r A where the min picks r A, and 0 where it picks the clipped term (the ratio "
                    "past the clip in the advantage's direction)")
    expect_close(grad, expected, case=case, hint=hint, atol=1e-5, rtol=1e-5)


@CHAPTER.exercise("pass_at_k", title="The unbiased pass@k from n samples", difficulty="medium",
                  section="7.5 pass@k", kind="write it yourself", forbidden=("llmscratch.alignment.grpo.pass_at_k",))
def check_pass_at_k(answer) -> int:
    cases = [(1, 1, 1, "the one answer is right"), (1, 0, 1, ""), (2, 1, 1, ""), (2, 0, 2, "no right answer, k = n"),
             (2, 1, 2, "n - c < k: every draw of two holds the right answer"), (5, 2, 3, "n - c = k"),
             (10, 3, 1, ""), (10, 3, 5, ""), (10, 0, 10, ""), (10, 10, 1, ""),
             (200, 13, 10, "n = 200: 200! is far beyond a float"), (200, 13, 150, ""),
             (2000, 5, 1000, "n = 2000: C(2000, 1000) is about 10^600"), (2000, 1, 10, ""), (2000, 1995, 3, "")]
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    for low, high in ((1, 60), (1, 60), (500, 3000)):
        n = random_int(fresh, low, high)
        cases.append((n, random_int(fresh, 0, n), random_int(fresh, 1, n), ""))
    for n, c, k, note in cases:
        case = f"pass_at_k({n}, {c}, {k})" + (f" ({note})" if note else "")
        got = number_of(attempt(answer, n, c, k, case=case, errors={
            "OverflowError": OVERFLOW_HINT, "not defined for negative values": ALL_RIGHT_HINT}), case, "a number")
        expected = pass_at_k(n, c, k)
        hint = diagnose_nonfinite(_float64(got), {
            "that is 1 - (1 - c/n)^k, k draws with replacement: biased low; the k samples are drawn from the n "
            "without replacement, 1 - C(n - c, k) / C(n, k)": lambda: _float64(1 - (1 - c / n) ** k),
            "c / n is pass@1, whatever k: with k tries the chance that one is right grows, 1 - C(n - c, k) / C(n, k)":
                lambda: _float64(c / n),
            "pass@k is 1.0 only when n - c < k: with n - c = k one draw of k (all the wrong answers) has no right "
            "one, and pass@k = 1 - 1 / C(n, k)": lambda: _float64(1.0 if n - c == k else math.nan),  # NaN: no match
            "pass@k is the chance that at least one of the k is right, not that all are: 1 - C(n - c, k) / C(n, k)":
                lambda: _float64(math.comb(c, k) / math.comb(n, k)),
            "C(n - c, k) / C(n, k) is the chance that none of the k is right: pass@k is 1 minus it":
                lambda: _float64(1 - expected),
        }, PRECISION_HINT if abs(got - expected) < 1e-4 else "1 - C(n - c, k) / C(n, k), and 1.0 when n - c < k",
            hint=OVERFLOW_HINT)
        expect_close(got, expected, case=case, hint=hint, atol=1e-9, rtol=1e-9)
    return len(cases)


# --------------------------------------------------------------------------- extend the package
@CHAPTER.exercise("ipo_loss", title="IPO: a squared loss with a target margin", difficulty="medium",
                  section="4. Beta: how far from the reference", kind="extend the package")
def check_ipo_loss(answer) -> int:
    generator = torch.Generator().manual_seed(6)
    same = torch.tensor([-5.0])
    on_target = [torch.tensor([-4.0]), torch.tensor([-9.0]), torch.tensor([-5.0]), torch.tensor([-5.0])]  # h = 5
    cases = [([same] * 4, 0.1, "policy = reference, one pair"), (on_target, 0.1, "h = 1 / (2 beta) = 5: on target"),
             (_four_logprobs(3, generator), 0.5, ""), (_four_logprobs(4, generator), 0.1, ""),
             (_four_logprobs(8, generator), 0.01, "")]
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(_four_logprobs(random_int(fresh, 1, 8), fresh), random_float(fresh, 0.01, 0.5), "") for _ in range(2)]
    for logprobs, beta, note in cases:
        names = ("policy_chosen", "policy_rejected", "reference_chosen", "reference_rejected")
        case = (", ".join(f"{name} {describe(t)}" for name, t in zip(names, logprobs)) + f", beta={beta}"
                + (f" ({note})" if note else ""))
        policy = [logprobs[0].clone().requires_grad_(), logprobs[1].clone().requires_grad_()]
        loss = attempt(answer, policy[0], policy[1], logprobs[2].clone(), logprobs[3].clone(), beta, case=case)
        zero = torch.zeros_like(logprobs[0])
        hint = diagnose(loss, {
            "IPO's h is the log-ratio margin itself, without beta in front: beta sets the target, 1 / (2 beta)":
                lambda: ipo_loss64(*logprobs, beta, beta_inside=True),
            "the target is 1 / (2 beta), not 1 / beta": lambda: ipo_loss64(*logprobs, beta, target=lambda b: 1 / b),
            "the target is 1 / (2 beta), not beta / 2": lambda: ipo_loss64(*logprobs, beta, target=lambda b: b / 2),
            "subtract the target 1 / (2 beta) from h before squaring: with no target the loss pulls every margin to 0":
                lambda: ipo_loss64(*logprobs, beta, target=lambda b: 0.0),
            "h is chosen minus rejected: (log pi - log ref)(chosen) - (log pi - log ref)(rejected)":
                lambda: ipo_loss64(*logprobs, beta, swapped=True),
            "subtract the reference: h is a difference of log-ratios, log pi - log ref":
                lambda: ipo_loss64(logprobs[0], logprobs[1], zero, zero, beta),
            "the loss is the mean over the pairs, not the sum": lambda: ipo_loss64(*logprobs, beta, reduce="sum"),
        }, "the mean over the pairs of (h - 1 / (2 beta))^2, h = (log pi - log ref)(chosen) - (log pi - log ref)"
           "(rejected)", atol=1e-4)
        leaves = [logprobs[0].clone().requires_grad_(), logprobs[1].clone().requires_grad_()]
        h = (leaves[0] - logprobs[2]) - (leaves[1] - logprobs[3])  # (B,)
        expected = ((h - 1 / (2 * beta)) ** 2).mean()
        expect_close(loss, ipo_loss64(*logprobs, beta).float(), case=case, hint=hint, atol=1e-4)
        _check_loss_gradient(loss, policy, expected, leaves, case)
    return len(cases)


def _simpo_case(answer, model, batch: PreferenceBatch, beta: float, gamma: float, case: str):
    """The reader's loss on ``batch`` and the expected one, which keeps its graph; a hint for a wrong value."""
    reference_copy = None if batch.reference_logprobs is None else batch.reference_logprobs.clone()
    loss = attempt(answer, model, PreferenceBatch(batch.inputs.clone(), batch.targets.clone(), reference_copy),
                   beta, gamma, case=case)
    logprobs, counts = sequence_logprobs(model, batch.inputs, batch.targets)  # (2B,), (2B,)
    expected = simpo_loss64(logprobs, counts, beta, gamma)
    plain = logprobs.detach()
    widths = torch.full_like(counts, batch.inputs.size(1))
    mistakes = {
        "SimPO divides each response's summed log-probability by its length (its targets that are not -100: "
        "sequence_logprobs returns their counts): the mean log-probability per token":
            lambda: simpo_loss64(plain, counts, beta, gamma, normalised=False),
        "divide by the response's scored tokens (targets != -100), not by the row's length T: the prompt and the "
        "padding count for nothing": lambda: simpo_loss64(plain, widths, beta, gamma),
        "subtract gamma, the margin the chosen answer must win by: -log sigmoid(beta * delta - gamma)":
            lambda: simpo_loss64(plain, counts, beta, gamma, gamma_sign=-1.0),
        "gamma is subtracted after the scaling: beta * delta - gamma, not beta * (delta - gamma)":
            lambda: simpo_loss64(plain, counts, beta, gamma, gamma_scaled=True),
        "rows :B of the batch are the chosen answers, rows B: the rejected ones: delta = chosen - rejected":
            lambda: simpo_loss64(plain, counts, beta, gamma, swapped=True),
        "the loss is the mean over the pairs, not the sum": lambda: simpo_loss64(plain, counts, beta, gamma, reduce="sum"),
    }
    if batch.reference_logprobs is not None:
        mistakes["SimPO needs no reference: leave batch.reference_logprobs out of it"] = lambda: simpo_loss64(
            plain - batch.reference_logprobs, counts, beta, gamma)
    hint = diagnose(loss, mistakes, "the mean over the pairs of -log sigmoid(beta * (log pi(chosen) / |chosen| - "
                    "log pi(rejected) / |rejected|) - gamma)", atol=1e-5)
    expect_close(loss, expected.detach().float(), case=case, hint=hint, atol=1e-5)
    return loss, expected


@CHAPTER.exercise("simpo_step_loss", title="SimPO: preference tuning without a reference model", difficulty="hard",
                  section="2.4 Why a reference", kind="extend the package")
def check_simpo_step_loss(answer) -> int:
    generator = torch.Generator().manual_seed(7)
    cases = [(False, [(1, 1, 1)], 2.0, 0.5), (False, [(3, 1, 4)], 2.0, 1.0), (True, [(2, 3, 1), (4, 1, 2)], 2.5, 1.0),
             (True, [(5, 2, 4), (1, 3, 3), (3, 1, 1)], 2.0, 0.5)]  # (Llama-style?, pair lengths, beta, gamma)
    cases = [(10 + index, *case, generator) for index, case in enumerate(cases)]  # the weights' seed, the ids' source
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(random_seed(fresh), random_bool(fresh), _fresh_lengths(fresh), random_float(fresh, 0.5, 3.0, 1),
               random_float(fresh, 0.0, 1.5, 1), fresh) for _ in range(2)]
    for seed, llama, lengths, beta, gamma, source in cases:
        model = tiny_gpt(llama, seed=seed, lively=True)
        batch = _pair_batch(lengths, source)
        case = (f"a {'Llama-style' if llama else 'GPT-2'} model, collate_pairs of pairs of lengths {lengths}, "
                f"beta={beta}, gamma={gamma}: inputs {batch.inputs.tolist()}, targets {batch.targets.tolist()}")
        with torch.no_grad():
            _simpo_case(answer, model, batch, beta, gamma, case)
        if source is generator:
            graph_case = model, batch, beta, gamma, case  # the gradient is checked on the last fixed case
    model, batch, beta, gamma, case = graph_case
    reference_logprobs = torch.randn(batch.inputs.size(0), generator=generator) * 5 - 10  # (2B,)
    batch = PreferenceBatch(batch.inputs, batch.targets, reference_logprobs)
    case += ", the batch carrying precomputed reference_logprobs: loss.backward()"
    model.zero_grad(set_to_none=True)
    loss, expected = _simpo_case(answer, model, batch, beta, gamma, case)
    if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
        raise Mismatch(case, "a loss that backward() can differentiate", describe(loss),
                       "keep the graph (no torch.no_grad(), no .item(), no .detach()): fit calls loss.backward()")
    attempt(loss.backward, case=case)
    got_grads = _flat_grads(model)
    model.zero_grad(set_to_none=True)
    expected.backward()
    expect_close(got_grads, _flat_grads(model), case=case + ": the gradient of every weight", atol=1e-5,
                 hint="the gradient must be that of the mean loss")
    return len(cases) + 1
