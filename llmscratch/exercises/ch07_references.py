"""Chapter 7's references: what the right answer and each usual mistake compute, written out.

``llmscratch.exercises.ch07`` compares a reader's answer with these to name the mistake it reproduces:
each function is the plain computation (in float64 where it computes with floats), and each keyword
switch one usual slip. ``two_four_mask`` and ``w8a8_linear64`` are the references of what the package
does not have: 2:4 sparsity, and activations quantized beside the weights.
"""

import torch
import torch.nn.functional as F

from llmscratch.model.losses import IGNORE_INDEX

__all__ = ["TINY", "accept64", "dequantize_int4_64", "distill64", "distill_by_distributions", "int8_scales64",
           "int8_values", "keep_masks", "pack_int4_64", "two_four_mask", "w8a8_linear64"]

TINY = torch.finfo(torch.float32).tiny  # the floor of a scale: a row of zeros gets no 0/0


# --------------------------------------------------------------------------- quantization
def int8_scales64(weight: torch.Tensor, *, reduce: str = "absmax", dim: int = 1, levels: int = 127) -> torch.Tensor:
    """The scales (out,) of symmetric int8: each row's largest |w| over ``levels``, in float64.

    Each usual mistake a switch: ``reduce`` "mean" (the mean |w|), "tensor" (one scale for the whole matrix),
    "signed" (the largest w, not |w|); ``dim`` 0 (a scale per column); ``levels`` 128 or 255.
    """
    w = weight.double()
    if reduce == "mean":
        largest = w.abs().mean(dim)
    elif reduce == "tensor":
        largest = w.abs().amax().expand(w.size(0))
    elif reduce == "signed":
        largest = w.amax(dim)
    else:
        largest = w.abs().amax(dim)
    return (largest / levels).clamp(min=TINY)


def int8_values(weight: torch.Tensor, scales: torch.Tensor, *, rounding: str = "round") -> torch.Tensor:
    """q = round(w / scale) clamped to [-127, 127], as int64; ``rounding`` "trunc" or "floor" for the slips."""
    ratio = weight.double() / scales.double()[:, None]  # (out, in)
    rounded = {"round": torch.round, "trunc": torch.trunc, "floor": torch.floor}[rounding](ratio)
    return rounded.clamp(-127, 127).long()


def pack_int4_64(q: torch.Tensor, *, offset: int = 8, swapped: bool = False, layout: str = "pairs") -> torch.Tensor:
    """int4 values (out, in) as bytes (out, in / 2), uint8: q + offset, column 2j low nibble, 2j + 1 high.

    Each usual mistake a switch: ``offset`` 0 (negatives wrap around, as ``.to(torch.uint8)`` makes them) or 7;
    ``swapped`` (column 2j high); ``layout`` "halves" (column j with column j + in / 2).
    """
    stored = (q.long() + offset) % 256  # what (q + offset).to(torch.uint8) holds
    half = q.size(1) // 2
    low, high = (stored[:, :half], stored[:, half:]) if layout == "halves" else (stored[:, 0::2], stored[:, 1::2])
    if swapped:
        low, high = high, low
    return ((low | (high << 4)) % 256).to(torch.uint8)


def dequantize_int4_64(packed: torch.Tensor, scales: torch.Tensor, *, offset: int = 8, swapped: bool = False,
                       signed_nibbles: bool = False, tiled: bool = False, one_scale: bool = False) -> torch.Tensor:
    """The float64 weight (out, in) that packed int4 values (out, in / 2) and group scales (out, n_groups) stand for.

    Each usual mistake a switch: ``offset`` 0 (the stored 1 .. 15 taken as the values); ``swapped`` (the high
    nibble first); ``signed_nibbles`` (a nibble read as two's complement, 8 .. 15 as -8 .. -1); ``tiled``
    (``scales.repeat``: the groups' scales in turn, not each one group_size times); ``one_scale`` (the row's first).
    """
    low, high = packed.long() & 0x0F, packed.long() >> 4  # (out, in / 2) each
    if swapped:
        low, high = high, low
    stored = torch.stack([low, high], dim=2).flatten(1)  # (out, in)
    values = torch.where(stored >= 8, stored - 16, stored) if signed_nibbles else stored - offset
    out_features, in_features = values.shape
    group_size = in_features // scales.size(1)
    if tiled:
        spread = scales.repeat(1, group_size)
    elif one_scale:
        spread = scales[:, :1].expand(out_features, in_features)
    else:
        spread = scales.repeat_interleave(group_size, dim=1)
    return values.double() * spread.double()


