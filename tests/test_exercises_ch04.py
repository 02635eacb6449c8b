"""Chapter 4's exercise checks: the worked answers pass, plausible wrong answers fail with the right hint."""

import math

import torch
import torch.nn.functional as F
from exercise_suite import ExerciseSuite, solutions
from torch.nn.functional import nll_loss as negative_log_likelihood

from llmscratch.exercises import ch04
from llmscratch.model.generate import sample_next_token
from llmscratch.model.losses import IGNORE_INDEX
from llmscratch.training.optim import learning_rate

sol = solutions(ch04)


def verdict(answer, name):
    return ch04.CHAPTER.check(answer, name, quiet=True)


# --------------------------------------------------------------------------- wrong answers
def loss_with(*, dim=-1, mean=True, count_skipped=False, per_row=False, naive=False):
    """next_token_loss as a first attempt often writes it, each usual slip a switch."""
    def next_token_loss(logits, targets):
        counted = targets != IGNORE_INDEX
        probs = logits.exp() / logits.exp().sum(dim, keepdim=True) if naive else None  # exp overflows
        log_probs = probs.log() if naive else torch.log_softmax(logits, dim=dim)
        nll = -(log_probs.gather(-1, targets.masked_fill(~counted, 0)[..., None]).squeeze(-1) * counted)
        if per_row:
            return (nll.sum(1) / counted.sum(1)).mean()
        if not mean:
            return nll.sum()
        return nll.sum() / (targets.numel() if count_skipped else counted.sum())
    return next_token_loss


def loss_by_cross_entropy(logits, targets):
    """The very library function the exercise rebuilds."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


def loss_by_imported_nll_swallowing_errors(logits, targets):
    """nll_loss bound under another name, and any error it raises caught: still taken away, still named."""
    try:
        return negative_log_likelihood(logits.log_softmax(-1).flatten(0, 1), targets.flatten())
    except Exception:
        return sol.next_token_loss(logits, targets)


def loss_as_a_number(logits, targets):
    return torch.tensor(sol.next_token_loss(logits, targets).item())  # no gradient reaches the logits


def adamw_with(*, corrected=True, decoupled=True, decay_by_lr=True, eps_inside=False, decay_after=False,
               swap_betas=False):
    def adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        beta1, beta2 = betas[::-1] if swap_betas else betas
        if not decoupled:
            grad = grad + weight_decay * param
        exp_avg = beta1 * exp_avg + (1 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
        m, v = (exp_avg / (1 - beta1**step), exp_avg_sq / (1 - beta2**step)) if corrected else (exp_avg, exp_avg_sq)
        update = m / ((v + eps).sqrt() if eps_inside else v.sqrt() + eps)
        shrink = 1 - (weight_decay * (lr if decay_by_lr else 1) if decoupled else 0)
        param = (param - lr * update) * shrink if decay_after else param * shrink - lr * update
        return param, exp_avg, exp_avg_sq
    return adamw_step


def adamw_returning_corrected_moments(param, grad, exp_avg, exp_avg_sq, step, lr, betas=(0.9, 0.95), eps=1e-8,
                                      weight_decay=0.1):
    new_param, exp_avg, exp_avg_sq = sol.adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps,
                                                    weight_decay)
    return new_param, exp_avg / (1 - betas[0] ** step), exp_avg_sq / (1 - betas[1] ** step)


def top_p_with(*, drop_crossing=False, keep_first=True, back_to_vocab=True, ascending=False, probabilities=False,
               no_p_one=False, in_place=False):
    def top_p_filter(logits, p):
        if p >= 1.0 and not no_p_one:
            return logits.clone()
        probs = torch.softmax(logits.float(), dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=not ascending, stable=True)
        mass = sorted_probs.cumsum(-1)
        drop = mass > p if drop_crossing else (mass - sorted_probs) >= p
        if keep_first:
            drop[..., 0] = False
        if back_to_vocab:
            drop = drop.scatter(-1, order, drop)
        else:
            logits = logits.sort(dim=-1, descending=True).values
        filtered = logits.masked_fill_(drop, -math.inf) if in_place else logits.masked_fill(drop, -math.inf)
        return torch.softmax(filtered, dim=-1) if probabilities else filtered
    return top_p_filter


def accumulate_with(weighting):
    """Gradient accumulation with one slip: each micro-batch's loss weighted wrongly, or one big forward."""
    def accumulate_gradients(model, micro_batches):
        if weighting == "one forward":
            loss = model(torch.cat([x for x, _ in micro_batches]), targets=torch.cat([t for _, t in micro_batches]))
            loss.backward()
            return loss.item()
        counts = [int((t != IGNORE_INDEX).sum()) for _, t in micro_batches]
        rows = sum(x.size(0) for x, _ in micro_batches)
        total = 0.0
        for (inputs, targets), count in zip(micro_batches, counts):
            if weighting == "zeroed":
                model.zero_grad()
            weight = {"sum": 1.0, "zeroed": 1.0, "1/k": 1 / len(micro_batches), "rows": inputs.size(0) / rows,
                      "nan": count / sum(counts)}[weighting]  # "nan": right weights, the empty micro-batch kept
            share = model(inputs, targets=targets) * weight
            share.backward()
            total += share.item()
        return total
    return accumulate_gradients


