"""Chapter 7's exercises: deployment, checked against ``llmscratch.model.quantize``, ``prune``, ``distill``,
``speculative``.

Write it yourself: int8 weights with one scale per row, two int4 values packed in a byte and unpacked with
their group scales, magnitude-pruning masks (per matrix or global), the distillation loss with its
temperature, the tokens a round of speculative decoding yields, and the accept/reject rule given its uniform
draws. Extend the package: 2:4 sparsity on a GPT's linear layers, and a linear layer whose activations are
quantized to int8 beside its weights, the products summed in integers.
"""

import functools
import math

import torch

from llmscratch.deployment.distill import distillation_loss
from llmscratch.deployment.prune import block_linears
from llmscratch.deployment.speculative import acceptance_probability, expected_tokens_per_round, residual_distribution
from llmscratch.exercises.ch07_references import (accept64, dequantize_int4_64, distill64, distill_by_distributions,
                                                  int8_scales64, int8_values, keep_masks, pack_int4_64, two_four_mask,
                                                  w8a8_linear64)
from llmscratch.exercises.checking import (Chapter, Mismatch, attempt, describe, diagnose, diagnose_nonfinite,
                                           expect_close, expect_equal, fresh_generator, number_of, random_bool,
                                           random_float, random_int, random_seed)
from llmscratch.exercises.fixtures import tiny_gpt
from llmscratch.model.losses import IGNORE_INDEX
from llmscratch.model.quantize import dequantize_int4, pack_int4, quantize_int8

CHAPTER = Chapter("ch07", "Deployment: quantization, pruning, distillation and speculative decoding")
# the sections of deployment.ipynb the exercises follow
QUANTIZATION, OUTLIERS = "1.2 int8: one scale per row", "1.3 Outliers: why one scale per row"
GROUPS, PRUNING = "1.4 int4: groups, two values a byte", "2.1 Magnitude pruning"
DISTILLATION, RULE, COST = "3.1 The distillation loss", "4.2 The accept/reject rule", "4.3 The cost model"


def _shown(tensor: torch.Tensor) -> str:
    """A small tensor's values in full (floats to 4 significant digits), a larger one as ``describe`` shows it."""
    if tensor.numel() > 16:
        return describe(tensor)

    def text(value):
        if isinstance(value, list):
            return [text(v) for v in value]
        return f"{value:.4g}" if isinstance(value, float) else str(value)
    return str(text(tensor.tolist())).replace("'", "")


def _pair(got, case: str, what: str) -> tuple:
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise Mismatch(case, what, describe(got), f"return the two results: {what}")
    return tuple(got)


def _away_from_halves(values: torch.Tensor, levels: int) -> torch.Tensor:
    """values (..., n) with every |v| / (its row's max |v| / levels) at least 0.05 from a half-level.

    Then no way of writing round(v / scale) (a division, or a product with levels / max) can land on the
    other side of a tie, and every right answer rounds each value alike.
    """
    v = values.double()
    scales = v.abs().amax(-1, keepdim=True).clamp(min=1e-300) / levels
    ratio = v / scales
    near = ((ratio.abs() - ratio.abs().floor()) - 0.5).abs() < 0.05
    safe = (ratio.abs().floor() + 0.25) * ratio.sign() * scales
    return torch.where(near, safe, v).to(values.dtype)


def _rows(shape: tuple, generator: torch.Generator) -> torch.Tensor:
    """A random float32 matrix whose rows differ in size (each from about 1e-3 to 10), clear of rounding ties."""
    sizes = 10 ** (torch.rand(shape[0], 1, generator=generator) * 4 - 3)  # (out, 1)
    return _away_from_halves(torch.randn(shape, generator=generator) * sizes, 127)


# --------------------------------------------------------------------------- write it yourself: quantization
ZERO_ROW_HINT = ("a row of zeros needs a positive scale (clamp the scale to at least torch.finfo(torch.float32).tiny): "
                 "a zero scale makes w / scale = 0 / 0 = NaN, whose int8 is undefined")
ZERO_TOKEN_HINT = ("a token of zeros needs a positive scale (clamp max |x| to at least torch.finfo(torch.float32).tiny): "
                   "a zero scale makes x / scale = 0 / 0 = NaN, whose integer is undefined, right here only by "
                   "accident")
FLOOR_HINT = ("a fixed floor such as 1e-8 flattens a row of tiny weights to zeros: clamp to "
              "torch.finfo(torch.float32).tiny, the smallest normal float32, so a row of tiny weights keeps its own scale")