def w8a8_linear64(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, *, quantized: bool = True,
                  per_tensor: bool = False, int8_sums: bool = False, x_scaled: bool = True, rounding: str = "round",
                  scales_across: bool = False) -> torch.Tensor:
    """x (..., in) times the int8 weight q (out, in) of row scales (out,), each token of x quantized to int8 too.

    Each token (row of x) gets the scale max |x| / 127 and round(x / scale) clamped to [-127, 127]; the integer
    products are summed exactly and the sum multiplied by both scales. Each usual mistake a switch:
    ``quantized`` False (x left in floating point); ``per_tensor`` (one scale for all of x); ``int8_sums``
    (the sums wrap around as an int8 matmul's do); ``x_scaled`` False (the activation scale forgotten);
    ``rounding`` "trunc"; ``scales_across`` (the token scales laid along the outputs).
    """
    rows = x.double().reshape(-1, x.size(-1))  # (N, in)
    weight_scales = scales.double()[None, :]  # (1, out)
    if not quantized:
        out = rows @ (q.double() * scales.double()[:, None]).T  # (N, out)
        return out.reshape(*x.shape[:-1], q.size(0))
    largest = rows.abs().amax().expand(rows.size(0)) if per_tensor else rows.abs().amax(dim=1)  # (N,)
    x_scales = largest.clamp(min=TINY) / 127  # (N,)
    ratio = rows / x_scales[:, None]
    x_q = (torch.trunc(ratio) if rounding == "trunc" else torch.round(ratio)).clamp(-127, 127)  # (N, in)
    sums = x_q @ q.double().T  # (N, out): whole numbers, exact in float64
    if int8_sums:
        sums = torch.remainder(sums + 128, 256) - 128
    if scales_across:
        token_scales = x_scales[None, :]  # (1, N): only broadcasts when N == out
    else:
        token_scales = x_scales[:, None] if x_scaled else torch.ones_like(x_scales)[:, None]  # (N, 1)
    return (sums * token_scales * weight_scales).reshape(*x.shape[:-1], q.size(0))


# --------------------------------------------------------------------------- pruning
def keep_masks(weights: list[torch.Tensor], sparsity: float, scope: str = "layer", *, largest: bool = False,
               signed: bool = False, per_row: bool = False, threshold: bool = False, count=round) -> list[torch.Tensor]:
    """Bool masks, True where a weight stays, of magnitude pruning: round(sparsity * n) of the smallest |w| go.

    n counts each matrix (scope "layer") or all of them together ("global"); of equal magnitudes the earlier
    goes first (row by row, matrix after matrix), as ``llmscratch.deployment.prune.magnitude_prune`` prunes. Each usual
    mistake a switch: ``largest`` (the largest go); ``signed`` (w ranked, not |w|); ``per_row`` (each row on
    its own); ``threshold`` (every |w| up to the k-th smallest goes, ties and all); ``count`` (int: truncated).
    """
    if per_row:
        groups = [[row] for w in weights for row in w]
    else:
        groups = [[w] for w in weights] if scope == "layer" else [list(weights)]
    kept = []
    for group in groups:
        scores = torch.cat([(w if signed else w.abs()).double().flatten() for w in group])  # (n,)
        n_pruned = count(sparsity * scores.numel())
        order = torch.argsort(scores, descending=largest, stable=True)
        drop = torch.zeros_like(scores, dtype=torch.bool)
        if threshold and n_pruned > 0:
            drop = scores <= scores[order[n_pruned - 1]]
        else:
            drop[order[:n_pruned]] = True
        kept += list((~drop).split([w.numel() for w in group]))
    flat = torch.cat(kept)
    return [part.view_as(w) for part, w in zip(flat.split([w.numel() for w in weights]), weights)]


