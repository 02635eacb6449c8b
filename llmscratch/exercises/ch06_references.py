"""Chapter 6's references: what the right answer and each usual mistake compute, written out.

``llmscratch.exercises.ch06`` compares a reader's answer with these to name the mistake it reproduces:
each function is the plain computation in float64, and each keyword switch one usual slip. ``ipo_loss64``
and ``simpo_loss64`` are the references of the two losses the package does not have; ``clipped_objective64``
also returns its gradient, which tells GRPO's clipped objective from its slips where the values agree.
"""

import math
from difflib import SequenceMatcher

import torch
import torch.nn.functional as F

from llmscratch.model.losses import IGNORE_INDEX

__all__ = ["clipped_objective64", "dpo64", "group_advantages64", "ipo_loss64", "longest_common_substring",
           "matching_blocks", "normal_interval", "response_logprobs64", "simpo_loss64", "wilson64"]


def response_logprobs64(logits: torch.Tensor, targets: torch.Tensor, *, shift: int = 0, masked=True, mean=False,
                        normalised=True) -> torch.Tensor:
    """Summed log-probability of each row's kept targets (N,), from logits (N, T, V), in float64.

    Each usual mistake a switch: ``shift`` 1 shifts the already shifted targets once more; ``masked`` False
    scores the masked positions as token 0; ``mean`` averages over the kept targets; ``normalised`` False
    reads the raw logits.
    """
    logits, targets = logits[:, : logits.size(1) - shift].double(), targets[:, shift:]
    keep = targets != IGNORE_INDEX  # (N, T)
    logp = torch.log_softmax(logits, dim=-1) if normalised else logits  # (N, T, V)
    picked = logp.gather(-1, targets.masked_fill(~keep, 0).unsqueeze(-1)).squeeze(-1)  # (N, T)
    picked = torch.where(keep, picked, 0.0) if masked else picked
    return picked.sum(-1) / keep.sum(-1) if mean else picked.sum(-1)  # (N,)


def dpo64(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta: float,
          label_smoothing: float = 0.0, *, scale_inside=True, reference=True, swapped=False, reduce="mean") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's (loss, chosen rewards, rejected rewards) in float64; each usual mistake a switch.

    scale_inside False: beta multiplies the loss instead of the margin; reference False: no reference;
    swapped: rejected minus chosen; reduce "sum" sums over the pairs.
    """
    pc, pr, rc, rr = (t.detach().double() for t in (policy_chosen, policy_rejected, reference_chosen,
                                                    reference_rejected))
    if not reference:
        rc, rr = torch.zeros_like(rc), torch.zeros_like(rr)
    chosen, rejected = pc - rc, pr - rr  # (B,) the log-ratios
    margin = (rejected - chosen) if swapped else (chosen - rejected)  # (B,)
    inside, outside = (beta, 1.0) if scale_inside else (1.0, beta)
    eps = label_smoothing
    losses = -outside * ((1 - eps) * F.logsigmoid(inside * margin) + eps * F.logsigmoid(-inside * margin))  # (B,)
    loss = losses.sum() if reduce == "sum" else losses.mean()
    return loss, beta * chosen, beta * rejected


def wilson64(successes: int, trials: int, z: float, *, shifted_centre=True, second_term=True,
             divided=True) -> tuple[float, float]:
    """The Wilson interval, written out; each usual mistake a switch (the centre left at p, a term missing)."""
    p, z2 = successes / trials, z * z
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials) if shifted_centre else p
    spread = p * (1 - p) / trials + (z2 / (4 * trials * trials) if second_term else 0.0)
    half = z * math.sqrt(spread) / ((1 + z2 / trials) if divided else 1.0)
    return centre - half, centre + half


def normal_interval(successes: int, trials: int, z: float, *, clipped=False) -> tuple[float, float]:
    """The normal approximation p +- z sqrt(p (1 - p) / n), the interval Wilson's replaces."""
    p = successes / trials
    half = z * math.sqrt(p * (1 - p) / trials)
    low, high = p - half, p + half
    return (max(0.0, low), min(1.0, high)) if clipped else (low, high)


def longest_common_substring(a: list, b: list) -> int:
    """The longest run of words that a and b share, contiguous: what a slip computes instead of the LCS."""
    best = 0
    for i in range(len(a)):
        for j in range(len(b)):
            k = 0
            while i + k < len(a) and j + k < len(b) and a[i + k] == b[j + k]:
                k += 1
            best = max(best, k)
    return best


def matching_blocks(a: list, b: list) -> int:
    """The words difflib.SequenceMatcher matches: the longest run first, then either side of it, never across it.

    Often the LCS, but not when the longest run cuts off words that a longer subsequence would use.
    """
    return sum(block.size for block in SequenceMatcher(None, a, b).get_matching_blocks())


