"""Chapter 7's exercise checks: the worked answers pass, plausible wrong answers fail with the right hint."""

import copy

import pytest
import torch
import torch.nn.functional as F
from exercise_suite import ExerciseSuite, solutions

from llmscratch.deployment.distill import distillation_loss
from llmscratch.deployment.prune import block_linears, magnitude_prune
from llmscratch.deployment.speculative import accept_draft, expected_tokens_per_round, residual_distribution
from llmscratch.exercises import ch07
from llmscratch.exercises.ch07_references import (accept64, dequantize_int4_64, distill64, int8_scales64, int8_values,
                                                  keep_masks, pack_int4_64, two_four_mask, w8a8_linear64)
from llmscratch.exercises.fixtures import tiny_gpt
from llmscratch.model.losses import IGNORE_INDEX
from llmscratch.model.quantize import dequantize_int4, pack_int4, quantize_int4, quantize_int8

sol = solutions(ch07)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def verdict(answer, name):
    return ch07.CHAPTER.check(answer, name, quiet=True)


# --------------------------------------------------------------------------- wrong answers
def int8_with(rounding="round", **scale_slip):
    """quantize_rows_int8 with one slip in the scales (int8_scales64's keywords) or in the rounding."""
    def answer(weight):
        scales = int8_scales64(weight, **scale_slip).float()
        return int8_values(weight, scales, rounding=rounding).to(torch.int8), scales
    return answer


def int8_unguarded(weight):
    """No floor on the scale: a row of zeros gets the scale 0 (and 0 / 0 for its values)."""
    scales = weight.abs().amax(dim=1) / 127
    return torch.round(weight / scales[:, None]).nan_to_num(0.0).clamp(-127, 127).to(torch.int8), scales


def int8_floored(floor, before_division=False):
    """A fixed floor on the scales (1e-8, float32's eps, ...): a row of tiny weights flattened to zeros."""
    def answer(weight):
        largest = weight.abs().amax(dim=1)
        scales = largest.clamp(min=floor) / 127 if before_division else (largest / 127).clamp(min=floor)
        return torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8), scales
    return answer


def int8_scales_as(dtype):
    def answer(weight):
        q, scales = sol.quantize_rows_int8(weight)
        return q, scales.to(dtype)
    return answer


def int8_by_default_argument(weight, quantize=quantize_int8):
    """The function the exercise takes away, bound as a default argument when the answer was defined."""
    return quantize(weight)


def int8_where_zero(weight):
    """Right, written differently: a row of zeros gets the scale 1, the others max |w| / 127, in float64 first."""
    largest = weight.double().abs().amax(dim=1)
    scales = torch.where(largest == 0, torch.ones_like(largest), largest / 127).float()
    return torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def int8_as_floats(weight):
    q, scales = sol.quantize_rows_int8(weight)
    return q.float(), scales


def packing_with(**slip):
    return lambda q: pack_int4_64(q, **slip)


def pack_as_int8(q):
    return sol.pack_int4_pairs(q).to(torch.int8)


def unpacking_with(**slip):
    return lambda packed, scales: dequantize_int4_64(packed, scales, **slip).float()


def masks_with(**slip):
    return lambda weights, sparsity, scope="layer": keep_masks(weights, sparsity, **{"scope": scope, **slip})


def masks_inverted(weights, sparsity, scope="layer"):
    return [~mask for mask in sol.magnitude_masks(weights, sparsity, scope)]


def masks_by_threshold(weights, sparsity, scope="layer"):
    """|w| <= the k-th smallest magnitude: right without ties, too many pruned with them."""
    groups = [[w] for w in weights] if scope == "layer" else [list(weights)]
    masks = []
    for group in groups:
        magnitudes = torch.cat([w.abs().flatten() for w in group])
        count = round(sparsity * magnitudes.numel())
        keep = magnitudes > (magnitudes.kthvalue(count).values if count else -1.0)
        masks += [part.view_as(w) for part, w in zip(keep.split([w.numel() for w in group]), group)]
    return masks


def distill_with(**slip):
    """distill_loss with one slip in its value; the gradient stays the worked answer's."""
    def answer(student_logits, teacher_logits, targets, temperature, alpha):
        right = sol.distill_loss(student_logits, teacher_logits, targets, temperature, alpha)
        wrong = distill64(student_logits, teacher_logits, targets, temperature, alpha, **slip).float()
        return right + (wrong - right.detach())
    return answer


