"""Chapter 4's exercises: pretraining, checked against ``llmscratch`` and ``torch``.

Write it yourself: the next-token loss with skipped targets, one AdamW update (against
``torch.optim.AdamW``), top-p filtering (against ``llmscratch.model.generate.top_p_filter``), and gradient
accumulation over micro-batches of different sizes that equals one big batch. Extend the package:
a warmup-stable-decay schedule with ``learning_rate``'s contract, a label-smoothed loss given to
``OptimizerStep``, and min-p sampling in a KV-cached decoding loop.
"""

import copy
import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

from llmscratch.exercises.ch04_references import (adamw64, change, min_p_generate, smoothed64, token_nll64, top_p,
                                                  torch_adamw, wsd_schedule)
from llmscratch.exercises.checking import (Chapter, Mismatch, attempt, describe, diagnose, diagnose_nonfinite,
                                           expect_close, expect_equal, fresh_generator, random_bool, random_float,
                                           random_int, random_seed)
from llmscratch.exercises.fixtures import calls_recorded, flat_parameters, loss_and_gradient, tiny_gpt, token_ids
from llmscratch.model.generate import generate, top_p_filter
from llmscratch.model.gpt import GPT
from llmscratch.model.losses import IGNORE_INDEX
from llmscratch.training.config import TrainConfig
from llmscratch.training.optim import OptimizerStep

CHAPTER = Chapter("ch04", "Pretraining")
NONFINITE_HINT = ("your result has inf or NaN: exp of a large logit overflows (use torch.log_softmax, which subtracts "
                  "the max first), or a mean over no counted position is 0/0")


def _ids(shape: tuple, generator: torch.Generator) -> torch.Tensor:
    return token_ids(shape, generator, end_at=(-1, -1))  # the last id at the end of the last row


# --------------------------------------------------------------------------- write it yourself
@CHAPTER.exercise("next_token_loss", title="The next-token loss, with skipped targets", difficulty="warm-up",
                  section="1. The next-token loss", kind="write it yourself",
                  forbidden=("torch.nn.functional.cross_entropy", "torch.nn.functional.nll_loss"))
def check_next_token_loss(answer) -> int:
    generator, fresh = torch.Generator().manual_seed(1), fresh_generator()
    cases = [(1, 1, 2, 1.0), (1, 3, 5, 1.0), (2, 4, 7, 2.0), (3, 5, 11, 1.0), (2, 3, 6, 1000.0)]  # (B, T, V, scale)
    cases = [(*case, generator) for case in cases]  # and where logits and targets are drawn from
    cases += [(random_int(fresh, 1, 3), random_int(fresh, 1, 5), random_int(fresh, 2, 12),
               (1.0, 2.0, 1000.0)[random_int(fresh, 0, 2)], fresh) for _ in range(3)]  # no table holds them
    for index, (batch, seq_len, vocab, scale, source) in enumerate(cases):
        logits = scale * torch.randn(batch, seq_len, vocab, generator=source)
        targets = torch.randint(vocab, (batch, seq_len), generator=source)
        if source is fresh:  # skipped targets anywhere
            targets[torch.rand(batch, seq_len, generator=fresh) < 0.3] = IGNORE_INDEX
        elif index >= 2:  # skipped targets, a different number in each row; row 0 keeps only its last one
            targets[0, :-1] = IGNORE_INDEX
            targets[1:, 1] = IGNORE_INDEX
        targets[-1, -1] = vocab - 1  # an id at the vocabulary's end, so that some target counts
        case = (f"logits of shape {(batch, seq_len, vocab)}{' (large: up to ~3000)' if scale > 1 else ''}, "
                f"targets {targets.tolist()}")
        leaf = logits.clone().requires_grad_(True)
        got = attempt(answer, leaf * 1.0, targets.clone(), case=case)
        nll, keep = token_nll64(logits, targets)
        hint = diagnose_nonfinite(got, {
            "take the softmax over the vocabulary (dim=-1), not over the positions":
                lambda: token_nll64(logits, targets, dim=1)[0].sum() / keep.sum(),
            "average over the counted positions, not sum": lambda: nll.sum(),
            f"skipped positions (target {IGNORE_INDEX}) count neither in the sum nor in the number you divide by":
                lambda: nll.sum() / targets.numel(),
            "average over all counted positions at once, not per sequence and then over the sequences":
                lambda: (nll.sum(1) / keep.sum(1)).mean(),
            "the loss is in nats: the natural log, not log2": lambda: nll.sum() / keep.sum() / math.log(2),
        }, "the mean over the counted positions of -log softmax(logits)[target]", hint=NONFINITE_HINT)
        expect_close(got, nll.sum() / keep.sum(), case=case, hint=hint)
        grad_case = f"{case}: loss.backward()"
        if not got.requires_grad:
            raise Mismatch(grad_case, "a loss that backward() can differentiate", "a tensor without grad_fn",
                           "compute the loss from logits with torch operations (no .item(), no torch.tensor(a number), "
                           "no torch.no_grad()), so that backward() reaches the logits")
        attempt(got.backward, case=grad_case)
        expected_grad = torch.autograd.grad(F.cross_entropy(leaf.flatten(0, 1), targets.flatten()), leaf)[0]
        expect_close(leaf.grad, expected_grad, case=grad_case, hint="the gradient must be that of the mean loss")
    return len(cases)


