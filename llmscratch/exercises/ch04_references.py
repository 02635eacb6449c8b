"""Chapter 4's references: what the right answer and each usual mistake compute, written out.

``llmscratch.exercises.ch04`` compares a reader's answer with these to name the mistake it reproduces:
each function is the plain computation, and each keyword switch one usual slip.
"""

import math

import torch

from llmscratch.model.generate import sample_next_token
from llmscratch.model.losses import IGNORE_INDEX
from llmscratch.training.config import TrainConfig
from llmscratch.training.optim import learning_rate

__all__ = ["adamw64", "change", "min_p_generate", "smoothed64", "token_nll64", "top_p", "torch_adamw", "wsd_schedule"]


def token_nll64(logits, targets, dim=-1) -> tuple[torch.Tensor, torch.Tensor]:
    """-log p(target) at each position (B, T) in float64, 0 where skipped; and the mask of counted positions."""
    keep = targets != IGNORE_INDEX  # (B, T)
    log_probs = torch.log_softmax(logits.double(), dim=dim)  # (B, T, V)
    picked = log_probs.gather(-1, targets.masked_fill(~keep, 0)[..., None]).squeeze(-1)  # (B, T)
    return torch.where(keep, -picked, 0.0), keep


def change(got, before: torch.Tensor):
    """got - before when got is a tensor like before (the mistakes differ most in the update itself), else got."""
    if isinstance(got, torch.Tensor) and got.shape == before.shape and got.is_floating_point():
        return got.detach().double() - before
    return got


def torch_adamw(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    """One update of torch.optim.AdamW from the given state, in float64: (param, exp_avg, exp_avg_sq)."""
    weight = param.double().clone().requires_grad_(True)
    optimizer = torch.optim.AdamW([weight], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    weight.grad = grad.double().clone()
    optimizer.state[weight] = {"step": torch.tensor(float(step - 1)), "exp_avg": exp_avg.double().clone(),
                               "exp_avg_sq": exp_avg_sq.double().clone()}
    optimizer.step()
    state = optimizer.state[weight]
    return weight.detach(), state["exp_avg"], state["exp_avg_sq"]


def adamw64(param, grad, m, v, step, lr, betas, eps, weight_decay, *, corrected=True, decoupled=True,
             decay_by_lr=True, eps_inside=False, decay_after=False):
    """The parameter after one AdamW update, written out, each usual mistake a switch."""
    beta1, beta2 = betas
    if not decoupled:  # L2 regularisation: the decay goes into the gradient, and through Adam's scaling
        grad = grad + weight_decay * param
    m, v = beta1 * m + (1 - beta1) * grad, beta2 * v + (1 - beta2) * grad**2
    if corrected:
        m, v = m / (1 - beta1**step), v / (1 - beta2**step)
    update = m / ((v + eps).sqrt() if eps_inside else v.sqrt() + eps)
    shrink = 1 - (weight_decay * (lr if decay_by_lr else 1.0) if decoupled else 0.0)
    return (param - lr * update) * shrink if decay_after else param * shrink - lr * update


def top_p(logits, p, *, drop_crossing=False, keep_first=True, back_to_vocab=True, ascending=False):
    """Top-p filtering written out (with float32 probabilities, as a first answer has them), each mistake a switch."""
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=not ascending, stable=True)
    mass = sorted_probs.cumsum(-1)  # (..., V)
    drop = mass > p if drop_crossing else (mass - sorted_probs) >= p
    if keep_first:
        drop[..., 0] = False
    if back_to_vocab:
        return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits.gather(-1, order).masked_fill(drop, float("-inf"))  # left in the sorted order


def wsd(step, config, fraction, *, floor=None, late=0, cosine=False, clamp=True, from_zero=False) -> float:
    """Warmup-stable-decay at one step, written out, each usual mistake a switch."""
    start = config.max_steps - int(fraction * config.max_steps)
    start = max(config.warmup_steps, start) if clamp else start
    if step < config.warmup_steps:
        return config.lr * step / config.warmup_steps if from_zero else learning_rate(step, config)
    if step < start:
        return config.lr
    progress = min(1.0, (step - start + late) / (config.max_steps - start))
    shape = 0.5 * (1 - math.cos(math.pi * progress)) if cosine else progress
    end = config.min_lr if floor is None else floor
    return config.lr + shape * (end - config.lr)


def wsd_schedule(config: TrainConfig, fraction: float, **mistake) -> torch.Tensor:
    """The rates of steps 0 .. max_steps - 1 (float64)."""
    return torch.tensor([wsd(s, config, fraction, **mistake) for s in range(config.max_steps)], dtype=torch.float64)


def smoothed64(logits, targets, smoothing, *, others=False, summed=False, target_weight=None, all_positions=False):
    """Label-smoothed cross-entropy written out in float64, each usual mistake a switch."""
    nll, keep = token_nll64(logits, targets)
    log_probs = torch.log_softmax(logits.double(), dim=-1)  # (B, T, V)
    vocab = logits.size(-1)
    if others:  # smoothing spread over the V - 1 other tokens
        uniform = (-log_probs.sum(-1) - nll) / (vocab - 1)
    else:
        uniform = -log_probs.sum(-1) if summed else -log_probs.mean(-1)  # (B, T)
    weight = 1 - smoothing if target_weight is None else target_weight
    if all_positions:
        return weight * nll.sum() / keep.sum() + smoothing * uniform.mean()
    return (weight * nll + smoothing * uniform)[keep].mean()


def min_p_generate(model, idx, n, min_p, temperature, seed, *, before_temperature=False, absolute=False,
                    batch_max=False, temperature_twice=False) -> torch.Tensor:
    """Min-p sampling without a cache (the whole sequence each step), each usual mistake a switch."""
    generator = torch.Generator().manual_seed(seed)
    tokens = idx
    with torch.no_grad():
        for _ in range(n):
            logits = model(tokens)[:, -1].double()  # (B, V)
            scaled = logits / temperature
            probs = torch.softmax(logits if before_temperature else scaled, dim=-1)  # (B, V)
            top = probs.amax() if batch_max else probs.amax(dim=-1, keepdim=True)
            kept = scaled.masked_fill(probs < (min_p if absolute else min_p * top), float("-inf")).float()
            next_ids = sample_next_token(kept, temperature if temperature_twice else 1.0, generator=generator)
            tokens = torch.cat([tokens, next_ids[:, None]], dim=1)  # (B, T + 1)
    return tokens