def _floored(expected: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """The scales with the floor that ``got`` gives the tiniest row (a fixed floor's mistake), if that floor is small."""
    floor = float(got.detach().double()[expected.argmin()])
    if not 0 < floor <= 1e-4:
        raise ValueError(f"{floor} is no small fixed floor")  # diagnose: no match
    return expected.double().clamp(min=floor)


@CHAPTER.exercise("quantize_rows_int8", title="int8 weights: one scale per row", difficulty="warm-up",
                  section=QUANTIZATION, kind="write it yourself",
                  forbidden=("llmscratch.model.quantize.quantize_int8",))
def check_quantize_rows_int8(answer) -> int:
    generator, fresh = torch.Generator().manual_seed(1), fresh_generator()
    cases = [[[1.0]], [[0.7, -1.0, -0.2]], [[-2.0, 0.9, 0.3], [0.1, 0.3, -0.05]], [[0.0, 0.0, 0.0], [1.5, -0.4, 0.8]],
             [[3e-30, -1e-30, 2e-30]]]
    cases = [torch.tensor(weight) for weight in cases]
    cases += [_rows(shape, generator) for shape in ((4, 6), (8, 8), (16, 32))]
    cases += [_rows((random_int(fresh, 1, 8), random_int(fresh, 1, 16)), fresh) for _ in range(2)]  # no table holds
    for weight in cases:
        case = f"weight {_shown(weight)}"
        q, scales = _pair(attempt(answer, weight.clone(), case=case, nonfinite_cast=ZERO_ROW_HINT), case,
                          "(q, scales)")
        expected_q, expected_scales = quantize_int8(weight)
        zero_rows = weight.abs().amax(dim=1) == 0  # (out,)
        if zero_rows.any() and isinstance(scales, torch.Tensor) and scales.shape == expected_scales.shape:
            given = scales.detach().double()[zero_rows]
            if not (given.isfinite() & (given > 0)).all():
                raise Mismatch(f"{case}: the scale of the row of zeros", "a positive scale", describe(scales),
                               ZERO_ROW_HINT)
            expected_scales = torch.where(zero_rows, scales.detach().float(), expected_scales)  # any positive one
        hint = diagnose(scales, {
            "the scale comes from the row's largest |w|, not its mean: with the mean the larger weights overflow "
            "and are clipped at +-127": lambda: int8_scales64(weight, reduce="mean"),
            "one scale per row (per output channel), not one for the whole matrix: a row of small weights would "
            "get only a few of the 255 levels": lambda: int8_scales64(weight, reduce="tensor"),
            "one scale per row (the largest |w| over dim=1, the inputs), not per column":
                lambda: int8_scales64(weight, dim=0),
            "the largest |w|, not the largest w: a negative outlier must map to -127 and fit":
                lambda: int8_scales64(weight, reduce="signed"),
            "divide by 127, not 128: the scheme is symmetric, -127 .. 127, and 128 does not fit in an int8":
                lambda: int8_scales64(weight, levels=128),
            "divide by 127, not 255: symmetric int8 has 127 levels on each side of 0":
                lambda: int8_scales64(weight, levels=255),
            "the scale is the step between two levels: the largest |w| divided by 127":
                lambda: int8_scales64(weight, levels=1),
            FLOOR_HINT: lambda: _floored(expected_scales, scales),
        }, "scales[i] = max |weight[i]| / 127, one per row (a row of zeros: any positive scale)", atol=0.0)
        expect_close(scales, expected_scales, case=f"{case}: the scales", hint=hint, atol=0.0, rtol=1e-5,
                     dtype=torch.float32)
        if not (isinstance(q, torch.Tensor) and q.dtype == torch.int8):
            raise Mismatch(f"{case}: q", "an int8 tensor", describe(q) + (f" of dtype {q.dtype}" if isinstance(
                q, torch.Tensor) else ""), "return q as int8 (.to(torch.int8)): one byte per weight is the point")
        hint = diagnose(q, {
            "round to the nearest level: .to(torch.int8) alone truncates towards zero (88.9 -> 88)":
                lambda: int8_values(weight, expected_scales, rounding="trunc"),
            "round to the nearest level, not down: floor sends -25.4 to -26":
                lambda: int8_values(weight, expected_scales, rounding="floor"),
        }, "q = round(weight / scales[:, None]), clamped to [-127, 127]")
        expect_equal(q, expected_q, case=f"{case}: q", hint=hint)
    return len(cases)


@CHAPTER.exercise("pack_int4_pairs", title="Two int4 values a byte", difficulty="warm-up", section=GROUPS,
                  kind="write it yourself",
                  forbidden=("llmscratch.model.quantize.pack_int4", "llmscratch.model.quantize.quantize_int4"))
def check_pack_int4_pairs(answer) -> int:
    generator, fresh = torch.Generator().manual_seed(2), fresh_generator()
    cases = [[[-7, 7]], [[0, 0]], [[1, -1, 3, -3]], [list(range(-7, 8)) + [0]], [[-7, 7], [2, -2]]]
    cases = [torch.tensor(values, dtype=torch.int8) for values in cases]
    shapes = [(3, 8), (8, 16)] + [(random_int(fresh, 1, 6), 2 * random_int(fresh, 1, 8)) for _ in range(2)]
    cases += [torch.randint(-7, 8, shape, generator=generator if i < 2 else fresh, dtype=torch.int8)
              for i, shape in enumerate(shapes)]
    for q in cases:
        case = f"q {_shown(q)}"
        got = attempt(answer, q.clone(), case=case)
        hint = diagnose(got, {
            "column 2j goes in the low four bits, column 2j + 1 in the high four: yours are swapped":
                lambda: pack_int4_64(q, swapped=True),
            "store q + 8 (1 .. 15): a negative q taken to uint8 wraps around to 256 + q, and its high bits spill "
            "into its neighbour's nibble": lambda: pack_int4_64(q, offset=0),
            "add 8, not 7: the package stores q + 8 (and its unpacking subtracts 8)": lambda: pack_int4_64(q, offset=7),
            "pair neighbouring columns 2j and 2j + 1 of a row, not column j with column j + in / 2":
                lambda: pack_int4_64(q, layout="halves"),
        }, "byte j of a row holds q[2j] + 8 in its low four bits and q[2j + 1] + 8 in its high four: (out, in / 2), "
           "uint8")
        expect_equal(got, pack_int4(q), case=case, hint=hint)
    return len(cases)


@CHAPTER.exercise("dequantize_int4_groups", title="Packed int4 and group scales back to floats", difficulty="medium",
                  section=GROUPS, kind="write it yourself",
                  forbidden=("llmscratch.model.quantize.unpack_int4", "llmscratch.model.quantize.dequantize_int4"))
def check_dequantize_int4_groups(answer) -> int:
    generator, fresh = torch.Generator().manual_seed(3), fresh_generator()
    cases = [(torch.tensor([[-7, 3]]), torch.tensor([[0.5]])),
             (torch.tensor([[1, -1, 5, -5]]), torch.tensor([[0.1, 2.0]]))]  # (values, group scales)
    shapes = [(2, 8, 4, generator), (3, 8, 2, generator), (4, 16, 8, generator), (2, 32, 8, generator)]
    for _ in range(2):  # and cases no table of the fixed ones holds
        in_features = 2 * random_int(fresh, 1, 8)
        sizes = [g for g in range(2, in_features + 1, 2) if in_features % g == 0]  # the possible group sizes
        shapes.append((random_int(fresh, 1, 4), in_features, sizes[random_int(fresh, 0, len(sizes) - 1)], fresh))
    for out_features, in_features, group_size, source in shapes:  # (out, in, group_size, where drawn from)
        q = torch.randint(-7, 8, (out_features, in_features), generator=source)
        scales = 10 ** (torch.rand(out_features, in_features // group_size, generator=source) * 2 - 2)  # 0.01 .. 1
        cases.append((q, scales))
    for q, scales in cases:
        packed = pack_int4(q.to(torch.int8))
        case = (f"packed {_shown(packed)}, scales {_shown(scales)} (group_size {q.size(1) // scales.size(1)}; "
                f"the values {_shown(q)})")
        got = attempt(answer, packed.clone(), scales.clone(), case=case)
        hint = diagnose(got, {
            "the low four bits hold column 2j, the high four column 2j + 1: yours are swapped":
                lambda: dequantize_int4_64(packed, scales, swapped=True),
            "the bytes store q + 8: subtract 8 from each nibble (0 .. 15) to get q back":
                lambda: dequantize_int4_64(packed, scales, offset=0),
            "a nibble is q + 8, not q in two's complement: subtract 8 from each, whatever its top bit":
                lambda: dequantize_int4_64(packed, scales, signed_nibbles=True),
            "scales.repeat(1, g) lays the groups' scales in turn (s0, s1, s0, s1, ...); each group's scale must "
            "cover group_size neighbouring columns: repeat_interleave": lambda: dequantize_int4_64(
                packed, scales, tiled=True),
            "each group of group_size inputs has its own scale, not the row's first":
                lambda: dequantize_int4_64(packed, scales, one_scale=True),
            "multiply the values by their scale, do not divide": lambda: dequantize_int4_64(packed, 1 / scales),
        }, "weight[i, c] = (nibble c of row i - 8) * scales[i, c // group_size], group_size = in / scales.size(1)",
            atol=1e-6)
        expect_close(got, dequantize_int4(packed, scales), case=case, hint=hint, atol=1e-6, rtol=1e-6,
                     dtype=torch.float32)
    return len(cases)


# --------------------------------------------------------------------------- write it yourself: pruning
def _tied_matrices(generator: torch.Generator) -> list[torch.Tensor]:
    """One to three small random matrices rounded to one decimal: ties and zeros aplenty."""
    return [torch.round(torch.randn(random_int(generator, 1, 5), random_int(generator, 1, 6), generator=generator)
                        * 10) / 10 for _ in range(random_int(generator, 1, 3))]


def _sparsity(generator: torch.Generator, weights: list[torch.Tensor]) -> float:
    """A sparsity whose count, sparsity * n, is no half: round() and int(x + 0.5) then agree."""
    sparsity = random_float(generator, 0.0, 1.0)
    sizes = [w.numel() for w in weights] + [sum(w.numel() for w in weights)]
    while any(abs(sparsity * n - math.floor(sparsity * n) - 0.5) < 1e-6 for n in sizes):
        sparsity = round(sparsity + 0.01, 2) if sparsity < 0.99 else 0.37
    return sparsity


def _masks_valid(masks: list[torch.Tensor], weights: list[torch.Tensor], sparsity: float, scope: str) -> bool:
    """Whether the masks prune round(sparsity * n) weights of each group, none larger than one kept: ties aside,
    the same weights as the package's."""
    groups = [[i] for i in range(len(weights))] if scope == "layer" else [list(range(len(weights)))]
    for group in groups:
        magnitudes = torch.cat([weights[i].abs().flatten() for i in group])  # (n,)
        kept = torch.cat([masks[i].flatten() for i in group])  # (n,)
        if int((~kept).sum()) != round(sparsity * magnitudes.numel()):
            return False
        if kept.any() and (~kept).any() and magnitudes[~kept].max() > magnitudes[kept].min():
            return False
    return True


@CHAPTER.exercise("magnitude_masks", title="Magnitude pruning: which weights stay", difficulty="medium",
                  section=PRUNING, kind="write it yourself", forbidden=("llmscratch.deployment.prune.magnitude_prune",))
def check_magnitude_masks(answer) -> int:
    generator, fresh = torch.Generator().manual_seed(4), fresh_generator()
    square, mixed = [[1.0, -3.0], [2.0, -0.5]], [[[4.0, -1.0], [0.5, 2.0]], [[0.1, 0.2, 0.3]]]
    cases = [([[[0.5, -0.5, 0.1, 0.5]]], 0.5, "layer"), ([square], 0.0, "layer"), ([square], 1.0, "layer"),
             ([square], 0.5, "layer"), ([[[0.1, -2.0, 0.2], [1.0, 0.3, -0.4]]], 0.45, "layer"),
             (mixed, 0.6, "layer"), (mixed, 0.6, "global")]
    cases = [([torch.tensor(w) for w in weights], sparsity, scope) for weights, sparsity, scope in cases]
    for source, scope in [(generator, "layer"), (generator, "global"), (generator, "global"), (fresh, None),
                          (fresh, None)]:
        weights = _tied_matrices(source)
        scope = scope or ("global" if random_bool(fresh) else "layer")
        cases.append((weights, _sparsity(source, weights), scope))
    for weights, sparsity, scope in cases:
        case = f"weights [{', '.join(_shown(w) for w in weights)}], sparsity={sparsity}, scope={scope!r}"
        got = attempt(answer, [w.clone() for w in weights], sparsity, scope, case=case)
        if not (isinstance(got, (list, tuple)) and len(got) == len(weights) and all(
                isinstance(m, torch.Tensor) and m.shape == w.shape for m, w in zip(got, weights))):
            raise Mismatch(case, f"a list of {len(weights)} masks, each its matrix's shape", describe(got),
                           "return one mask per matrix, of the matrix's shape, True where the weight stays")
        if any(m.dtype != torch.bool for m in got):
            raise Mismatch(case, "bool masks", f"masks of dtype {[m.dtype for m in got]}",
                           "return bool masks, True where the weight stays (a comparison gives one)")
        if _masks_valid(list(got), weights, sparsity, scope):
            continue  # the package's masks, or as good: equal magnitudes kept otherwise
        flat = torch.cat([m.flatten() for m in got])  # (n,) matrix after matrix
        slips = {
            "prune the smallest |w|, not the largest": dict(largest=True),
            "rank the weights by magnitude |w|, not by value: a large negative weight matters as much as a large "
            "positive one": dict(signed=True),
            "scope 'global' ranks all the matrices together: one count, round(sparsity * all their weights), so a "
            "matrix of small weights loses more than its share": dict(scope="layer"),
            "scope 'layer' prunes each matrix on its own: round(sparsity * its weights) of each":
                dict(scope="global"),
            "prune a share of each matrix, not of each row": dict(per_row=True),
            "a threshold (|w| <= the k-th smallest) prunes every weight tied with it too: prune exactly "
            "round(sparsity * n), of equal magnitudes the earlier first": dict(threshold=True),
            "the count is round(sparsity * n): int() truncates (2.7 -> 2)": dict(count=int),
        }
        hint = diagnose(flat, {hint: lambda slip=slip: torch.cat([m.flatten() for m in keep_masks(
            weights, sparsity, **{"scope": scope, **slip})]) for hint, slip in slips.items()} | {
            "True marks the weights that stay, False the pruned ones": lambda: ~torch.cat(
                [m.flatten() for m in keep_masks(weights, sparsity, scope)])},
            "prune the round(sparsity * n) smallest |w| of each matrix ('layer') or of all together ('global')")
        expected = torch.cat([m.flatten() for m in keep_masks(weights, sparsity, scope)])
        expect_equal(flat, expected, case=f"{case} (the masks flattened, matrix after matrix)", hint=hint)
    return len(cases)


# --------------------------------------------------------------------------- write it yourself: distillation
KL_INF_HINT = ("your loss is inf for large logits: where a probability of the student underflows to 0, "
               "torch.distributions.kl_divergence (as log(softmax(x)) would) makes p * log(p / q) infinite; take "
               "log-probabilities with F.log_softmax and write the KL as p * (log p - log q), which stays finite")
DISTILL_NONFINITE = ("your loss has inf or NaN: log(softmax(x)) is log(0) = -inf where a probability underflows; "
                     "take log-probabilities with F.log_softmax and write the KL as p * (log p - log q)")


@CHAPTER.exercise("distill_loss", title="The distillation loss, with a temperature", difficulty="medium",
                  section=DISTILLATION, kind="write it yourself",
                  forbidden=("llmscratch.deployment.distill.distillation_loss", "torch.nn.functional.kl_div"))
def check_distill_loss(answer) -> int:
    generator, fresh = torch.Generator().manual_seed(5), fresh_generator()
    cases = [((1, 1, 2), 1.0, 1.0, 1.0, ""), ((2, 3, 5), 1.0, 2.0, 1.0, "identical logits"),
             ((2, 3, 5), 1.0, 2.0, 0.7, "ignored targets"), ((1, 4, 7), 3.0, 4.0, 1.0, ""),
             ((2, 2, 3), 1.0, 2.0, 0.0, ""), ((5, 6), 1.0, 0.5, 0.3, "ignored targets"),
             ((2, 4, 6), 100.0, 1.0, 0.5, "large logits")]  # (shape, logit scale, temperature, alpha, note)
    cases = [(*case, generator) for case in cases]
    cases += [((random_int(fresh, 1, 3), random_int(fresh, 1, 4), random_int(fresh, 2, 9)), 3.0,
               random_float(fresh, 0.5, 4.0, 1), random_float(fresh, 0.0, 1.0), "ignored targets", fresh)
              for _ in range(2)]
    for shape, scale, temperature, alpha, note, source in cases:
        student = scale * torch.randn(shape, generator=source)
        teacher = student.clone() if note == "identical logits" else scale * torch.randn(shape, generator=source)
        targets = torch.randint(shape[-1], shape[:-1], generator=source)
        if note == "ignored targets":
            targets[torch.rand(shape[:-1], generator=source) < 0.4] = IGNORE_INDEX
            targets.view(-1)[0] = IGNORE_INDEX  # one target at least is ignored,
            targets.view(-1)[-1] = shape[-1] - 1  # and one counts
        case = (f"student_logits {_shown(student)}, teacher_logits {_shown(teacher)}, targets {targets.tolist()}, "
                f"temperature={temperature}, alpha={alpha}" + (f" ({note})" if note else ""))
        leaf = student.clone().requires_grad_(True)
        got = attempt(answer, leaf * 1.0, teacher.clone(), targets.clone(), temperature, alpha, case=case)
        slip = functools.partial(distill64, student, teacher, targets, temperature, alpha)  # one slip a keyword
        hint = diagnose_nonfinite(got, {
            "multiply the KL by T^2: its gradient shrinks as 1 / T^2, and the factor keeps it on the "
            "cross-entropy's scale": lambda: slip(power=0),
            "multiply the KL by T^2, not T": lambda: slip(power=1),
            "the KL runs from the teacher to the student, KL(p_teacher || q_student) = sum p (log p - log q): "
            "yours is reversed": lambda: slip(reverse=True),
            "soften the teacher too: softmax(teacher_logits / T)": lambda: slip(soft_teacher=False),
            "soften the student too: log_softmax(student_logits / T)": lambda: slip(soft_student=False),
            "average the KL over the counted tokens only (targets != -100), as the cross-entropy is":
                lambda: slip(all_positions=True),
            "sum the KL over the vocabulary, then average over the tokens: .mean() over the last dimension "
            "divides by V too": lambda: slip(vocab_mean=True),
            "alpha weighs the teacher's KL term, 1 - alpha the cross-entropy: yours are swapped":
                lambda: slip(swapped=True),
            "the cross-entropy against the targets is not softened: F.cross_entropy(student_logits, targets)":
                lambda: slip(soft_cross_entropy=True),
            "the mean over the counted tokens, not their sum": lambda: slip(summed=True),
            KL_INF_HINT: lambda: distill_by_distributions(student, teacher, targets, temperature, alpha),
        }, "alpha * T^2 * mean over counted tokens of KL(softmax(teacher / T) || softmax(student / T)) "
           "+ (1 - alpha) * cross-entropy(student_logits, targets)", hint=DISTILL_NONFINITE)
        expected_leaf = student.clone().requires_grad_(True)
        expected = distillation_loss(expected_leaf, teacher, targets, temperature, alpha)
        expect_close(got, expected.detach(), case=case, hint=hint, atol=1e-5, rtol=1e-4)
        grad_case = f"{case}: the gradient with respect to student_logits"
        if not got.requires_grad:
            raise Mismatch(grad_case, "a loss that backward() can differentiate", "a tensor without grad_fn",
                           "compute the loss with torch operations on student_logits (no .item(), no .detach(), no "
                           "torch.no_grad()): the student learns through it")
        got_grad = attempt(torch.autograd.grad, got, leaf, case=grad_case)[0]
        expected_grad = torch.autograd.grad(expected, expected_leaf)[0]
        expect_close(got_grad, expected_grad, case=grad_case, atol=1e-6, rtol=1e-4,
                     hint="both terms must reach the student's logits: no .detach() on the student's side (the "
                          "teacher's may be detached)")
    return len(cases)


# --------------------------------------------------------------------------- write it yourself: speculative decoding


@CHAPTER.exercise("tokens_per_round", title="Tokens a round of speculative decoding yields", difficulty="warm-up",
                  section=COST, kind="write it yourself",
                  forbidden=("llmscratch.deployment.speculative.expected_tokens_per_round",
                             "llmscratch.deployment.speculative.predicted_speedup"))
def check_tokens_per_round(answer) -> int:
    fresh = fresh_generator()
    cases = [(0.0, 1), (1.0, 4), (0.5, 1), (0.8, 4), (0.3, 10), (0.999999, 3), (1.0, 1)]  # (acceptance, k)
    cases += [(random_float(fresh, 0.0, 0.99), random_int(fresh, 1, 10)) for _ in range(3)]
    for acceptance, k in cases:
        case = f"tokens_per_round({acceptance}, k={k})"
        got = number_of(attempt(answer, acceptance, k, case=case, errors={
            "ZeroDivisionError": "at acceptance 1 every guess is kept and the round yields k + 1 tokens: the sum "
                                 "1 + a + ... + a^k has no division"}), case, "a number")
        a = acceptance
        hint = diagnose(torch.tensor(got, dtype=torch.float64), {
            "the target adds one token of its own each round, after the kept guesses: the sum runs to a^k, "
            "k + 1 terms": lambda: torch.tensor(sum(a**i for i in range(k)), dtype=torch.float64),
            "a guess counts only if every guess before it was kept: guess i has probability a^i, not a":
                lambda: torch.tensor(1 + k * a, dtype=torch.float64),
            "a round stops after k guesses: the series ends at a^k, it is not 1 / (1 - a)":
                lambda: torch.tensor(1 / (1 - a) if a < 1 else math.inf, dtype=torch.float64),
        }, "1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a), and k + 1 at a = 1", atol=1e-9)
        expect_close(got, expected_tokens_per_round(acceptance, k), case=case, hint=hint, atol=1e-9, rtol=1e-7)
    return len(cases)


def _distributions(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """rows random next-token distributions (rows, vocab), some peaked, some flat."""
    sharpness = torch.rand(rows, 1, generator=generator) * 3  # (rows, 1)
    return torch.softmax(torch.randn(rows, vocab, generator=generator) * sharpness, dim=-1)


def _round(k: int, vocab: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A random round: p (k+1, V), q (k, V) near p, guesses drawn from q, uniforms clear of each threshold."""
    target = _distributions(k + 1, vocab, generator)
    draft = 0.5 * target[:k] + 0.5 * _distributions(k, vocab, generator)  # a draft that agrees half the time
    tokens = torch.multinomial(draft, 1, generator=generator).squeeze(1)  # (k,) drawn from q
    uniforms = torch.rand(k, generator=generator)  # (k,)
    rows = torch.arange(k)
    ratio = acceptance_probability(target[rows, tokens], draft[rows, tokens])  # (k,)
    near = (uniforms - ratio).abs() < 1e-3  # u == ratio is a tie that u < ratio and u <= ratio decide apart
    uniforms = torch.where(near, torch.where(ratio < 0.5, ratio + 0.005, ratio - 0.005), uniforms)
    return target, draft, tokens, uniforms


def _count(got, case: str) -> int:
    if isinstance(got, torch.Tensor) and got.numel() == 1 and not (got.is_floating_point() or got.dtype == torch.bool):
        return int(got.item())
    if isinstance(got, int) and not isinstance(got, bool):
        return got
    raise Mismatch(case, "an int, the number of guesses kept", describe(got),
                   "return n as an int (or a one-element integer tensor)")


@CHAPTER.exercise("speculative_accept", title="Speculative sampling's accept/reject rule, given its draws",
                  difficulty="hard", section=RULE, kind="write it yourself",
                  forbidden=("llmscratch.deployment.speculative.accept_draft",
                             "llmscratch.deployment.speculative.residual_distribution",
                             "llmscratch.deployment.speculative.acceptance_probability"))
def check_speculative_accept(answer) -> int:
    generator, fresh = torch.Generator().manual_seed(7), fresh_generator()
    t = torch.tensor
    cases = [  # (p (k+1, V), q (k, V), guesses (k,), uniforms (k,), note)
        (t([[0.2, 0.5, 0.3], [0.6, 0.3, 0.1]]), t([[0.2, 0.5, 0.3]]), t([1]), t([0.7]), "p = q: kept"),
        (t([[0.0, 0.5, 0.5], [0.6, 0.3, 0.1]]), t([[0.5, 0.25, 0.25]]), t([0]), t([0.3]), "p(x) = 0: rejected"),
        (t([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]]),
         t([[0.3, 0.3, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25], [0.3, 0.2, 0.2, 0.3]]), t([0, 0, 1]), t([0.9, 0.6, 0.1]),
         "the second guess rejected, the third would pass"),
        (t([[0.5, 0.5, 0.0], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]]), t([[0.25, 0.75, 0.0], [0.2, 0.6, 0.2]]), t([1, 1]),
         t([0.5, 0.95]), "both kept"),
    ]
    cases += [(*_round(k, vocab, generator), "") for k, vocab in ((1, 5), (3, 6), (4, 8), (5, 12))]
    cases += [(*_round(random_int(fresh, 1, 5), random_int(fresh, 2, 12), fresh), "") for _ in range(2)]
    for target, draft, tokens, uniforms, note in cases:
        case = (f"target_probs {_shown(target)}, draft_probs {_shown(draft)}, draft_tokens {tokens.tolist()}, "
                f"uniforms {_shown(uniforms)}" + (f" ({note})" if note else ""))
        got = attempt(answer, target.clone(), draft.clone(), tokens.clone(), uniforms.clone(), case=case)
        n_got, distribution = _pair(got, case, "(n, next_probs)")
        n_got = _count(n_got, f"{case}: n")
        k = tokens.size(0)
        rows = torch.arange(k)
        kept = uniforms < acceptance_probability(target[rows, tokens], draft[rows, tokens])  # (k,)
        n = int((~kept).nonzero()[0, 0]) if (~kept).any() else k
        slip = functools.partial(accept64, target, draft, tokens, uniforms)  # one slip a keyword
        hint = diagnose(n_got, {
            "keep guess i with probability min(1, p(x) / q(x)), target over draft: yours is q / p":
                lambda: slip(ratio_reversed=True)[0],
            "stop at the first rejected guess: the guesses after it were drafted from a context the round no "
            "longer has": lambda: slip(prefix=False)[0],
            "draw on the uniforms: a guess with p(x) < q(x) is still kept with probability p(x) / q(x)":
                lambda: slip(ignore_uniforms=True)[0],
            "guess i is kept when uniforms[i] < min(1, p / q), not >=": lambda: slip(comparison_reversed=True)[0],
        }, "n = the guesses kept before the first i with uniforms[i] >= min(1, p_i(x_i) / q_i(x_i))")
        expect_equal(n_got, n, case=f"{case}: n", hint=hint)
        expected = residual_distribution(target[n], draft[n]) if n < k else target[k]  # (V,)
        hint = diagnose_nonfinite(distribution, {
            "normalise the residual max(0, p - q) to sum to 1": lambda: slip(residual="unnormalised")[1],
            "the residual is max(0, p - q), the mass the target has beyond the draft, not q - p":
                lambda: slip(residual="reversed")[1],
            "after a rejection, draw from normalise(max(0, p_i - q_i)), not from p_i: p_i would count again the "
            "tokens the draft already proposes often enough": lambda: slip(residual="target")[1],
            "after k kept guesses the bonus token comes from p_{k+1}, row k of target_probs (the row after the "
            "last guess)": lambda: slip(bonus_row=k - 1)[1],
        }, "next_probs: normalise(max(0, p_n - q_n)) after a rejection at guess n, target_probs[k] if every guess "
           "is kept", hint="clamp the negative differences to 0 before normalising: sum(p - q) is 0, since p and "
                           "q both sum to 1")
        expect_close(distribution, expected, case=f"{case}: next_probs", hint=hint, atol=1e-6, rtol=1e-5)
    return len(cases)


# --------------------------------------------------------------------------- extend the package
def _two_four_valid(got: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether got is weight with, in every four neighbouring inputs of a row, the two smallest |w| set to 0.

    Ties aside: what stays must be the group's two largest magnitudes, whichever of equal ones it keeps.
    """
    if not ((got == 0) | (got == weight)).all():
        return False  # a kept weight changed
    groups = weight.abs().reshape(weight.size(0), -1, 4)  # (out, in/4, 4)
    kept = got.abs().reshape(groups.shape).sort(dim=-1, descending=True).values  # (out, in/4, 4)
    largest = groups.sort(dim=-1, descending=True).values
    return bool((kept[..., :2] == largest[..., :2]).all() and (kept[..., 2:] == 0).all())


@CHAPTER.exercise("two_four_prune", title="2:4 sparsity on a GPT's linear layers", difficulty="medium",
                  section=PRUNING, kind="extend the package")
def check_two_four_prune(answer) -> int:
    fresh = fresh_generator()
    cases = [(False, 0, False), (True, 1, False), (False, 2, True), (True, 3, True)]  # (Llama-style?, seed, rounded?)
    cases += [(random_bool(fresh), random_seed(fresh), random_bool(fresh)) for _ in range(2)]
    for llama, seed, rounded in cases:
        model = tiny_gpt(llama, seed=seed)
        if rounded:
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.copy_(torch.round(parameter * 100) / 100)
        case = (f"tiny_gpt(llama={llama}, seed={seed})" + (", its weights rounded to 0.01 (ties and zeros)"
                                                           if rounded else ""))
        before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        pruned = attempt(answer, model, case=case)
        if not (isinstance(pruned, torch.nn.Module) and set(pruned.state_dict()) == set(before)):
            raise Mismatch(case, "a GPT with the same weights' names", describe(pruned),
                           "return a pruned copy of the model (copy.deepcopy(model), then zero its weights)")
        changed = [name for name, tensor in model.state_dict().items() if not torch.equal(tensor, before[name])]
        if changed:
            raise Mismatch(case, "the model as it was", f"{changed[0]} changed",
                           "prune a copy (copy.deepcopy(model)) and leave the original as it was, as magnitude_prune "
                           "does: the chapter compares the two")
        linears = {f"{name}.weight" for name, _ in block_linears(model)}
        state = pruned.state_dict()
        others = [name for name in before if name not in linears and not torch.equal(state[name], before[name])]
        if others:
            raise Mismatch(f"{case}: {others[0]}", "unchanged", "changed",
                           "prune only the weights of the blocks' linear layers (block_linears): not the biases, the "
                           "norms, the embedding or the output head tied to it")
        for name in sorted(linears, key=list(before).index):
            weight, got = before[name], state[name]
            if got.shape == weight.shape and _two_four_valid(got, weight):
                continue
            slips = {"group four neighbouring inputs of a row (along dim 1), not four rows": dict(along_rows=True),
                     "keep the two largest |w| of each group, prune the two smallest": dict(keep_smallest=True),
                     "a group is four neighbouring inputs (columns 4j .. 4j + 3), not every in/4-th one":
                         dict(strided=True),
                     "2:4 prunes two of every four: half of each group, not half of each row (a row's pruned "
                     "weights must be spread two per group for the hardware)": dict(per_row=True),
                     "rank by magnitude |w|, not by value: a large negative weight stays": dict(signed=True)}
            hint = diagnose(got, {hint: lambda slip=slip: weight * two_four_mask(weight, **slip)
                                  for hint, slip in slips.items()},
                            "in every group of four neighbouring inputs of a row, set the two smallest |w| to 0 and "
                            "keep the other two as they are")
            expect_equal(got, weight * two_four_mask(weight), case=f"{case}: {name}", hint=hint)
    return len(cases)


def _w8a8_case(batch: tuple, out_features: int, in_features: int, generator: torch.Generator):
    weight = torch.randn(out_features, in_features, generator=generator) * 0.2  # (out, in)
    q, scales = quantize_int8(weight)
    sizes = 10 ** (torch.rand(*batch, 1, generator=generator) * 2 - 1)  # (..., 1) tokens of sizes 0.1 .. 10
    x = _away_from_halves(torch.randn(*batch, in_features, generator=generator) * sizes, 127)
    return x, q, scales


@CHAPTER.exercise("w8a8_linear", title="int8 activations times int8 weights, summed in integers", difficulty="hard",
                  section=OUTLIERS, kind="extend the package")
def check_w8a8_linear(answer) -> int:
    generator, fresh = torch.Generator().manual_seed(9), fresh_generator()
    first_q, first_scales = quantize_int8(torch.tensor([[0.6, -1.0], [0.25, 0.75]]))
    cases = [(torch.tensor([[1.0, -0.3]]), first_q, first_scales),
             (torch.tensor([[0.0, 0.0], [0.2, -0.9]]), first_q, first_scales)]
    cases += [_w8a8_case(batch, out, inn, generator) for batch, out, inn in (((4,), 4, 16), ((2, 3), 5, 8),
                                                                             ((3,), 32, 64))]
    cases += [_w8a8_case(tuple(random_int(fresh, 1, 4) for _ in range(random_int(fresh, 1, 2))),
                         random_int(fresh, 1, 8), random_int(fresh, 1, 32), fresh) for _ in range(2)]
    for x, q, scales in cases:
        case = f"x {_shown(x)}, q {_shown(q)}, scales {_shown(scales)}"
        got = attempt(answer, x.clone(), q.clone(), scales.clone(), case=case, nonfinite_cast=ZERO_TOKEN_HINT)
        slip = functools.partial(w8a8_linear64, x, q, scales)  # one slip a keyword
        hint = diagnose(got, {
            "quantize the activations too, each token (row of x) to int8 with its own scale: that is what W8A8 "
            "adds to weight-only quantization": lambda: slip(quantized=False),
            "one scale per token (max |x| of its row / 127), not one for all of x: a token of small activations "
            "would keep only a few levels": lambda: slip(per_tensor=True),
            "an int8 matmul keeps its sums in int8, which wrap around past 127: take the values to int32 first "
            "(as integer kernels accumulate)": lambda: slip(int8_sums=True),
            "multiply the integer sums by both scales: the token's and the output row's":
                lambda: slip(x_scaled=False),
            "round the activations to the nearest level: .to(torch.int8) alone truncates towards zero":
                lambda: slip(rounding="trunc"),
            "the token scales go along the tokens (one per row of the result, shape (..., 1)), the weight scales "
            "along the outputs": lambda: slip(scales_across=True),
        }, "x_q = round(x / s_x) per token (s_x = max |x| / 127), sums = x_q @ q.T in integers, "
           "out = sums * s_x * scales", atol=1e-5)
        expect_close(got, w8a8_linear64(x, q, scales).float(), case=case, hint=hint, atol=1e-5, rtol=1e-5,
                     dtype=torch.float32)
    return len(cases)