@CHAPTER.exercise("adamw_step", title="One AdamW update", difficulty="medium",
                  section="2. A training loop by hand", kind="write it yourself",
                  forbidden=("torch.optim.AdamW", "torch.optim.Adam"))
def check_adamw_step(answer) -> int:
    generator, fresh = torch.Generator().manual_seed(2), fresh_generator()
    cases = [((1,), 1, 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0), ((3,), 2, 0.05, (0.9, 0.95), 1e-8, 0.1, 1.0),
             ((2, 3), 10, 3e-3, (0.9, 0.999), 1e-8, 0.0, 1.0), ((4,), 5, 1e-3, (0.9, 0.95), 1e-8, 0.1, 1e-8),
             ((3, 4), 1000, 0.05, (0.8, 0.9), 1e-6, 0.2, 1.0)]  # (shape, step, lr, betas, eps, decay, gradient size)
    cases = [(*case, generator) for case in cases]  # and where the tensors are drawn from
    cases += [(tuple(random_int(fresh, 1, 4) for _ in range(random_int(fresh, 1, 2))),
               (1, random_int(fresh, 2, 1000))[random_bool(fresh)], random_float(fresh, 1e-4, 0.1, 4),
               (random_float(fresh, 0.8, 0.95), random_float(fresh, 0.9, 0.999, 3)), 1e-8,
               random_float(fresh, 0.0, 0.2), 1.0, fresh) for _ in range(3)]  # cases no table of the fixed ones holds
    for shape, step, lr, betas, eps, weight_decay, size, source in cases:
        param = torch.randn(shape, generator=source, dtype=torch.float64)
        grad = size * torch.randn(shape, generator=source, dtype=torch.float64)
        first = step == 1  # before the first update both running averages are 0
        m = torch.zeros(shape, dtype=torch.float64) if first else size * torch.randn(shape, generator=source,
                                                                                      dtype=torch.float64)
        v = m**2 + (0 if first else size**2 * torch.rand(shape, generator=source, dtype=torch.float64))
        case = (f"param of shape {shape}, step={step}, lr={lr:g}, betas={betas}, eps={eps:g}, "
                f"weight_decay={weight_decay:g}{', gradients of size 1e-8' if size < 1 else ''}")
        args = (param, grad, m, v, step, lr, betas, eps, weight_decay)
        got = attempt(answer, *(t.clone() for t in args[:4]), *args[4:], case=case)
        if not (isinstance(got, tuple) and len(got) == 3):
            raise Mismatch(case, "a tuple (param, exp_avg, exp_avg_sq)", describe(got),
                           "return the three tensors after the update: the parameter and both running averages")
        expected = torch_adamw(*args)
        hint = diagnose(change(got[0], param), {  # compared by the change they make: param's update
            "divide the running averages by 1 - beta ** step (bias correction): they start at 0":
                lambda: change(adamw64(*args, corrected=False), param),
            "AdamW's decay is decoupled: param * (1 - lr * weight_decay), not weight_decay * param added to the "
            "gradient (that is Adam with L2)": lambda: change(adamw64(*args, decoupled=False), param),
            "the decay is scaled by the learning rate: param * (1 - lr * weight_decay)":
                lambda: change(adamw64(*args, decay_by_lr=False), param),
            "decay the parameter as it was before this update (torch shrinks it first, then subtracts the Adam "
            "step)": lambda: change(adamw64(*args, decay_after=True), param),
            "eps goes outside the square root: sqrt(v_hat) + eps":
                lambda: change(adamw64(*args, eps_inside=True), param),
            "beta1 averages the gradient, beta2 its square":
                lambda: change(adamw64(*args[:6], betas[::-1], *args[7:]), param),
            "step counts updates from 1: the first update has step=1 (use it as given)":
                lambda: change(adamw64(*args[:4], step + 1, *args[5:]), param),
        }, "param * (1 - lr * wd) - lr * m_hat / (sqrt(v_hat) + eps), with m_hat = m / (1 - beta1 ** step)",
            atol=1e-15)
        for name, got_part, expected_part, part_hint in zip(("param", "exp_avg", "exp_avg_sq"), got, expected, (
                hint, "exp_avg = beta1 * exp_avg + (1 - beta1) * grad (without bias correction: that is only for "
                      "the update)", "exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad ** 2")):
            expect_close(got_part, expected_part, case=f"{case}: the returned {name}", hint=part_hint,
                         atol=1e-12, rtol=1e-9, dtype=torch.float64)
    return len(cases)


