"""Chapter 6's references: what the right answer and each usual mistake compute, written out.

``llmscratch.exercises.ch06`` compares a reader's answer with these to name the mistake it reproduces:
each function is the plain computation in float64, and each keyword switch one usual slip. ``ipo_loss64``
and ``simpo_loss64`` are the references of the two losses the package does not have.
"""

import math
from difflib import SequenceMatcher

import torch
import torch.nn.functional as F

from llmscratch.losses import IGNORE_INDEX

__all__ = ["dpo64", "ipo_loss64", "longest_common_substring", "matching_blocks", "normal_interval",
           "response_logprobs64", "simpo_loss64", "wilson64"]


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
