"""Worked answers to chapter 4's exercises, word for word the answer cells of ch04-pretraining/solutions.ipynb.

Each ``# %%`` line starts one cell (the percent format that editors run as notebook cells);
``python -m llmscratch.exercises ch04 tests/exercise_answers/ch04_solutions.py`` passes every row.
"""

# %% imports
import torch

from llmscratch.model.generate import sample_next_token
from llmscratch.model.losses import IGNORE_INDEX
from llmscratch.training.optim import learning_rate


# %% next_token_loss
def next_token_loss(logits, targets):
    """Mean of -log p(target) over the positions whose target is not IGNORE_INDEX; logits (B, T, V), targets (B, T)."""
    log_probs = torch.log_softmax(logits, dim=-1)  # (B, T, V): stable, the max is subtracted inside
    counted = targets != IGNORE_INDEX  # (B, T)
    safe_targets = targets.masked_fill(~counted, 0)  # any valid id where skipped: gather needs one
    picked = log_probs.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)  # (B, T): log p(target)
    return -(picked * counted).sum() / counted.sum()  # (): a mean over the counted positions only

# %% adamw_step
def adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
    """One AdamW update (step counts from 1); returns the new (param, exp_avg, exp_avg_sq)."""
    beta1, beta2 = betas
    exp_avg = beta1 * exp_avg + (1 - beta1) * grad  # running mean of the gradient
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad  # running mean of its square
    m_hat = exp_avg / (1 - beta1**step)  # bias correction: both averages started at 0
    v_hat = exp_avg_sq / (1 - beta2**step)
    param = param * (1 - lr * weight_decay) - lr * m_hat / (v_hat.sqrt() + eps)  # decoupled decay, Adam's step
    return param, exp_avg, exp_avg_sq

# %% top_p_filter
def top_p_filter(logits, p):
    """Logits (..., V) with all but the smallest set of most likely tokens reaching probability p set to -inf."""
    if p >= 1.0:  # every token: the float cumulative sum may reach 1.0 before the last one
        return logits.clone()
    probs = torch.softmax(logits.float(), dim=-1)  # (..., V)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # equal ones ranked by id
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # (..., V): mass of the tokens ranked above
    drop_sorted = mass_above >= p  # the tokens above already reach p; the first (mass 0) always stays
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # (..., V): back in vocabulary order
    return logits.masked_fill(drop, float("-inf"))

# %% accumulate_gradients
def accumulate_gradients(model, micro_batches):
    """Fill .grad with the gradient of the mean loss of all micro-batches together; return that loss."""
    counts = [int((targets != IGNORE_INDEX).sum()) for _, targets in micro_batches]
    total = sum(counts)
    loss = 0.0
    for (inputs, targets), count in zip(micro_batches, counts):
        if count == 0:  # nothing to predict: its mean would be 0/0 = nan, and its share is 0
            continue
        share = model(inputs, targets=targets) * (count / total)  # its part of the whole batch's mean
        share.backward()  # gradients add up in .grad
        loss += share.item()
    return loss

# %% wsd_learning_rate
def wsd_learning_rate(step, config, decay_fraction=0.2):
    """Warmup as learning_rate, then config.lr, then a linear decay to config.min_lr over the last steps."""
    decay_start = max(config.warmup_steps, config.max_steps - int(decay_fraction * config.max_steps))
    if step < config.warmup_steps:
        return learning_rate(step, config)  # the same linear warmup as the cosine schedule
    if step < decay_start:
        return config.lr  # the stable phase
    progress = min(1.0, (step - decay_start) / (config.max_steps - decay_start))  # 0 -> 1 at max_steps
    return config.lr + progress * (config.min_lr - config.lr)

# %% label_smoothing_loss
def label_smoothing_loss(model, batch, smoothing=0.1):
    """Cross-entropy against (1 - smoothing) * one-hot(target) + smoothing / V, over the counted positions."""
    inputs, targets = batch
    logits = model(inputs)  # (B, T, V)
    counted = targets != IGNORE_INDEX  # (B, T)
    uniform = -torch.log_softmax(logits.float(), dim=-1).mean(dim=-1)  # (B, T): cross-entropy with uniform
    return (1 - smoothing) * next_token_loss(logits, targets) + smoothing * uniform[counted].mean()

# %% generate_min_p
def min_p_filter(logits, min_p):
    """Logits (B, V) with every token less likely than min_p times its row's most likely one set to -inf."""
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)  # (B, 1): relative to each row's top token
    return logits.masked_fill(probs < threshold, float("-inf"))


@torch.no_grad()
def generate_min_p(model, idx, max_new_tokens, min_p, temperature=1.0, generator=None):
    """idx (B, T) followed by max_new_tokens tokens drawn with min-p sampling, a KV cache, and temperature."""
    batch, prompt_len = idx.shape
    if max_new_tokens == 0:
        return idx.clone()
    caches = model.make_kv_caches(batch)
    logits = model(idx, caches)[:, -1]  # (B, V): the prompt once, filling the caches
    tokens = [idx]
    for position in range(prompt_len, prompt_len + max_new_tokens):  # where the new token goes
        kept = min_p_filter(logits / temperature, min_p)  # min-p after the temperature
        next_ids = sample_next_token(kept, temperature=1.0, generator=generator)  # (B,)
        tokens.append(next_ids[:, None])
        if position + 1 < prompt_len + max_new_tokens:  # the last token is never fed back
            logits = model(next_ids[:, None], caches, start_pos=position)[:, -1]  # (B, V)
    return torch.cat(tokens, dim=1)  # (B, T + max_new_tokens)