@CHAPTER.exercise("top_p_filter", title="Top-p (nucleus) filtering", difficulty="medium",
                  section="5. Sampling: temperature, top-k, top-p", kind="write it yourself",
                  forbidden=("llmscratch.model.generate.top_p_filter",))
def check_top_p_filter(answer) -> int:
    generator = torch.Generator().manual_seed(5)
    ties = torch.zeros(2)  # two equally likely tokens: p = 0.5 is reached by the first one exactly
    already_filtered = torch.randn(2, 9, generator=generator).masked_fill(torch.arange(9) % 3 == 0, float("-inf"))
    cases = [(ties, 0.5), (torch.randn(1, 5, generator=generator), 0.01), (torch.randn(3, 7, generator=generator), 0.8),
             (2 * torch.randn(2, 3, 11, generator=generator), 0.6), (already_filtered, 0.9),
             (20 * torch.randn(2, 50, generator=generator), 1.0)]  # p = 1 on peaked rows: tiny tail probabilities
    cases[3][0][..., -1] += 3.0  # the most likely tokens at the vocabulary's end
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(random_float(fresh, 0.5, 5.0, 1) * torch.randn(random_int(fresh, 1, 3), random_int(fresh, 2, 12),
                                                              generator=fresh), random_float(fresh, 0.05, 0.99))
              for _ in range(3)]
    for logits, p in cases:
        case = f"top_p_filter(logits {describe(logits)}, p={p})"
        given = logits.clone()
        got = attempt(answer, given, p, case=case)
        hint = diagnose(got, {
            "keep the token that crosses p: drop a token only when the tokens ranked above it already reach p":
                lambda: top_p(logits, p, drop_crossing=True),
            "the most likely token is always kept, even when its probability alone is above p":
                lambda: top_p(logits, p, drop_crossing=True, keep_first=False),
            "put the filtered logits back in vocabulary order (scatter with the sort's indices)":
                lambda: top_p(logits, p, back_to_vocab=False),
            "sort in descending order: the nucleus is the most likely tokens":
                lambda: top_p(logits, p, ascending=True),
            "return the logits (dropped ones set to -inf), not probabilities":
                lambda: torch.softmax(top_p_filter(logits, p), dim=-1),
            "with p = 1 every token stays: the float cumulative sum can reach 1.0 before the last token, so return the "
            "logits unchanged": lambda: top_p(logits, p) if p == 1.0 else None,
        }, "keep the smallest set of most likely tokens whose probability reaches p (equal ones ranked by id), "
           "the rest -inf")
        expect_close(got, top_p_filter(logits, p), case=case, hint=hint, atol=0.0, rtol=0.0)
        expect_equal(given, logits, case=case, hint="return a new tensor: the caller's logits must stay as they "
                                                    "were (masked_fill, not masked_fill_)")
    return len(cases)