def accumulate_then_step(model, micro_batches):
    loss = sol.accumulate_gradients(model, micro_batches)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
    return loss


def wsd_with(slip):
    def wsd_learning_rate(step, config, decay_fraction=0.2):
        start = config.max_steps - int(decay_fraction * config.max_steps)
        if slip != "no clamp":
            start = max(config.warmup_steps, start)
        if step < config.warmup_steps:
            return config.lr * step / config.warmup_steps if slip == "from zero" else learning_rate(step, config)
        if step < start:
            return config.lr
        progress = (step - start + (slip == "late")) / (config.max_steps - start)
        if slip == "cosine":
            progress = 0.5 * (1 - math.cos(math.pi * progress))
        return config.lr + progress * ((0.0 if slip == "to zero" else config.min_lr) - config.lr)
    return wsd_learning_rate


def wsd_that_edits_the_config(step, config, decay_fraction=0.2):
    config.max_steps = max(config.max_steps, 2)  # "fixing" a config on the way
    return sol.wsd_learning_rate(step, config, decay_fraction)


def smoothing_with(slip):
    def label_smoothing_loss(model, batch, smoothing=0.1):
        inputs, targets = batch
        log_probs = torch.log_softmax(model(inputs), dim=-1)
        counted = targets != IGNORE_INDEX
        nll = -log_probs.gather(-1, targets.masked_fill(~counted, 0)[..., None]).squeeze(-1)
        if slip == "others":
            uniform = (-log_probs.sum(-1) - nll) / (log_probs.size(-1) - 1)
        else:
            uniform = -log_probs.sum(-1) if slip == "sum" else -log_probs.mean(-1)
        weight = 1.0 if slip == "unweighted" else 1 - smoothing
        if slip == "all positions":
            return weight * nll[counted].mean() + smoothing * uniform.mean()
        loss = (weight * nll + smoothing * uniform)[counted].mean()
        return {"detached": loss.detach(), "float": loss.item()}.get(slip, loss)
    return label_smoothing_loss


def min_p_with(slip):
    """generate_min_p with one slip: in the filter, the sampling, the cache positions or what it returns."""
    @torch.no_grad()
    def generate_min_p(model, idx, max_new_tokens, min_p, temperature=1.0, generator=None):
        caches = None if slip == "no cache" else model.make_kv_caches(idx.size(0))
        tokens = idx
        for step in range(max_new_tokens):
            if step == 0 or caches is None:  # the whole sequence (the prompt, or everything without a cache)
                logits = model(tokens, caches)[:, -1]
            else:  # the last token alone, at its position
                position = tokens.size(1) - 1 + (slip == "next position")
                logits = model(tokens[:, -1:], caches, start_pos=position)[:, -1]
            scaled = logits / temperature
            probs = torch.softmax(logits if slip == "before temperature" else scaled, dim=-1)
            top = probs.amax() if slip == "batch max" else probs.amax(dim=-1, keepdim=True)
            kept = scaled.masked_fill(probs < (min_p if slip == "absolute" else min_p * top), -math.inf)
            next_ids = sample_next_token(kept, temperature if slip == "twice" else 1.0, generator=generator)
            tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
        return tokens[:, idx.size(1):] if slip == "new only" else tokens
    return generate_min_p