def ipo_loss64(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta: float, *,
               beta_inside=False, target=lambda beta: 1 / (2 * beta), swapped=False, reduce="mean") -> torch.Tensor:
    """IPO's loss (Azar et al., 2023) in float64: the mean of (h - 1 / (2 beta))^2, h the log-ratio margin.

    Each usual mistake a switch: beta_inside scales h by beta as DPO does; target another target;
    swapped: rejected minus chosen; reduce "sum" sums over the pairs.
    """
    pc, pr, rc, rr = (t.detach().double() for t in (policy_chosen, policy_rejected, reference_chosen,
                                                    reference_rejected))
    h = (pc - rc) - (pr - rr)  # (B,)
    h = -h if swapped else h
    h = beta * h if beta_inside else h
    losses = (h - target(beta)) ** 2  # (B,)
    return losses.sum() if reduce == "sum" else losses.mean()


def simpo_loss64(logprobs: torch.Tensor, counts: torch.Tensor, beta: float, gamma: float, *, normalised=True,
                 gamma_sign=1.0, gamma_scaled=False, swapped=False, reduce="mean") -> torch.Tensor:
    """SimPO's loss (Meng et al., 2024) from 2B rows' summed log-probabilities and counts (chosen rows first).

    -log sigmoid(beta * (log pi(chosen) / |chosen| - log pi(rejected) / |rejected|) - gamma), the mean over
    the B pairs, in float64 (keeps the graph of ``logprobs``). Each usual mistake a switch: normalised False
    uses the summed log-probabilities; gamma_sign -1 adds gamma; gamma_scaled multiplies gamma by beta too;
    swapped: rejected minus chosen; reduce "sum" sums over the pairs.
    """
    n = logprobs.size(0) // 2
    per_token = logprobs.double() / counts.double() if normalised else logprobs.double()  # (2B,)
    margin = per_token[:n] - per_token[n:]  # (B,)
    margin = -margin if swapped else margin
    offset = gamma_sign * (beta * gamma if gamma_scaled else gamma)
    losses = -F.logsigmoid(beta * margin - offset)  # (B,)
    return losses.sum() if reduce == "sum" else losses.mean()


def group_advantages64(rewards: torch.Tensor, *, over="group", correction=1, eps=1e-4, scaled=True, eps_inside=False,
                       keepdim=True) -> torch.Tensor:
    """GRPO's advantages of rewards (P, G) in float64: (reward - group mean) / (group std + eps), (P, G).

    Each usual mistake a switch: ``over`` "batch" normalises over every reward at once, "prompts" over
    dim 0; ``correction`` 0 is the population std; ``eps`` 0 leaves it out; ``scaled`` False only centres;
    ``eps_inside`` divides by sqrt(var + eps); ``keepdim`` False lines the (P,) statistics up with the answers.
    """
    r = rewards.detach().double()  # (P, G)
    dims = (0, 1) if over == "batch" else -1 if over == "group" else 0
    mean = r.mean(dims, keepdim=True)
    count = r.numel() if over == "batch" else r.size(dims)
    var = (r - mean).square().sum(dims, keepdim=keepdim) / (count - correction)  # 0 / 0 for one answer, no warning
    mean = mean if keepdim else mean.squeeze(dims)
    centred = r - mean
    if not scaled:
        return centred
    return centred / ((var + eps).sqrt() if eps_inside else var.sqrt() + eps)  # (P, G)


def clipped_objective64(logprobs, old_logprobs, advantages, clip: float, *, combine="min", clipped="ratio",
                        ratio="exp", per_token=True, detached_clip=False,
                        sign=1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token (N, T) in float64, and the gradient of its sum with respect to logprobs.

    min(r A, clip(r, 1 - clip, 1 + clip) A), r = exp(logprobs - old_logprobs), A one per answer (N,).
    Each usual mistake a switch: ``combine`` "max", "clipped only" (no min) or "unclipped" (r A alone);
    ``clipped`` "advantage" clips A instead of r, "product" clips r A; ``ratio`` "quotient" (logprobs /
    old_logprobs) or "difference" (no exp); ``per_token`` False lines A up with the tokens; ``detached_clip``
    detaches the clipped term; ``sign`` -1 returns the loss.
    """
    leaf = logprobs.detach().double().requires_grad_()  # (N, T)
    old = old_logprobs.detach().double()  # (N, T)
    gain = advantages.detach().double()
    gain = gain[:, None] if per_token else gain[None, :]  # (N, 1), or (1, N) against T tokens
    if ratio == "exp":
        r = torch.exp(leaf - old)
    elif ratio == "quotient":
        r = leaf / old
    else:
        r = leaf - old
    low, high = 1 - clip, 1 + clip
    plain = r * gain  # (N, T)
    if clipped == "advantage":
        other = r * gain.clamp(low, high)
    elif clipped == "product":
        other = plain.clamp(low, high)
    else:
        other = r.clamp(low, high) * gain
    other = other.detach() if detached_clip else other
    if combine == "max":
        values = torch.maximum(plain, other)
    elif combine == "clipped only":
        values = other
    elif combine == "unclipped":
        values = plain
    else:
        values = torch.minimum(plain, other)
    values = sign * values  # (N, T)
    if not values.requires_grad:  # the clipped term alone, detached: nothing reaches logprobs
        return values.detach(), torch.zeros_like(leaf)
    (grad,) = torch.autograd.grad(values.sum(), leaf)
    return values.detach(), grad