@CHAPTER.exercise("accumulate_gradients", title="Gradient accumulation that equals one big batch", difficulty="hard",
                  section="3. The same loop with `llmscratch.training.train`", kind="write it yourself")
def check_accumulate_gradients(answer) -> int:
    generator = torch.Generator().manual_seed(3)
    cases = [([1], 1, ""), ([2, 2], 4, ""), ([1, 2, 3], 3, ""), ([2, 2], 5, "uneven"), ([2, 1, 2], 3, "empty")]
    cases = [(*case, generator) for case in cases]  # and where the micro-batches are drawn from
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [([random_int(fresh, 1, 3) for _ in range(random_int(fresh, 1, 3))], random_int(fresh, 1, 5), "random",
               fresh) for _ in range(2)]
    model = tiny_gpt(llama=False, seed=3)
    for rows, seq_len, skipped, source in cases:
        micro = [(_ids((b, seq_len), source), _ids((b, seq_len), source)) for b in rows]  # (b, T) each
        if skipped == "uneven":  # the same rows, different numbers of counted targets
            micro[0][1][:, 1:] = IGNORE_INDEX
        if skipped == "empty":  # a micro-batch with nothing to predict
            micro[1][1][:] = IGNORE_INDEX
        if skipped == "random":  # any target but the first
            for _, targets in micro:
                targets[torch.rand(targets.shape, generator=fresh) < 0.3] = IGNORE_INDEX
            micro[0][1][0, 0] = 0
        case = (f"micro-batches of {rows} rows of {seq_len} tokens, "
                f"{[int((t != IGNORE_INDEX).sum()) for _, t in micro]} counted targets")
        grads = torch.stack([loss_and_gradient(model, x, t)[1] for x, t in micro])  # (k, n_params): each its own
        big_loss, expected = loss_and_gradient(model, *(torch.cat(part) for part in zip(*micro)))  # one big batch
        weights_before = flat_parameters(model)
        with calls_recorded(model) as shapes:
            got_loss = attempt(answer, model, [(x.clone(), t.clone()) for x, t in micro], case=case)
        if any(p.grad is None for p in model.parameters()):
            raise Mismatch(case, "a .grad in every parameter", "some .grad still None",
                           "call backward() on each micro-batch's (scaled) loss: the gradients add up in .grad")
        got = torch.cat([p.grad.flatten() for p in model.parameters()])
        hint = diagnose_nonfinite(got, {
            "scale each micro-batch's loss before backward: their gradients add up, so a plain sum is k times too "
            "large": lambda: grads.sum(0),
            "weight by counted targets (those not -100), not by rows: n_i / N": lambda: (
                torch.tensor(rows, dtype=torch.float)[:, None] * grads).sum(0) / sum(rows),
            "weight each micro-batch by its share of the counted targets, n_i / N, not 1 / k: the micro-batches "
            "differ in size": lambda: grads.mean(0),
            "don't zero the gradients between micro-batches: they must add up": lambda: grads[-1],
        }, "the gradients of sum_i (n_i / N) * loss_i, where n_i counts micro-batch i's targets that are not -100",
            hint=NONFINITE_HINT)
        expect_close(got, expected, case=case, hint=hint, atol=1e-6, rtol=1e-4)
        expect_close(got_loss, big_loss, case=f"{case}: the returned loss", hint=(
            "return the whole batch's mean loss as a float: sum_i (n_i / N) * loss_i (.item() of each term)"))
        expect_equal(flat_parameters(model), weights_before, case=case, hint="only fill .grad: take no optimizer step")
        if not shapes or max(shape[0] for shape in shapes) > max(rows):
            raise Mismatch(case, f"forward calls of at most {max(rows)} rows", f"calls of shapes {shapes}",
                           "run each micro-batch through the model on its own: one big forward needs the memory "
                           "that accumulation saves")
    return len(cases)


# --------------------------------------------------------------------------- extend the package
@CHAPTER.exercise("wsd_learning_rate", title="A warmup-stable-decay learning-rate schedule", difficulty="warm-up",
                  section="3. The same loop with `llmscratch.training.train`", kind="extend the package")