def distill_naive(student_logits, teacher_logits, targets, temperature, alpha):
    """log(softmax(x)): right until a probability underflows to 0."""
    vocab = student_logits.size(-1)
    q = torch.softmax(student_logits.reshape(-1, vocab) / temperature, dim=-1)
    p = torch.softmax(teacher_logits.reshape(-1, vocab) / temperature, dim=-1)
    kl = (p * (p.log() - q.log())).sum(-1)[targets.reshape(-1) != IGNORE_INDEX].mean()
    hard = F.cross_entropy(student_logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    return alpha * temperature**2 * kl + (1 - alpha) * hard


def distill_by_distributions(student_logits, teacher_logits, targets, temperature, alpha, probs=False):
    """The KL of torch.distributions: inf where the student's probability underflows (large logits)."""
    vocab = student_logits.size(-1)
    student, teacher = student_logits.reshape(-1, vocab) / temperature, teacher_logits.reshape(-1, vocab) / temperature
    if probs:
        p, q = (torch.distributions.Categorical(probs=z.softmax(-1)) for z in (teacher, student))
    else:
        p, q = torch.distributions.Categorical(logits=teacher), torch.distributions.Categorical(logits=student)
    counted = targets.reshape(-1) != IGNORE_INDEX
    kl = torch.distributions.kl_divergence(p, q)[counted].sum() / counted.sum()
    hard = F.cross_entropy(student_logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    return alpha * temperature**2 * kl + (1 - alpha) * hard


def distill_by_logsumexp(student_logits, teacher_logits, targets, temperature, alpha):
    """Right, written differently: log-probabilities as z - logsumexp(z), the KL summed per token then averaged."""
    vocab = student_logits.size(-1)
    student, teacher = student_logits.reshape(-1, vocab) / temperature, teacher_logits.reshape(-1, vocab) / temperature
    log_q = student - student.logsumexp(-1, keepdim=True)
    log_p = teacher - teacher.logsumexp(-1, keepdim=True)
    counted = targets.reshape(-1) != IGNORE_INDEX
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)[counted].mean()
    hard = F.cross_entropy(student_logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    return alpha * temperature**2 * kl + (1 - alpha) * hard


def distill_student_detached(student_logits, teacher_logits, targets, temperature, alpha):
    return sol.distill_loss(student_logits.detach(), teacher_logits, targets, temperature, alpha) + 0 * (
        F.cross_entropy(student_logits.reshape(-1, student_logits.size(-1)), targets.reshape(-1),
                        ignore_index=IGNORE_INDEX))


def distill_item(student_logits, teacher_logits, targets, temperature, alpha):
    return torch.tensor(sol.distill_loss(student_logits, teacher_logits, targets, temperature, alpha).item())


def tokens_closed_form(acceptance, k):
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def accept_with(**slip):
    def answer(target_probs, draft_probs, draft_tokens, uniforms):
        n, distribution = accept64(target_probs, draft_probs, draft_tokens, uniforms, **slip)
        return n, distribution.float()
    return answer


def accept_unclamped(target_probs, draft_probs, draft_tokens, uniforms):
    n, distribution = sol.speculative_accept(target_probs, draft_probs, draft_tokens, uniforms)
    if n < draft_tokens.size(0):
        difference = target_probs[n] - draft_probs[n]
        distribution = difference / difference.sum()
    return n, distribution


def two_four_with(**slip):
    def answer(model):
        pruned = copy.deepcopy(model)
        with torch.no_grad():
            for _, layer in block_linears(pruned):
                layer.weight.mul_(two_four_mask(layer.weight, **slip))
        return pruned
    return answer


def two_four_in_place(model):
    pruned = sol.two_four_prune(model)
    model.load_state_dict(pruned.state_dict())
    return model


def two_four_everything(model):
    """Every matrix of the model 2:4, the embedding (and the head tied to it) too."""
    pruned = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in pruned.parameters():
            if parameter.dim() == 2 and parameter.size(1) % 4 == 0:
                parameter.mul_(two_four_mask(parameter))
    return pruned


def w8a8_with(**slip):
    return lambda x, q, scales: w8a8_linear64(x, q, scales, **slip).float()


def w8a8_zero_scale(cast):
    """No floor on the token scale: a token of zeros is 0 / 0 = NaN, cast to integers (undefined), times a 0 scale."""
    def answer(x, q, scales):
        x_scales = x.abs().amax(dim=-1, keepdim=True) / 127
        ratio = torch.round(x / x_scales).clamp(-127, 127)
        if cast == "copy":
            x_q = torch.empty(ratio.shape, dtype=torch.int32)
            x_q.copy_(ratio)
        else:
            x_q = ratio.to(torch.int32) if cast == "int32" else ratio.long()
        return (x_q @ q.to(x_q.dtype).T).float() * x_scales * scales
    return answer


def w8a8_where_zero(x, q, scales):
    """Right, written differently: a token of zeros gets the scale 1; the sums in int64."""
    largest = x.abs().amax(dim=-1, keepdim=True)
    x_scales = torch.where(largest > 0, largest / 127, torch.ones_like(largest))
    x_q = torch.round(x / x_scales).clamp(-127, 127).long()
    return (x_q @ q.long().T).float() * x_scales * scales


def w8a8_int8_matmul(x, q, scales):
    """The integers multiplied as int8 tensors: torch keeps the sums in int8, which wrap around."""
    x_scales = x.abs().amax(dim=-1, keepdim=True) / 127
    x_q = torch.round(x / x_scales).clamp(-127, 127).to(torch.int8)
    return (x_q @ q.T).float() * x_scales * scales


WRONG = [  # (exercise, wrong answer, the smallest failing input it must report, the hint it must get)
    ("quantize_rows_int8", int8_with(reduce="mean"), "weight [[0.7, -1, -0.2]]", "not its mean"),
    ("quantize_rows_int8", int8_with(reduce="tensor"), "weight [[-2, 0.9, 0.3], [0.1, 0.3, -0.05]]",
     "not one for the whole matrix"),
    ("quantize_rows_int8", int8_with(dim=0), "weight [[0.7, -1, -0.2]]", "not per column"),
    ("quantize_rows_int8", int8_with(reduce="signed"), "weight [[0.7, -1, -0.2]]", "not the largest w"),
    ("quantize_rows_int8", int8_with(levels=128), "weight [[1]]", "not 128"),
    ("quantize_rows_int8", int8_with(levels=255), "weight [[1]]", "not 255"),
    ("quantize_rows_int8", int8_with(levels=1), "weight [[1]]", "the step between two levels"),
    ("quantize_rows_int8", int8_with(rounding="trunc"), "weight [[0.7, -1, -0.2]]: q", "truncates towards zero"),
    ("quantize_rows_int8", int8_with(rounding="floor"), "weight [[0.7, -1, -0.2]]: q", "not down"),
    ("quantize_rows_int8", int8_unguarded, "weight [[0, 0, 0], [1.5, -0.4, 0.8]]", "a row of zeros needs"),
    ("quantize_rows_int8", int8_as_floats, "weight [[1]]: q", "return q as int8"),
    ("quantize_rows_int8", int8_scales_as(torch.float64), "weight [[1]]: the scales", "exactly torch.float32"),
    ("quantize_rows_int8", int8_scales_as(torch.bfloat16), "weight [[1]]: the scales", "exactly torch.float32"),
    ("quantize_rows_int8", int8_by_default_argument, "weight [[1]]", "write it without quantize_int8"),
    ("quantize_rows_int8", int8_floored(1e-8), "weight [[3e-30, -1e-30, 2e-30]]", "a fixed floor such as 1e-8"),
    ("quantize_rows_int8", int8_floored(torch.finfo(torch.float32).eps), "weight [[3e-30, -1e-30, 2e-30]]",
     "a fixed floor"),
    ("quantize_rows_int8", int8_floored(1e-12, before_division=True), "weight [[3e-30, -1e-30, 2e-30]]",
     "a fixed floor"),
    ("pack_int4_pairs", packing_with(swapped=True), "q [[-7, 7]]", "yours are swapped"),
    ("pack_int4_pairs", packing_with(offset=0), "q [[-7, 7]]", "store q + 8"),
    ("pack_int4_pairs", packing_with(offset=7), "q [[-7, 7]]", "add 8, not 7"),
    ("pack_int4_pairs", packing_with(layout="halves"), "q [[1, -1, 3, -3]]", "not column j with column j + in / 2"),
    ("pack_int4_pairs", pack_as_int8, "q [[-7, 7]]", "exactly torch.uint8"),
    ("dequantize_int4_groups", unpacking_with(swapped=True), "the values [[-7, 3]]", "yours are swapped"),
    ("dequantize_int4_groups", unpacking_with(offset=0), "the values [[-7, 3]]", "subtract 8 from each nibble"),
    ("dequantize_int4_groups", unpacking_with(signed_nibbles=True), "the values [[-7, 3]]", "two's complement"),
    ("dequantize_int4_groups", unpacking_with(tiled=True), "scales [[0.1, 2]]", "repeat_interleave"),
    ("dequantize_int4_groups", unpacking_with(one_scale=True), "scales [[0.1, 2]]", "not the row's first"),
    ("dequantize_int4_groups", lambda packed, scales: dequantize_int4_64(packed, 1 / scales).float(),
     "the values [[-7, 3]]", "do not divide"),
    ("dequantize_int4_groups", lambda packed, scales: dequantize_int4_64(packed, scales), "the values [[-7, 3]]",
     "exactly torch.float32"),
    ("magnitude_masks", masks_with(largest=True), "weights [[[0.5, -0.5, 0.1, 0.5]]], sparsity=0.5",
     "not the largest"),
    ("magnitude_masks", masks_by_threshold, "weights [[[0.5, -0.5, 0.1, 0.5]]], sparsity=0.5", "a threshold"),
    ("magnitude_masks", masks_with(threshold=True), "weights [[[0.5, -0.5, 0.1, 0.5]]], sparsity=0.5",
     "every weight tied with it"),
    ("magnitude_masks", masks_inverted, "weights [[[0.5, -0.5, 0.1, 0.5]]], sparsity=0.5", "True marks the weights"),
    ("magnitude_masks", masks_with(signed=True), "weights [[[1, -3], [2, -0.5]]], sparsity=0.5", "not by value"),
    ("magnitude_masks", masks_with(per_row=True), "sparsity=0.45", "not of each row"),
    ("magnitude_masks", masks_with(count=int), "sparsity=0.45", "int() truncates"),
    ("magnitude_masks", lambda weights, sparsity, scope="layer": sol.magnitude_masks(weights, sparsity),
     "sparsity=0.6, scope='global'", "scope 'global' ranks all the matrices together"),
    ("magnitude_masks", lambda weights, sparsity, scope="layer": sol.magnitude_masks(weights, sparsity, "global"),
     "sparsity=0.6, scope='layer'", "prunes each matrix on its own"),
    ("distill_loss", distill_with(power=0), "temperature=2.0, alpha=0.7", "its gradient shrinks"),
    ("distill_loss", distill_with(power=1), "temperature=2.0, alpha=0.7", "not T"),
    ("distill_loss", distill_with(reverse=True), "temperature=1.0, alpha=1.0", "yours is reversed"),
    ("distill_loss", distill_with(soft_teacher=False), "(identical logits)", "soften the teacher too"),
    ("distill_loss", distill_with(soft_student=False), "(identical logits)", "soften the student too"),
    ("distill_loss", distill_with(all_positions=True), "alpha=0.7 (ignored targets)", "counted tokens only"),
    ("distill_loss", distill_with(vocab_mean=True), "temperature=1.0, alpha=1.0", "divides by V too"),
    ("distill_loss", distill_with(swapped=True), "temperature=1.0, alpha=1.0", "yours are swapped"),
    ("distill_loss", distill_with(soft_cross_entropy=True), "alpha=0.7", "is not softened"),
    ("distill_loss", distill_with(summed=True), "alpha=0.7 (ignored targets)", "not their sum"),
    ("distill_loss", distill_naive, "(large logits)", "log(0) = -inf"),
    ("distill_loss", distill_by_distributions, "(large logits)", "torch.distributions.kl_divergence"),
    ("distill_loss", lambda *args: distill_by_distributions(*args, probs=True), "(large logits)",
     "inf for large logits"),
    ("distill_loss", distill_student_detached, "the gradient with respect to student_logits", "no .detach()"),
    ("distill_loss", distill_item, "the gradient with respect to student_logits", "no .item()"),
    ("tokens_per_round", lambda a, k: sum(a**i for i in range(k)), "tokens_per_round(1.0, k=4)", "k + 1 terms"),
    ("tokens_per_round", tokens_closed_form, "tokens_per_round(1.0, k=4)", "has no division"),
    ("tokens_per_round", lambda a, k: 1 + k * a, "tokens_per_round(0.8, k=4)", "probability a^i, not a"),
    ("tokens_per_round", lambda a, k: 1 / (1 - a) if a < 1 else k + 1, "tokens_per_round(0.5, k=1)",
     "it is not 1 / (1 - a)"),
    ("speculative_accept", accept_with(ratio_reversed=True), "(p(x) = 0: rejected): n", "yours is q / p"),
    ("speculative_accept", accept_with(prefix=False), "(the second guess rejected, the third would pass): n",
     "stop at the first rejected guess"),
    ("speculative_accept", accept_with(ignore_uniforms=True), "(both kept): n", "draw on the uniforms"),
    ("speculative_accept", accept_with(comparison_reversed=True), "(p = q: kept): n", "not >="),
    ("speculative_accept", accept_with(residual="unnormalised"), "(p(x) = 0: rejected): next_probs",
     "normalise the residual"),
    ("speculative_accept", accept_with(residual="reversed"), "(p(x) = 0: rejected): next_probs", "not q - p"),
    ("speculative_accept", accept_with(residual="target"), "the third would pass): next_probs", "not from p_i"),
    ("speculative_accept", accept_with(bonus_row=0), "(p = q: kept): next_probs", "row k of target_probs"),
    ("speculative_accept", accept_unclamped, "(p(x) = 0: rejected): next_probs", "clamp the negative differences"),
    ("two_four_prune", two_four_with(keep_smallest=True), "tiny_gpt(llama=False, seed=0): blocks.0.attn.qkv.weight",
     "prune the two smallest"),
    ("two_four_prune", two_four_with(along_rows=True), "tiny_gpt(llama=False, seed=0): blocks.0.attn.qkv.weight",
     "not four rows"),
    ("two_four_prune", two_four_with(strided=True), "tiny_gpt(llama=False, seed=0): blocks.0.attn.qkv.weight",
     "not every in/4-th one"),
    ("two_four_prune", two_four_with(per_row=True), "tiny_gpt(llama=False, seed=0): blocks.0.attn.qkv.weight",
     "not half of each row"),
    ("two_four_prune", two_four_with(signed=True), "tiny_gpt(llama=False, seed=0): blocks.0.attn.qkv.weight",
     "not by value"),
    ("two_four_prune", two_four_in_place, "tiny_gpt(llama=False, seed=0)", "leave the original as it was"),
    ("two_four_prune", two_four_everything, "tiny_gpt(llama=False, seed=0)", "prune only the weights"),
    ("w8a8_linear", w8a8_with(quantized=False), "x [[1, -0.3]]", "quantize the activations too"),
    ("w8a8_linear", w8a8_with(per_tensor=True), "x tensor of shape (4, 16)", "one scale per token"),
    ("w8a8_linear", w8a8_with(int8_sums=True), "x [[1, -0.3]]", "wrap around"),
    ("w8a8_linear", w8a8_int8_matmul, "x [[1, -0.3]]", "wrap around"),
    ("w8a8_linear", w8a8_with(x_scaled=False), "x [[1, -0.3]]", "both scales"),
    ("w8a8_linear", w8a8_with(rounding="trunc"), "x tensor of shape (4, 16)", "truncates towards zero"),
    ("w8a8_linear", w8a8_with(scales_across=True), "x [[0, 0], [0.2, -0.9]]", "along the tokens"),
    ("w8a8_linear", w8a8_zero_scale("int32"), "x [[0, 0], [0.2, -0.9]]", "a token of zeros needs a positive scale"),
    ("w8a8_linear", w8a8_zero_scale("long"), "x [[0, 0], [0.2, -0.9]]", "a token of zeros needs a positive scale"),
    ("w8a8_linear", w8a8_zero_scale("copy"), "x [[0, 0], [0.2, -0.9]]", "a token of zeros needs a positive scale"),
    ("w8a8_linear", lambda x, q, scales: w8a8_linear64(x, q, scales), "x [[1, -0.3]]", "exactly torch.float32"),
]


class TestChapter7(ExerciseSuite):
    chapter, folder, wrong = ch07, "ch07-deployment", WRONG


# --------------------------------------------------------------------------- chapter 7 only
def test_the_references_of_the_usual_mistakes_start_from_the_package():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 16, generator=generator)
    weight[2] = 0.0  # a row of zeros
    q, scales = quantize_int8(weight)
    assert torch.equal(int8_values(weight, scales), q.long())
    assert torch.allclose(int8_scales64(weight).float(), scales, rtol=1e-6, atol=0)
    packed, group_scales = quantize_int4(weight, 4)
    values = torch.randint(-7, 8, (5, 12), generator=generator, dtype=torch.int8)
    assert torch.equal(pack_int4_64(values), pack_int4(values))
    assert torch.allclose(dequantize_int4_64(packed, group_scales).float(), dequantize_int4(packed, group_scales))
    # masks: magnitude_prune's zeros, on weights with ties (multiples of 0.1) and no zeros of their own
    model = tiny_gpt(seed=2)
    with torch.no_grad():
        for _, layer in block_linears(model):
            signs = torch.randint(2, layer.weight.shape, generator=generator) * 2 - 1
            layer.weight.copy_(signs * torch.randint(1, 6, layer.weight.shape, generator=generator) / 10)
    weights = [layer.weight.detach().clone() for _, layer in block_linears(model)]
    for scope in ("layer", "global"):
        for sparsity in (0.0, 0.3, 0.61, 1.0):
            pruned = [layer.weight != 0 for _, layer in block_linears(magnitude_prune(model, sparsity, scope))]
            assert all(torch.equal(a, b) for a, b in zip(keep_masks(weights, sparsity, scope), pruned))
    logits = torch.randn(2, 5, 7, generator=generator) * 3
    teacher = torch.randn(2, 5, 7, generator=generator) * 3
    targets = torch.randint(7, (2, 5), generator=generator)
    targets[0, :3] = IGNORE_INDEX
    for temperature, alpha in ((1.0, 1.0), (2.0, 0.5), (0.5, 0.0)):
        assert torch.allclose(distill64(logits, teacher, targets, temperature, alpha).float(),
                              distillation_loss(logits, teacher, targets, temperature, alpha), atol=1e-6)


@pytest.mark.parametrize("seed", range(20))
def test_the_accept_reference_keeps_what_accept_draft_keeps_given_the_same_draws(seed):
    k, vocab = 4, 6
    rows = torch.Generator().manual_seed(100 + seed)
    target = torch.softmax(torch.randn(k + 1, vocab, generator=rows), -1)
    draft = 0.5 * target[:k] + 0.5 * torch.softmax(torch.randn(k, vocab, generator=rows), -1)
    tokens = torch.multinomial(draft, 1, generator=rows).squeeze(1)
    uniforms = torch.rand(k, generator=torch.Generator().manual_seed(seed))  # accept_draft's first draw
    n, distribution = accept64(target, draft, tokens, uniforms)
    assert accept_draft(target, draft, tokens, torch.Generator().manual_seed(seed))[0] == n
    expected = residual_distribution(target[n], draft[n]) if n < k else target[k]
    assert torch.allclose(distribution.float(), expected, atol=1e-6)


def test_w8a8_is_the_integer_product_rescaled_and_close_to_the_float_product():
    generator = torch.Generator().manual_seed(3)
    weight, x = torch.randn(8, 32, generator=generator) * 0.2, torch.randn(3, 32, generator=generator)
    q, scales = quantize_int8(weight)
    x_q, x_scales = quantize_int8(x)  # per token: a row of x is quantized as a row of a weight is
    exact = (x_q.long() @ q.long().T).double() * x_scales.double()[:, None] * scales.double()
    got = w8a8_linear64(x, q, scales)
    assert torch.allclose(got, exact, rtol=1e-6, atol=0)
    assert torch.allclose(got.float(), F.linear(x, q.float() * scales[:, None]), rtol=0.02, atol=0.02)
    assert torch.allclose(sol.w8a8_linear(x, q, scales), got.float(), rtol=1e-5, atol=1e-6)


def test_two_four_keeps_two_of_every_four_and_the_cases_reach_the_edges_they_are_meant_to():
    weight = torch.randn(6, 16, generator=torch.Generator().manual_seed(4))
    mask = two_four_mask(weight)
    assert (mask.reshape(6, 4, 4).sum(-1) == 2).all()
    assert torch.equal(two_four_mask(torch.tensor([[1.0, -4.0, 0.5, 3.0]])), torch.tensor([[False, True, False, True]]))
    # the first magnitude case ties at the boundary: a threshold prunes all three 0.5s
    tied = [torch.tensor([[0.5, -0.5, 0.1, 0.5]])]
    assert int((~masks_by_threshold(tied, 0.5)[0]).sum()) == 4 and int((~keep_masks(tied, 0.5)[0]).sum()) == 2
    # the first w8a8 case overflows an int8 sum; the third speculative case's third guess would pass
    q, scales = quantize_int8(torch.tensor([[0.6, -1.0], [0.25, 0.75]]))
    x_q, _ = quantize_int8(torch.tensor([[1.0, -0.3]]))
    assert (x_q.long() @ q.long().T).abs().max() > 127
    assert sol.tokens_per_round(1.0, 4) == 5 and sol.tokens_per_round(0.0, 3) == 1


def test_a_wrong_answer_that_returns_the_wrong_kind_of_thing_is_a_verdict_not_a_traceback():
    assert "return the two results" in verdict(lambda weight: weight, "quantize_rows_int8").detail
    assert "a number" in verdict(lambda a, k: "3", "tokens_per_round").detail
    assert "True where the weight stays" in verdict(lambda w, s, scope="layer": w[0], "magnitude_masks").detail
    ones = verdict(lambda weights, sparsity, scope="layer": [torch.ones_like(w) for w in weights], "magnitude_masks")
    assert "bool masks" in ones.detail
    assert "return n as an int" in verdict(lambda *args: (1.5, args[0][0]), "speculative_accept").detail
    assert "a pruned copy" in verdict(lambda model: None, "two_four_prune").detail
    assert "ZeroDivisionError" in verdict(lambda *args: 1 / 0, "w8a8_linear").detail


def kl_by_torch(student_logits, teacher_logits, targets, temperature, alpha):
    """The KL by F.kl_div, which the exercise takes away: its argument order is the mistake to learn to avoid."""
    vocab = student_logits.size(-1)
    log_q = F.log_softmax(student_logits.reshape(-1, vocab) / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits.reshape(-1, vocab) / temperature, dim=-1)
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
    return alpha * temperature**2 * kl + (1 - alpha) * F.cross_entropy(student_logits.reshape(-1, vocab),
                                                                          targets.reshape(-1))


def test_an_answer_that_calls_the_function_it_rebuilds_fails_and_says_so():
    calls = {
        "quantize_rows_int8": quantize_int8,
        "pack_int4_pairs": lambda q: quantize_int4(q.float(), 2)[0],
        "dequantize_int4_groups": dequantize_int4,
        "magnitude_masks": lambda weights, sparsity, scope="layer": magnitude_prune(weights, sparsity, scope),
        "distill_loss": kl_by_torch,
        "tokens_per_round": expected_tokens_per_round,
        "speculative_accept": lambda p, q, tokens, uniforms: accept_draft(p, q, tokens),
    }
    assert set(calls) == {e.name for e in ch07.CHAPTER.exercises.values() if e.kind == "write it yourself"}
    for name, answer in calls.items():
        result = verdict(answer, name)
        assert result.status == "failed" and "rebuilding it from simpler operations is the exercise" in result.detail, \
            str(result)
    assert "write it without distillation_loss" in verdict(distillation_loss, "distill_loss").detail


@pytest.mark.parametrize("name, answer", [("quantize_rows_int8", int8_where_zero), ("w8a8_linear", w8a8_where_zero),
                                          ("distill_loss", distill_by_logsumexp)])
def test_a_right_answer_written_differently_passes(name, answer):
    result = verdict(answer, name)
    assert result.status == "passed", str(result)