WRONG = [  # (exercise, wrong answer, the smallest failing input it must report, the hint it must get)
    ("next_token_loss", loss_with(dim=1), "(1, 1, 2)", "over the vocabulary (dim=-1)"),
    ("next_token_loss", loss_with(mean=False), "(1, 3, 5)", "not sum"),
    ("next_token_loss", loss_with(count_skipped=True), "(2, 4, 7)", "count neither in the sum nor"),
    ("next_token_loss", loss_with(per_row=True), "(2, 4, 7)", "not per sequence"),
    ("next_token_loss", loss_with(naive=True), "(2, 3, 6) (large", "use torch.log_softmax"),
    ("next_token_loss", loss_by_cross_entropy, "(1, 1, 2)", "write it without F.cross_entropy"),
    ("next_token_loss", loss_by_imported_nll_swallowing_errors, "(1, 1, 2)", "write it without F.nll_loss"),
    ("next_token_loss", loss_as_a_number, "(1, 1, 2), targets [[1]]: loss.backward()", "no .item()"),
    ("adamw_step", adamw_with(corrected=False), "step=1,", "bias correction"),
    ("adamw_step", adamw_with(decoupled=False), "step=1,", "Adam with L2"),
    ("adamw_step", adamw_with(decay_by_lr=False), "step=1,", "scaled by the learning rate"),
    ("adamw_step", adamw_with(decay_after=True), "step=1,", "as it was before this update"),
    ("adamw_step", adamw_with(eps_inside=True), "gradients of size 1e-8", "eps goes outside the square root"),
    ("adamw_step", adamw_with(swap_betas=True), "step=1,", "beta1 * exp_avg + (1 - beta1) * grad"),
    ("adamw_step", adamw_returning_corrected_moments, "step=1,", "without bias correction"),
    ("adamw_step", lambda *args, **kwargs: tuple(t.float() for t in sol.adamw_step(*args, **kwargs)), "step=1,",
     "exactly torch.float64"),
    ("top_p_filter", top_p_with(drop_crossing=True), "shape (3, 7)", "keep the token that crosses p"),
    ("top_p_filter", top_p_with(drop_crossing=True, keep_first=False), "shape (1, 5)", "always kept"),
    ("top_p_filter", top_p_with(back_to_vocab=False), "shape (1, 5)", "back in vocabulary order"),
    ("top_p_filter", top_p_with(ascending=True), "shape (1, 5)", "descending order"),
    ("top_p_filter", top_p_with(probabilities=True), "shape (2,) [0, 0], p=0.5", "not probabilities"),
    ("top_p_filter", top_p_with(no_p_one=True), "p=1.0", "with p = 1 every token stays"),
    ("top_p_filter", top_p_with(in_place=True), "shape (2,) [0, 0], p=0.5", "masked_fill, not masked_fill_"),
    ("accumulate_gradients", accumulate_with("sum"), "[2, 2] rows of 4", "a plain sum is k times too large"),
    ("accumulate_gradients", accumulate_with("1/k"), "[1, 2, 3] rows", "not 1 / k"),
    ("accumulate_gradients", accumulate_with("rows"), "[2, 10] counted", "not by rows"),
    ("accumulate_gradients", accumulate_with("zeroed"), "[2, 2] rows of 4", "don't zero the gradients"),
    ("accumulate_gradients", accumulate_with("nan"), "[6, 0, 6] counted", "0/0"),
    ("accumulate_gradients", accumulate_with("one forward"), "[2, 2] rows of 4", "on its own"),
    ("accumulate_gradients", accumulate_then_step, "[1] rows of 1", "take no optimizer step"),
    ("wsd_learning_rate", wsd_with("from zero"), "max_steps=10, warmup_steps=2", "step 0 already learns"),
    ("wsd_learning_rate", wsd_with("to zero"), "max_steps=10, warmup_steps=2", "not to 0"),
    ("wsd_learning_rate", wsd_with("late"), "max_steps=10, warmup_steps=2", "one past the last step"),
    ("wsd_learning_rate", wsd_with("cosine"), "max_steps=10, warmup_steps=6", "not a cosine"),
    ("wsd_learning_rate", wsd_with("no clamp"), "max_steps=10, warmup_steps=6", "never starts before the warmup"),
    ("wsd_learning_rate", wsd_that_edits_the_config, "max_steps=1,", "never change it"),
    ("label_smoothing_loss", smoothing_with("others"), "shape (1, 1)", "not over the V - 1 others"),
    ("label_smoothing_loss", smoothing_with("sum"), "shape (1, 1)", "not the sum"),
    ("label_smoothing_loss", smoothing_with("unweighted"), "shape (1, 1)", "weighted by 1 - smoothing"),
    ("label_smoothing_loss", smoothing_with("all positions"), "shape (2, 6)", "in both terms"),
    ("label_smoothing_loss", smoothing_with("float"), "shape (1, 1)", "no .item()"),
    ("label_smoothing_loss", smoothing_with("detached"), "OptimizerStep(model", "no .detach()"),
    ("generate_min_p", min_p_with("before temperature"), "temperature=0.7", "after the temperature"),
    ("generate_min_p", min_p_with("absolute"), "min_p=0.1, temperature=1.0", "the threshold is relative"),
    ("generate_min_p", min_p_with("batch max"), "min_p=0.1, temperature=1.0", "its own most likely token"),
    ("generate_min_p", min_p_with("twice"), "temperature=1.5", "the temperature is applied once"),
    ("generate_min_p", min_p_with("no cache"), "max_new_tokens=4, min_p=0.0", "use the KV cache"),
    ("generate_min_p", min_p_with("next position"), "max_new_tokens=4, min_p=0.0", "at its own position"),
    ("generate_min_p", min_p_with("new only"), "max_new_tokens=0", "return idx followed by the new tokens"),
]


class TestChapter4(ExerciseSuite):
    chapter, folder, wrong = ch04, "ch04-pretraining", WRONG
    slow = {"generate_min_p", "accumulate_gradients"}


# --------------------------------------------------------------------------- chapter 4 only
def test_an_answer_that_raises_or_returns_nonsense_is_a_verdict_not_a_traceback():
    assert "ZeroDivisionError" in verdict(lambda model, batches: 1 / 0, "accumulate_gradients").detail
    assert "a tuple (param, exp_avg, exp_avg_sq)" in verdict(lambda *args, **kwargs: "a string", "adamw_step").detail
    assert "a tensor of shape (1, 1)" in verdict(lambda *args, **kwargs: None, "generate_min_p").detail