def check_wsd_learning_rate(answer) -> int:
    cases = [(1, 0, 1.0, 0.1, 0.2), (10, 2, 1.0, 0.1, 0.2), (7, 0, 3e-3, 3e-4, 0.3), (10, 6, 1.0, 0.1, 0.5),
             (12, 3, 2e-3, 2e-4, 0.0), (20, 5, 1e-3, 1e-4, 1.0)]  # (max_steps, warmup, lr, min_lr, decay_fraction)
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    for _ in range(3):
        max_steps, lr = random_int(fresh, 1, 30), random_float(fresh, 1e-4, 1.0, 4)
        cases.append((max_steps, random_int(fresh, 0, max_steps - 1), lr, random_float(fresh, 0.0, lr, 6),
                      random_float(fresh, 0.0, 1.0)))
    for max_steps, warmup, lr, min_lr, fraction in cases:
        config = TrainConfig(max_steps=max_steps, warmup_steps=warmup, lr=lr, min_lr=min_lr)
        fields = dataclasses.asdict(config)
        case = (f"steps 0 .. {max_steps - 1} of TrainConfig(max_steps={max_steps}, warmup_steps={warmup}, lr={lr:g}, "
                f"min_lr={min_lr:g}), decay_fraction={fraction}")
        got = attempt(lambda: torch.tensor([float(answer(s, config, fraction)) for s in range(max_steps)],
                                           dtype=torch.float64), case=case)
        changed = {k: v for k, v in dataclasses.asdict(config).items() if fields[k] != v}
        if changed:
            raise Mismatch(case, "the config as it was", f"fields changed: {changed}",
                           "read the config, never change it")
        rates = functools.partial(wsd_schedule, config, fraction)
        hint = diagnose(got, {
            "the warmup is learning_rate's: lr * (step + 1) / warmup_steps, so step 0 already learns":
                lambda: rates(from_zero=True),
            "decay to config.min_lr, not to 0": lambda: rates(floor=0.0),
            "the decay starts at lr (progress 0 at the first decay step) and reaches min_lr at max_steps, one past "
            "the last step, as learning_rate does": lambda: rates(late=1),
            "the decay is linear, not a cosine": lambda: rates(cosine=True),
            "the decay never starts before the warmup ends: decay_start = max(warmup_steps, max_steps - "
            "int(decay_fraction * max_steps))": lambda: rates(clamp=False),
        }, "warmup as learning_rate, then lr until decay_start, then linear down to min_lr at max_steps")
        expect_close(got, rates(), case=case, hint=hint, atol=1e-12, rtol=1e-9)
    return len(cases)


@CHAPTER.exercise("label_smoothing_loss", title="Label smoothing, as a loss for OptimizerStep", difficulty="medium",
                  section="3. The same loop with `llmscratch.training.train`", kind="extend the package")
