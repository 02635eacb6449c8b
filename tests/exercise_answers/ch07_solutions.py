"""Worked answers to chapter 7's exercises, word for word the answer cells of ch07-deployment/solutions.ipynb.

Each ``# %%`` line starts one cell (the percent format that editors run as notebook cells);
``python -m llmscratch.exercises ch07 tests/exercise_answers/ch07_solutions.py`` passes every row.
"""

# %% imports
import copy

import torch
import torch.nn.functional as F

from llmscratch.deployment.prune import block_linears
from llmscratch.model.losses import IGNORE_INDEX


# %% quantize_rows_int8
def quantize_rows_int8(weight):
    """(q, scales): int8 (out, in) in [-127, 127] and float32 (out,), with weight ~ q * scales[:, None]."""
    largest = weight.abs().amax(dim=1)  # (out,) each row's largest magnitude
    scales = (largest / 127).clamp(min=torch.finfo(torch.float32).tiny)  # a row of zeros: no 0 / 0
    q = torch.round(weight / scales[:, None]).clamp(-127, 127)  # (out, in) the nearest level
    return q.to(torch.int8), scales

# %% pack_int4_pairs
def pack_int4_pairs(q):
    """int4 values (out, in) in [-7, 7] as bytes (out, in / 2): q + 8, column 2j low nibble, 2j + 1 high."""
    stored = (q + 8).to(torch.uint8)  # (out, in) in 1 .. 15: four bits, no sign to lose
    low, high = stored[:, 0::2], stored[:, 1::2]  # (out, in / 2) each
    return low | (high << 4)

# %% dequantize_int4_groups
def dequantize_int4_groups(packed, scales):
    """The float32 weight (out, in) of packed int4 values (out, in / 2) and group scales (out, in / group_size)."""
    low, high = packed & 0x0F, packed >> 4  # (out, in / 2) each: columns 2j and 2j + 1
    q = torch.stack([low, high], dim=2).flatten(1).float() - 8  # (out, in) in [-7, 7]
    group_size = q.size(1) // scales.size(1)
    return q * scales.repeat_interleave(group_size, dim=1)  # each scale over its group's columns

# %% magnitude_masks
def magnitude_masks(weights, sparsity, scope="layer"):
    """Bool masks, True where a weight stays: the round(sparsity * n) smallest |w| of each matrix, or of all."""
    groups = [[w] for w in weights] if scope == "layer" else [list(weights)]
    masks = []
    for group in groups:
        magnitudes = torch.cat([w.abs().flatten() for w in group])  # (n,) matrix after matrix
        count = round(sparsity * magnitudes.numel())
        keep = torch.ones_like(magnitudes, dtype=torch.bool)
        keep[magnitudes.argsort(stable=True)[:count]] = False  # the smallest; of equal ones, the earlier
        masks += [part.view_as(w) for part, w in zip(keep.split([w.numel() for w in group]), group)]
    return masks

# %% distill_loss
def distill_loss(student_logits, teacher_logits, targets, temperature, alpha):
    """alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * cross-entropy: a () mean over the counted tokens."""
    vocab = student_logits.size(-1)
    student, teacher = student_logits.reshape(-1, vocab), teacher_logits.reshape(-1, vocab)  # (N, V) each
    targets = targets.reshape(-1)  # (N,)
    log_q = F.log_softmax(student / temperature, dim=-1)  # (N, V) the student, softened
    log_p = F.log_softmax(teacher / temperature, dim=-1)  # (N, V) the teacher, softened alike
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)  # (N,) KL(p || q) of each token
    soft = temperature**2 * kl[targets != IGNORE_INDEX].mean()
    hard = F.cross_entropy(student, targets, ignore_index=IGNORE_INDEX)
    return alpha * soft + (1 - alpha) * hard

# %% tokens_per_round
def tokens_per_round(acceptance, k):
    """Mean tokens one round yields: guess i counts if the i before it were kept (a^i), plus the target's own."""
    return sum(acceptance**i for i in range(k + 1))  # 1 + a + ... + a^k

# %% speculative_accept
def speculative_accept(target_probs, draft_probs, draft_tokens, uniforms):
    """(n, next_probs): the guesses kept, and the distribution the round's last token is drawn from."""
    k = draft_tokens.size(0)
    for i in range(k):
        x = draft_tokens[i]
        ratio = target_probs[i, x] / draft_probs[i, x]  # q(x) > 0: x was drawn from q
        if uniforms[i] >= ratio.clamp(max=1.0):  # rejected: the round ends here
            residual = (target_probs[i] - draft_probs[i]).clamp(min=0.0)  # (V,) the mass p has beyond q
            return i, residual / residual.sum()
    return k, target_probs[k]  # every guess kept: a bonus token from p_{k+1}

# %% two_four_prune
def two_four_prune(model):
    """A copy of ``model`` whose blocks' linear weights keep the two largest |w| of every four neighbouring inputs."""
    pruned = copy.deepcopy(model)
    with torch.no_grad():
        for _, layer in block_linears(pruned):
            weight = layer.weight  # (out, in), in a multiple of 4
            groups = weight.abs().reshape(weight.size(0), -1, 4)  # (out, in / 4, 4)
            smallest = groups.argsort(dim=-1, stable=True)[..., :2]  # (out, in / 4, 2)
            drop = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, smallest, True)
            weight.masked_fill_(drop.reshape(weight.shape), 0.0)
    return pruned

# %% w8a8_linear
def w8a8_linear(x, q, scales):
    """x (..., in) times the int8 weight q (out, in) with row scales (out,), x quantized to int8 per token."""
    largest = x.abs().amax(dim=-1, keepdim=True)  # (..., 1) one scale per token
    x_scales = largest.clamp(min=torch.finfo(torch.float32).tiny) / 127
    x_q = torch.round(x / x_scales).clamp(-127, 127).to(torch.int32)  # (..., in)
    sums = x_q @ q.to(torch.int32).T  # (..., out) exact integer sums: int8 ones would wrap around
    return sums.float() * x_scales * scales  # (..., out)
