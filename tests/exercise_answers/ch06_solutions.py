"""Worked answers to chapter 6's exercises, word for word the answer cells of ch06-alignment/solutions.ipynb.

Each ``# %%`` line starts one cell (the percent format that editors run as notebook cells);
``python -m llmscratch.exercises ch06 tests/exercise_answers/ch06_solutions.py`` passes every row.
"""

# %% imports
import math

import torch
import torch.nn.functional as F

from llmscratch.alignment.metrics import rouge_tokens
from llmscratch.alignment.preference import sequence_logprobs
from llmscratch.model.losses import IGNORE_INDEX


# %% preference_scores
def preference_scores(chosen_rewards, rejected_rewards, chosen_tokens, beta):
    """Reward accuracy, mean rewards, mean margin and the chosen log-ratio per token of B pairs' rewards (B,)."""
    return {
        "accuracy": (chosen_rewards > rejected_rewards).float().mean().item(),  # a tie is a miss
        "chosen_reward": chosen_rewards.mean().item(),
        "rejected_reward": rejected_rewards.mean().item(),
        "margin": (chosen_rewards - rejected_rewards).mean().item(),
        # the rewards are beta * (log pi - log ref): back to nats, over every chosen token at once
        "chosen_log_ratio_per_token": (chosen_rewards.sum() / beta / chosen_tokens.sum()).item(),
    }

# %% wilson_bounds
def wilson_bounds(successes, trials, z=1.96):
    """The Wilson score interval (low, high) of a share successes / trials; z = 1.96 for 95%."""
    p, z2 = successes / trials, z * z
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)  # moved from p towards 1/2
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials**2)) / (1 + z2 / trials)
    return max(0.0, centre - half), min(1.0, centre + half)

# %% response_logprobs
def response_logprobs(model, inputs, targets):
    """Summed log-probability of each row's targets that are not -100: (N,), differentiable."""
    keep = targets != IGNORE_INDEX  # (N, T): the response and its <|endoftext|>
    log_probs = F.log_softmax(model(inputs).float(), dim=-1)  # (N, T, V)
    picked = log_probs.gather(-1, targets.masked_fill(~keep, 0).unsqueeze(-1)).squeeze(-1)  # (N, T)
    return torch.where(keep, picked, 0.0).sum(dim=-1)  # (N,)

# %% dpo_loss_and_rewards
def dpo_loss_and_rewards(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta,
                         label_smoothing=0.0):
    """The mean DPO loss over B pairs of summed log-probabilities (B,) each, and the chosen and rejected rewards."""
    chosen_ratio = policy_chosen - reference_chosen  # (B,) log pi - log ref
    rejected_ratio = policy_rejected - reference_rejected  # (B,)
    logits = beta * (chosen_ratio - rejected_ratio)  # (B,) the reward margin
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)  # (B,)
    return losses.mean(), beta * chosen_ratio.detach(), beta * rejected_ratio.detach()

# %% rouge_l_f1
def rouge_l_f1(prediction, reference):
    """ROUGE-L F1: the longest common subsequence of words over each text's length, as a harmonic mean."""
    predicted, wanted = rouge_tokens(prediction), rouge_tokens(reference)
    previous = [0] * (len(wanted) + 1)  # previous[j]: the LCS of the words of predicted so far and wanted[:j]
    for word in predicted:
        current = [0]
        for j, other in enumerate(wanted):
            current.append(previous[j] + 1 if word == other else max(previous[j + 1], current[j]))
        previous = current
    common = previous[-1]
    if common == 0:  # also when a text has no words
        return 0.0
    precision, recall = common / len(predicted), common / len(wanted)
    return 2 * precision * recall / (precision + recall)

# %% group_advantages
def group_advantages(rewards):
    """Each answer's reward against its group's: rewards (P, G), G answers to each of P prompts -> (P, G)."""
    mean = rewards.mean(dim=-1, keepdim=True)  # (P, 1): the group is the baseline
    std = rewards.std(dim=-1, keepdim=True)  # (P, 1), with Bessel's correction (torch's default)
    return (rewards - mean) / (std + 1e-4)  # a group that scored alike: 0 / 1e-4 = 0

# %% clipped_objective
def clipped_objective(logprobs, old_logprobs, advantages, clip):
    """PPO's clipped surrogate per token (N, T), to be maximised: min(r A, clip(r, 1 - clip, 1 + clip) A)."""
    ratio = torch.exp(logprobs - old_logprobs)  # (N, T): pi / pi_old of each token
    gain = advantages[:, None]  # (N, 1): an answer's advantage, for each of its tokens
    return torch.minimum(ratio * gain, ratio.clamp(1 - clip, 1 + clip) * gain)  # (N, T)

# %% pass_at_k
def pass_at_k(n, correct, k):
    """The unbiased pass@k from n samples of which ``correct`` were right: 1 - C(n - c, k) / C(n, k)."""
    if n - correct < k:  # every draw of k holds a right answer
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)  # ints divided: exact, however large

# %% ipo_loss
def ipo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta):
    """IPO's loss over B pairs of summed log-probabilities (B,) each: the mean of (h - 1 / (2 beta))^2."""
    h = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)  # (B,) log-ratio margin
    return ((h - 1 / (2 * beta)) ** 2).mean()

# %% simpo_step_loss
def simpo_step_loss(policy, batch, beta, gamma):
    """SimPO's loss of a PreferenceBatch (chosen rows first): no reference, log-probabilities per token."""
    logprobs, counts = sequence_logprobs(policy, batch.inputs, batch.targets)  # (2B,), (2B,)
    per_token = logprobs / counts  # (2B,) the mean log-probability of each response's tokens
    n = batch.n_pairs
    return -F.logsigmoid(beta * (per_token[:n] - per_token[n:]) - gamma).mean()