def check_label_smoothing_loss(answer) -> int:
    generator = torch.Generator().manual_seed(4)
    cases = [(False, 1, 1, 0.1), (True, 2, 5, 0.0), (False, 2, 6, 0.1), (True, 3, 4, 0.3), (False, 1, 7, 1.0)]
    cases = [(index, *case, generator) for index, case in enumerate(cases)]  # the weights' seed first, the ids' source
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(random_seed(fresh), random_bool(fresh), random_int(fresh, 1, 3), random_int(fresh, 1, 8),
               random_float(fresh, 0.0, 1.0), fresh) for _ in range(2)]
    for index, (seed, llama, batch, seq_len, smoothing, source) in enumerate(cases):
        model = tiny_gpt(llama, seed=seed, lively=True)
        inputs, targets = _ids((batch, seq_len), source), _ids((batch, seq_len), source)
        if source is fresh:
            targets[0, : random_int(fresh, 0, seq_len - 1)] = IGNORE_INDEX  # skipped positions, e.g. padding
        elif index >= 2:
            targets[0, : seq_len // 2] = IGNORE_INDEX
        case = f"a {'Llama-style' if llama else 'GPT-2'} model, inputs of shape {(batch, seq_len)}, " \
               f"targets {targets.tolist()}, smoothing={smoothing}"
        with torch.no_grad():
            got = attempt(answer, model, (inputs, targets), smoothing, case=case)
            logits = model(inputs)
        if not isinstance(got, torch.Tensor):
            raise Mismatch(case, "a tensor of shape ()", describe(got), LOSS_TENSOR_HINT)
        hint = diagnose_nonfinite(got, {
            "torch's convention: the smoothing is spread over all V tokens, the target included (eps / V each), "
            "not over the V - 1 others": lambda: smoothed64(logits, targets, smoothing, others=True),
            "the uniform part is the mean of -log p over the vocabulary, not the sum":
                lambda: smoothed64(logits, targets, smoothing, summed=True),
            "the target's term is weighted by 1 - smoothing": lambda: smoothed64(logits, targets, smoothing,
                                                                                 target_weight=1.0),
            "skip the positions whose target is -100 in both terms, and average over the counted ones":
                lambda: smoothed64(logits, targets, smoothing, all_positions=True),
        }, "(1 - eps) * (-log p(target)) + eps * mean over the vocabulary of -log p, averaged over the counted "
           "positions: F.cross_entropy(..., label_smoothing=eps)", hint=NONFINITE_HINT)
        expected = F.cross_entropy(logits.double().flatten(0, 1), targets.flatten(), label_smoothing=smoothing)
        expect_close(got, expected, case=case, hint=hint)
    return len(cases) + _check_in_optimizer_step(answer, generator)


LOSS_TENSOR_HINT = ("return the loss tensor computed from model(inputs) by torch operations (no .item(), no "
                    "torch.no_grad(), no .detach()): OptimizerStep calls backward() on it")


def _check_in_optimizer_step(answer, generator) -> int:
    """The answer as OptimizerStep's loss function: the same mean loss and gradient norm as the reference's."""
    model = tiny_gpt(llama=True, seed=9, lively=True).train()
    reference = copy.deepcopy(model)
    config = TrainConfig(max_steps=2, warmup_steps=0, lr=1e-2, min_lr=1e-2)
    micro_batches = [(_ids((2, 6), generator), _ids((2, 6), generator)) for _ in range(2)]

    def reference_loss(batch):
        return F.cross_entropy(reference(batch[0]).flatten(0, 1), batch[1].flatten(), label_smoothing=0.1)

    case = ("OptimizerStep(model, TrainConfig(...), cpu)(two micro-batches of (2, 6), "
            "lambda batch: label_smoothing_loss(model, batch, 0.1))")
    loss = attempt(answer, model, micro_batches[0], 0.1, case=case)
    if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
        raise Mismatch(case, "a loss tensor that backward() can differentiate", describe(loss), LOSS_TENSOR_HINT)
    step = OptimizerStep(model, config, torch.device("cpu"), advice="")
    got = attempt(step, micro_batches, lambda batch: answer(model, batch, 0.1), case=case)
    expected = OptimizerStep(reference, config, torch.device("cpu"), advice="")(micro_batches, reference_loss)
    for name, got_value, expected_value in zip(("mean loss", "gradient norm"), got, expected):
        expect_close(got_value, expected_value, case=f"{case}: the {name} it returns", hint=LOSS_TENSOR_HINT,
                     rtol=1e-4)
    return 1


def _generated(answer, model: GPT, idx: torch.Tensor, n: int, min_p: float, temperature: float, seed: int,
               case: str) -> torch.Tensor:
    """The answer's tokens (B, T + n), its calls of the model checked to feed one token at a time after the prompt."""
    with calls_recorded(model) as shapes:
        try:
            got = attempt(answer, model, idx.clone(), n, min_p, temperature,
                          generator=torch.Generator().manual_seed(seed), case=case)
        except Mismatch as mismatch:
            if "probability tensor" not in str(mismatch.got):
                raise
            raise Mismatch(case, "a sample", mismatch.got, (
                "every token of a row was filtered out (all -inf), so nothing was left to sample: the threshold is "
                "min_p times that row's own top probability, which always keeps its top token")) from None
    expected_shape = (idx.size(0), idx.size(1) + n)
    if not (isinstance(got, torch.Tensor) and got.shape == expected_shape):
        raise Mismatch(case, f"a tensor of shape {expected_shape}", describe(got),
                       "return idx followed by the new tokens: (B, T + max_new_tokens)")
    if n >= 2 and (shapes[:1] != [tuple(idx.shape)] or any(shape[1] != 1 for shape in shapes[1:])):
        raise Mismatch(case, f"one call of shape {tuple(idx.shape)}, then calls of one token each",
                       f"calls of shapes {shapes}", "use the KV cache: run the prompt once through model(idx, caches), "
                       "then feed only the new token, model(next_ids[:, None], caches, start_pos=its position)")
    return got


LOGITS_HINT = ("check the logits: the prompt prefilled into the caches, then each new token fed at its own position "
               "(start_pos = its index in the sequence)")


@CHAPTER.exercise("generate_min_p", title="Min-p sampling in a KV-cached decoding loop", difficulty="hard",
                  section="5. Sampling: temperature, top-k, top-p", kind="extend the package")
def check_generate_min_p(answer) -> int:
    generator = torch.Generator().manual_seed(6)
    cases = [(False, (1, 1), 0, 0.1, 1.0), (False, (1, 2), 4, 0.0, 1.0), (True, (3, 2), 8, 0.1, 1.0),
             (False, (1, 1), 3, 1.0, 1.0), (True, (2, 3), 5, 1.0, 1.0), (True, (2, 4), 12, 0.1, 0.7),
             (False, (3, 1), 6, 0.05, 1.5)]  # (Llama-style?, prompt shape, new tokens, min_p, temperature)
    # the weights' and the samples' seeds first
    cases = [(index, 100 + index, *case, generator) for index, case in enumerate(cases)]
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(random_seed(fresh), random_seed(fresh), random_bool(fresh),
               (random_int(fresh, 1, 3), random_int(fresh, 1, 4)), random_int(fresh, 0, 6),
               random_float(fresh, 0.01, 0.99), random_float(fresh, 0.5, 1.5), fresh) for _ in range(2)]
    for model_seed, seed, llama, shape, n, min_p, temperature, source in cases:
        model, idx = tiny_gpt(llama, seed=model_seed, lively=True), _ids(shape, source)
        case = (f"a {'Llama-style' if llama else 'GPT-2'} model (context 16), idx {idx.tolist()}, "
                f"max_new_tokens={n}, min_p={min_p}, temperature={temperature}")
        got = _generated(answer, model, idx, n, min_p, temperature, seed, case)
        if min_p == 1.0:  # only the most likely token survives: greedy decoding
            expect_equal(got, generate(model, idx, n), case=case, hint=(
                "with min_p = 1 only the most likely token is left, so these must be greedy decoding's tokens "
                f"(generate(model, idx, n)): {LOGITS_HINT}"))
        if min_p == 0.0:  # nothing is filtered: plain sampling at this temperature
            expect_equal(got, generate(model, idx, n, temperature=temperature,
                                       generator=torch.Generator().manual_seed(seed)), case=case, hint=(
                "with min_p = 0 nothing is filtered, so these must be generate(..., temperature=temperature, "
                f"generator=...)'s tokens: {LOGITS_HINT}, and each token drawn with sample_next_token(kept, 1.0, "
                "generator=generator) after dividing the logits by the temperature"))
        reference = functools.partial(min_p_generate, model, idx, n, min_p, temperature, seed)
        hint = diagnose(got, {
            "apply min-p after the temperature: divide the logits by it first, then compare the probabilities":
                lambda: reference(before_temperature=True),
            "the threshold is relative: min_p times the row's most likely probability, not min_p itself":
                lambda: reference(absolute=True),
            "each row has its own most likely token: take the max over the vocabulary (dim=-1, keepdim=True)":
                lambda: reference(batch_max=True),
            "the temperature is applied once: after dividing the logits, draw with "
            "sample_next_token(kept, 1.0, generator=generator)": lambda: reference(temperature_twice=True),
        }, "each step: last position's logits / temperature, keep p >= min_p * max p of the row, the others -inf, "
           "draw with sample_next_token(kept, 1.0, generator=generator)")
        expect_equal(got, reference(), case=case, hint=hint)
    return len(cases)