def two_four_mask(weight: torch.Tensor, *, along_rows: bool = False, keep_smallest: bool = False,
                  strided: bool = False, per_row: bool = False, signed: bool = False) -> torch.Tensor:
    """Bool mask (out, in), True where a weight stays: the two largest |w| of every four neighbouring inputs of a row.

    Of equal magnitudes the earlier goes first, as in ``magnitude_prune``. Each usual mistake a switch:
    ``along_rows`` (groups of four rows); ``keep_smallest``; ``strided`` (inputs j, j + in/4, j + in/2, ...);
    ``per_row`` (half of each row, not of each group); ``signed`` (w ranked, not |w|).
    """
    scores = (weight if signed else weight.abs()).double()
    if along_rows:
        return two_four_mask(weight.T, keep_smallest=keep_smallest, signed=signed).T
    out_features, in_features = scores.shape
    if per_row:
        groups = scores[:, None, :]  # (out, 1, in)
    elif strided:
        groups = scores.reshape(out_features, 4, in_features // 4).transpose(1, 2)  # (out, in/4, 4)
    else:
        groups = scores.reshape(out_features, in_features // 4, 4)  # (out, in/4, 4)
    order = torch.argsort(groups, dim=-1, descending=keep_smallest, stable=True)
    drop = torch.zeros_like(groups, dtype=torch.bool)
    drop.scatter_(-1, order[..., : groups.size(-1) // 2], True)
    if strided:
        drop = drop.transpose(1, 2)
    return ~drop.reshape(out_features, in_features)


# --------------------------------------------------------------------------- distillation
def distill64(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
              temperature: float, alpha: float, *, power: int = 2, reverse: bool = False, soft_teacher: bool = True,
              soft_student: bool = True, all_positions: bool = False, vocab_mean: bool = False,
              swapped: bool = False, soft_cross_entropy: bool = False, summed: bool = False) -> torch.Tensor:
    """alpha * T^power * KL(teacher_T || student_T) + (1 - alpha) * cross-entropy, the mean per counted token.

    In float64, without a graph. Each usual mistake a switch: ``power`` 0 or 1 (T^2 forgotten);
    ``reverse`` (KL(student || teacher)); ``soft_teacher`` / ``soft_student`` False (that side's softmax
    without the temperature); ``all_positions`` (the KL averaged over the ignored positions too);
    ``vocab_mean`` (averaged over the vocabulary too); ``swapped`` (alpha on the cross-entropy);
    ``soft_cross_entropy`` (the cross-entropy of the softened student); ``summed`` (summed over the tokens).
    """
    vocab = student_logits.size(-1)
    student = student_logits.detach().double().reshape(-1, vocab)  # (N, V)
    teacher = teacher_logits.detach().double().reshape(-1, vocab)  # (N, V)
    targets = targets.reshape(-1)  # (N,)
    counted = targets != IGNORE_INDEX  # (N,)
    log_q = F.log_softmax(student / (temperature if soft_student else 1.0), dim=-1)  # (N, V)
    log_p = F.log_softmax(teacher / (temperature if soft_teacher else 1.0), dim=-1)  # (N, V)
    first, second = (log_q, log_p) if reverse else (log_p, log_q)
    kl = (first.exp() * (first - second)).sum(-1)  # (N,)
    if vocab_mean:
        kl = kl / vocab
    kl = kl.mean() if all_positions else kl[counted].sum() if summed else kl[counted].mean()
    cross_entropy = F.cross_entropy(student / (temperature if soft_cross_entropy else 1.0), targets,
                                    ignore_index=IGNORE_INDEX)
    weight_kl, weight_ce = (1 - alpha, alpha) if swapped else (alpha, 1 - alpha)
    return weight_kl * temperature**power * kl + weight_ce * cross_entropy


def distill_by_distributions(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                             temperature: float, alpha: float) -> torch.Tensor:
    """The loss with the KL of ``torch.distributions.kl_divergence``, in the logits' own dtype: the usual mistake

    that is right until a probability of the student underflows to 0, where that KL is inf (large logits).
    """
    vocab = student_logits.size(-1)
    student, teacher = student_logits.detach().reshape(-1, vocab), teacher_logits.detach().reshape(-1, vocab)
    counted = targets.reshape(-1) != IGNORE_INDEX  # (N,)
    kl = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=teacher / temperature),
                                           torch.distributions.Categorical(logits=student / temperature))  # (N,)
    cross_entropy = F.cross_entropy(student, targets.reshape(-1), ignore_index=IGNORE_INDEX)
    return alpha * temperature**2 * kl[counted].mean() + (1 - alpha) * cross_entropy


# --------------------------------------------------------------------------- speculative decoding
def accept64(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
             uniforms: torch.Tensor, *, ratio_reversed: bool = False, prefix: bool = True,
             ignore_uniforms: bool = False, comparison_reversed: bool = False, residual: str = "normalised",
             bonus_row: int | None = None) -> tuple[int, torch.Tensor]:
    """Speculative sampling's rule given its uniform draws: (guesses kept, the distribution of the round's last token).

    Guess i is kept while uniforms[i] < min(1, p_i(x_i) / q_i(x_i)); at the first rejection the token comes
    from normalise(max(0, p_i - q_i)), after k kept guesses from p_{k+1} (row k). In float64. Each usual
    mistake a switch: ``ratio_reversed`` (q / p); ``prefix`` False (every guess that passes counts, even after
    a rejection); ``ignore_uniforms`` (kept when p >= q); ``comparison_reversed`` (kept when u >= the ratio);
    ``residual`` "unnormalised", "reversed" (q - p), "target" (p_i itself); ``bonus_row`` (another row).
    """
    p, q = target_probs.double(), draft_probs.double()
    k = draft_tokens.size(0)
    rows = torch.arange(k)
    p_x, q_x = p[rows, draft_tokens], q[rows, draft_tokens]  # (k,)
    top, bottom = (q_x, p_x) if ratio_reversed else (p_x, q_x)
    ratio = torch.where(bottom > 0, top / torch.where(bottom > 0, bottom, 1.0), 1.0).clamp(max=1.0)  # (k,)
    if ignore_uniforms:
        kept = p_x >= q_x
    elif comparison_reversed:
        kept = uniforms.double() >= ratio
    else:
        kept = uniforms.double() < ratio
    rejected = (~kept).nonzero()
    n = int(kept.sum()) if not prefix else int(rejected[0, 0]) if len(rejected) else k
    if n >= k:
        return n, p[k if bonus_row is None else bonus_row]
    difference = {"reversed": q[n] - p[n], "target": p[n]}.get(residual, p[n] - q[n]).clamp(min=0.0)  # (V,)
    if residual in ("unnormalised", "target"):
        return n, difference
    total = difference.sum()
    return n, difference / total if total > 0 else p[n]
