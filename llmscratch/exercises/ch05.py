"""Chapter 5's exercises: finetuning, checked against ``llmscratch.finetuning.classify``, ``.instruct``, ``.lora``,
``.finetune``.

Write it yourself: a classifier's logits at each row's last real token, accuracy and the spam class's
precision, recall and F1, an instruction batch with the prompt masked, and a LoRA layer merged into a
plain ``nn.Linear``. Extend the package: multiple-choice scoring with a GPT's log-probabilities, LoRA on
the token embedding plugged into ``GPT``, and ``fit`` with early stopping that keeps the best epoch's weights.
"""

import copy
import functools

import torch
from torch import nn

from llmscratch.exercises.ch05_references import choice_logprobs, early_stop, instruction_rows, lora_lookup
from llmscratch.exercises.checking import (Chapter, Mismatch, attempt, describe, diagnose, expect_close, expect_equal,
                                           fresh_generator, random_bool, random_float, random_int, random_seed)
from llmscratch.exercises.fixtures import (VOCAB, build_module, decoded, flat_parameters, lm_backward, tiny_gpt,
                                           token_ids)
from llmscratch.finetuning.classify import GPTClassifier, classification_metrics
from llmscratch.finetuning.config import FinetuneConfig, LoRAConfig
from llmscratch.finetuning.finetune import fit
from llmscratch.finetuning.instruct import collate, lm_loss
from llmscratch.finetuning.lora import LoRALinear, apply_lora, lora_layers
from llmscratch.model.gpt import GPT
from llmscratch.model.losses import IGNORE_INDEX

CHAPTER = Chapter("ch05", "Finetuning: a spam classifier, an instruction follower and LoRA")
CPU = torch.device("cpu")


# --------------------------------------------------------------------------- write it yourself
@CHAPTER.exercise("last_token_logits", title="Each row's logits at its last real token", difficulty="warm-up",
                  section="1.3 Why the last real token", kind="write it yourself")
def check_last_token_logits(answer) -> int:
    generator = torch.Generator().manual_seed(1)
    cases = [(3, 2, [1]), (1, 2, [1]), (4, 2, [4, 2]), (5, 3, [5, 2, 4]), (6, 2, [1, 6, 3, 6])]  # (T, C, lengths)
    cases = [(*case, generator) for case in cases]  # and where the logits are drawn from
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    for _ in range(3):
        seq_len = random_int(fresh, 1, 8)
        cases.append((seq_len, random_int(fresh, 1, 4),
                      [random_int(fresh, 1, seq_len) for _ in range(random_int(fresh, 1, 4))], fresh))
    for seq_len, n_classes, row_lengths, source in cases:
        logits = torch.randn(len(row_lengths), seq_len, n_classes, generator=source)  # (B, T, C)
        lengths, rows = torch.tensor(row_lengths), torch.arange(len(row_lengths))  # (B,) each
        case = f"logits of shape {tuple(logits.shape)}, lengths {row_lengths}"
        got = attempt(answer, logits.clone(), lengths.clone(), case=case)
        hint = diagnose(got, {
            "you read the last column: in a padded batch that is a pad token's output for every row shorter than "
            "T; read row b at position lengths[b] - 1": lambda: logits[:, -1],
            "off by one: a row of length n has its last real token at position n - 1": lambda: logits[rows, lengths],
            "index rows and positions together, logits[torch.arange(B), lengths - 1]: logits[:, lengths - 1] "
            "takes every row at every row's position, (B, B, C)": lambda: logits[:, lengths - 1],
            "position 0 has seen only the first token (attention is causal): read the last real one":
                lambda: logits[:, 0],
        }, "row b of the result is logits[b, lengths[b] - 1]")
        expect_equal(got, logits[rows, lengths - 1], case=case, hint=hint)
    classifier = GPTClassifier(tiny_gpt(seed=1), n_classes=3).eval()
    ids, lengths = token_ids((3, 7), generator), torch.tensor([7, 1, 4])
    with torch.no_grad():
        per_position, expected = classifier.gpt(ids), classifier(ids, lengths)  # (3, 7, 3), (3, 3)
    case = "a GPTClassifier's logits at every position, (3, 7, 3), lengths [7, 1, 4]"
    expect_close(attempt(answer, per_position, lengths, case=case), expected, case=case,
                 hint="your answer must give what GPTClassifier(ids, lengths) gives")
    return len(cases) + 1


SCORES = ("accuracy", "precision", "recall", "f1")


def _scores(got, case: str) -> dict[str, float]:
    """The four scores, rounded to 9 digits (so that two ways of computing them compare equal)."""
    try:
        return {key: round(float(got[key]), 9) for key in SCORES}
    except (TypeError, KeyError, ValueError, IndexError):
        raise Mismatch(case, f"a dict of four numbers, keys {SCORES}", describe(got),
                       "return {'accuracy': ..., 'precision': ..., 'recall': ..., 'f1': ...}") from None


@CHAPTER.exercise("classification_scores", title="Accuracy, precision, recall and F1 of the spam class",
                  difficulty="warm-up", section="1.5 Before training", kind="write it yourself",
                  forbidden=("llmscratch.finetuning.classify.classification_metrics",))
def check_classification_scores(answer) -> int:
    generator = torch.Generator().manual_seed(2)
    cases = [([1], [1]), ([0], [0]), ([1, 1, 0], [1, 0, 0]), ([0, 0, 0, 1], [1, 1, 0, 1]), ([1, 0], [0, 1])]
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    draws = [(37, 0.3, generator), (100, 0.6, generator)]
    draws += [(random_int(fresh, 1, 60), random_float(fresh, 0.0, 1.0), fresh) for _ in range(2)]
    for size, spam_rate, source in draws:
        predictions = (torch.rand(size, generator=source) < spam_rate).long().tolist()
        cases.append((predictions, (torch.rand(size, generator=source) < 0.5).long().tolist()))
    for predictions, labels in cases:
        case = f"predictions {predictions}, labels {labels}"
        got = _scores(attempt(answer, list(predictions), list(labels), case=case, errors={
            "ZeroDivisionError": "a ratio with nothing to count (no message flagged as spam, or no spam at all) is 0, "
                                 "as in classification_metrics: guard each division"}), case)
        expected = _scores(classification_metrics(predictions, labels), case)
        hint = diagnose(got, {
            "precision and recall are swapped: precision divides the true spam by the messages flagged as spam, "
            "recall by the messages that are spam":
                lambda: {**expected, "precision": expected["recall"], "recall": expected["precision"]},
            "F1 is the harmonic mean 2pr / (p + r), not the arithmetic mean (p + r) / 2":
                lambda: {**expected, "f1": round((expected["precision"] + expected["recall"]) / 2, 9)},
            "spam (class 1) is the positive class, not ham (class 0)":
                lambda: _scores(classification_metrics(predictions, labels, positive=0), case),
        }, "precision = true spam / flagged as spam, recall = true spam / all spam, F1 = 2pr / (p + r); 0 / 0 is 0")
        expect_equal(got, expected, case=case, hint=hint)
    return len(cases)


@CHAPTER.exercise("collate_masked", title="An instruction batch with the prompt masked", difficulty="medium",
                  section="2.3 Batches and their masking", kind="write it yourself",
                  forbidden=("llmscratch.finetuning.instruct.collate",))
def check_collate_masked(answer) -> int:
    generator = torch.Generator().manual_seed(3)
    eos_id = VOCAB - 1  # the vocabulary's last id
    cases = [[(1, 1)], [(2, 1)], [(3, 2), (1, 4)], [(2, 2), (2, 2)], [(4, 1), (2, 3), (5, 5)]]  # (prompt, answer)
    cases = [(lengths, generator) for lengths in cases]  # and where the ids are drawn from
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [([(random_int(fresh, 1, 5), random_int(fresh, 1, 5)) for _ in range(random_int(fresh, 1, 3))], fresh)
              for _ in range(3)]
    for lengths, source in cases:
        pairs = [(torch.randint(eos_id, (p,), generator=source).tolist(),
                  torch.randint(eos_id, (a,), generator=source).tolist()) for p, a in lengths]
        pairs[-1][1][-1] = eos_id - 1
        case = f"collate_masked({pairs}, eos_id={eos_id})"
        rows = functools.partial(instruction_rows, pairs, eos_id)  # the reference, one slip per keyword
        got = attempt(answer, copy.deepcopy(pairs), eos_id, case=case)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise Mismatch(case, "(inputs, targets)", describe(got), "return the two tensors: inputs, targets")
        got_inputs, got_targets = got
        inputs, targets = collate(pairs, eos_id, mask_prompt=True)
        hint = diagnose(got_inputs, {
            "end every row with eos_id: the model learns to write <|endoftext|> after the answer":
                lambda: rows(eos=False)[0],
            "pad the inputs with eos_id: -100 is no token id": lambda: rows(pad_input=IGNORE_INDEX)[0],
            "pad the inputs with eos_id (the pad id), not 0": lambda: rows(pad_input=0)[0],
        }, "inputs row i is (prompt + answer + [eos_id])[:-1], padded on the right with eos_id")
        expect_equal(got_inputs, inputs, case=case + ": the inputs", hint=hint)
        hint = diagnose(got_targets, {
            "targets are shifted by one (target t is token t + 1), so only the first len(prompt) - 1 targets are "
            "prompt tokens: you also hid the first answer token": lambda: rows(masked=lambda n: n)[1],
            "mask the prompt: its first len(prompt) - 1 targets are -100":
                lambda: rows(masked=lambda n: 0)[1],
            "pad the targets with -100 (IGNORE_INDEX), which the loss skips, not with eos_id":
                lambda: rows(pad_target=eos_id)[1],
            "keep the end-of-text after the answer as a target: it is what teaches the model to stop":
                lambda: rows(stop_target=False)[1],
        }, "targets row i is (prompt + answer + [eos_id])[1:], its first len(prompt) - 1 set to -100, padded with -100")
        expect_equal(got_targets, targets, case=case + ": the targets", hint=hint)
    return len(cases)


def _merged(answer, layer: LoRALinear, case: str) -> nn.Linear:
    """The reader's merge of ``layer``, checked against the package's; the layer must come out unchanged."""
    before = layer.base.weight.detach().clone()
    shapes = "the update is B @ A, of shape (out, in) like W: A = layer.lora_a (rank, in), B = layer.lora_b (out, rank)"
    got = attempt(answer, layer, case=case, errors={"size of tensor": shapes})
    if not isinstance(got, nn.Linear):
        raise Mismatch(case, "an nn.Linear", describe(got), "return a plain nn.Linear (new storage, the update in it)")
    expect_equal(layer.base.weight.detach(), before, case=case, hint=(
        "leave the LoRA layer's base weight as it was: make a new nn.Linear (a head tied to the token embedding "
        "shares its weight, which an in-place add would change)"))
    if got.weight.data_ptr() == layer.base.weight.data_ptr():
        raise Mismatch(case, "a weight of its own", "the base layer's weight", "give the merged layer new storage")
    return got


@CHAPTER.exercise("merged_linear", title="Merge a LoRA layer into a plain nn.Linear", difficulty="medium",
                  section="3. LoRA: finetuning a few low-rank matrices", kind="write it yourself",
                  forbidden=("llmscratch.finetuning.lora.LoRALinear.merged", "llmscratch.finetuning.lora.merge_lora"))
def check_merged_linear(answer) -> int:
    cases = [(3, 2, True, 1, 2.0), (4, 4, False, 2, 8.0), (5, 3, True, 4, 2.0), (6, 8, True, 8, 16.0)]
    cases = list(enumerate(cases))  # each case's index seeds its weights
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(random_seed(fresh), (random_int(fresh, 1, 8), random_int(fresh, 1, 8), random_bool(fresh),
                                    random_int(fresh, 1, 8), random_float(fresh, 1.0, 16.0, 1))) for _ in range(2)]
    for seed, (in_features, out_features, bias, rank, alpha) in cases:
        torch.manual_seed(seed)
        layer = LoRALinear(nn.Linear(in_features, out_features, bias=bias), rank, alpha)
        with torch.no_grad():
            layer.lora_b.normal_()  # as if trained: B is no longer zero
        case = f"LoRALinear(nn.Linear({in_features}, {out_features}, bias={bias}), rank={rank}, alpha={alpha:g})"
        got = _merged(answer, layer, case)
        weight, a, b = layer.base.weight.detach(), layer.lora_a.detach(), layer.lora_b.detach()
        expected = layer.merged()
        hint = diagnose(got.weight, {
            "scale the update B @ A by alpha / rank (layer.scaling)": lambda: weight + b @ a,
            "the scale is alpha / rank, not rank / alpha": lambda: weight + rank / alpha * b @ a,
            "the update is B @ A, of shape (out, in) like W, not A^T B^T": lambda: weight + alpha / rank * a.T @ b.T,
            "add the update to the weight: W' = W + (alpha / rank) B A": lambda: weight,
        }, "W' = W + (alpha / rank) * B @ A, with A = layer.lora_a (rank, in) and B = layer.lora_b (out, rank)")
        expect_close(got.weight, expected.weight, case=case + ": the weight", hint=hint)
        expect_equal(got.bias is not None, bias, case=case + ": has a bias", hint="keep the base layer's bias")
        if bias:
            expect_close(got.bias, expected.bias, case=case + ": the bias", hint="copy the base layer's bias")
    model = tiny_gpt(llama=False, seed=4)
    idx = torch.randint(VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0, targets=("*.attn.qkv", "*.mlp.*", "lm_head")))
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_b.normal_(std=0.1)
        expected = model(idx)  # (2, 6, V)
    case = "every LoRA layer of a GPT-2 model (its tied lm_head too) replaced by merged_linear(layer)"
    for name, layer in lora_layers(model).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, _merged(answer, layer, case))
    with torch.no_grad():
        expect_close(attempt(model, idx, case=case), expected, case=case, hint="the merged model must compute what "
                     "the model with adapters computed")
    return len(cases) + 1


# --------------------------------------------------------------------------- extend the package
@CHAPTER.exercise("score_choices", title="Score multiple-choice answers with a GPT's log-probabilities",
                  difficulty="medium", section="4. Evaluations that measure something", kind="extend the package")
def check_score_choices(answer) -> int:
    generator = torch.Generator().manual_seed(5)

    def ids(n):
        return torch.randint(VOCAB, (n,), generator=generator).tolist()

    cases = [(False, [5], [[7]]), (False, [5, 9], [[VOCAB - 1], [7]]), (False, [1, 2, 3, 4], [[10, 11], [12], ids(3)]),
             (False, [2], [ids(15), [VOCAB - 1]]), (True, ids(3), [ids(1), ids(4), ids(2)]),
             (True, ids(6), [ids(10), ids(1)])]  # (Llama-style?, prompt, choices): the 4th fills the context
    cases = list(enumerate(cases))  # each case's index seeds its weights
    fresh = fresh_generator()  # and cases no table of the fixed ones holds

    def fresh_ids(n):
        return torch.randint(VOCAB, (n,), generator=fresh).tolist()

    for _ in range(2):
        prompt = fresh_ids(random_int(fresh, 1, 6))
        choices = [fresh_ids(random_int(fresh, 1, 8)) for _ in range(random_int(fresh, 1, 3))]  # within the context
        cases.append((random_seed(fresh), (random_bool(fresh), prompt, choices)))
    for seed, (llama, prompt, choices) in cases:
        model = tiny_gpt(llama, seed=seed)
        case = f"a {'Llama-style' if llama else 'GPT-2'} model, prompt {prompt}, choices {choices}"
        got = attempt(answer, model, list(prompt), copy.deepcopy(choices), case=case)
        hint = diagnose(got, {
            "off by one: the token at position t is predicted by the logits at position t - 1, so choice token j "
            "is read at position len(prompt) - 1 + j": lambda: choice_logprobs(model, prompt, choices, shift=0),
            "sum the log-probabilities of every token of a choice, not only the first":
                lambda: choice_logprobs(model, prompt, choices, first_only=True),
            "sum the log-probabilities (the log of the choice's probability), not their mean":
                lambda: choice_logprobs(model, prompt, choices, mean=True),
            "turn the logits into log-probabilities first: log_softmax over the vocabulary":
                lambda: choice_logprobs(model, prompt, choices, normalised=False),
        }, "score[i] = sum over j of log softmax(logits at position len(prompt) - 1 + j)[choices[i][j]], "
           "the model run on prompt + choices[i]")
        expect_close(got, choice_logprobs(model, prompt, choices), case=case, hint=hint, atol=1e-4)
    model, prompt, choices = tiny_gpt(seed=9, dropout=0.5).train(), ids(4), [ids(3), ids(2)]
    case = f"a Llama-style model with dropout 0.5, in training mode, prompt {prompt}, choices {choices}"
    got = attempt(answer, model, prompt, choices, case=case)
    expect_close(got, choice_logprobs(model, prompt, choices), case=case, atol=1e-4, hint=(
        "score with dropout off: `with llmscratch.model.gpt.evaluating(model):` switches to eval mode and back"))
    expect_equal(model.training, True, case=case + ": the model's mode afterwards", hint=(
        "put the model back in the mode you found it in: `with evaluating(model):` does that, even after an error"))
    return len(cases) + 1


def _lora_embedding(answer, embedding: nn.Embedding, rank: int, alpha: float, case: str):
    """The reader's module, its lora_a and lora_b, checked: shapes, only they train, ``weight`` is the embedding's."""
    module = build_module(answer, embedding, rank, alpha, case=case,
                          hint="subclass torch.nn.Module (super().__init__() first)")
    vocab, dim = embedding.weight.shape
    a, b = getattr(module, "lora_a", None), getattr(module, "lora_b", None)
    if not (isinstance(a, nn.Parameter) and isinstance(b, nn.Parameter) and a.shape == (rank, vocab)
            and b.shape == (dim, rank)):
        raise Mismatch(case, f"Parameters lora_a ({rank}, {vocab}) and lora_b ({dim}, {rank})",
                       f"lora_a {describe(a)}, lora_b {describe(b)}", "as in LoRALinear: A (rank, in) and B (out, "
                       "rank), where an embedding's input is a one-hot vector of num_embeddings")
    trainable = [p for p in module.parameters() if p.requires_grad]
    expect_equal(sum(p.numel() for p in trainable), a.numel() + b.numel(), case=case + ": trainable numbers",
                 hint="freeze the wrapped embedding (requires_grad_(False)): only A and B train")
    if getattr(module, "weight", None) is not embedding.weight:
        raise Mismatch(case, "module.weight: the wrapped embedding's weight", describe(getattr(module, "weight", None)),
                       "expose the wrapped embedding's matrix as `weight` (a property): GPT reads "
                       "model.token_embedding.weight (for its KV caches, and a tied lm_head shares it)")
    return module, a, b


@CHAPTER.exercise("LoRAEmbedding", title="LoRA on the token embedding", difficulty="hard",
                  section="3. LoRA: finetuning a few low-rank matrices", kind="extend the package")
def check_lora_embedding(answer) -> int:
    generator = torch.Generator().manual_seed(6)
    cases = [(5, 3, 1, 2.0, (1, 1)), (10, 4, 2, 8.0, (2, 3)), (VOCAB, 16, 4, 2.0, (3, 5))]  # (V, d, rank, alpha, idx)
    cases = [(case[0], *case, generator) for case in cases]  # the weights' seed (V) first, the draws' source last
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(random_seed(fresh), random_int(fresh, 2, VOCAB), random_int(fresh, 1, 16), random_int(fresh, 1, 8),
               random_float(fresh, 1.0, 16.0, 1), (random_int(fresh, 1, 3), random_int(fresh, 1, 6)), fresh)
              for _ in range(2)]
    for seed, vocab, dim, rank, alpha, shape, source in cases:
        torch.manual_seed(seed)
        embedding = nn.Embedding(vocab, dim)
        idx = token_ids(shape, source, vocab=vocab)
        case = f"LoRAEmbedding(nn.Embedding({vocab}, {dim}), rank={rank}, alpha={alpha:g}), idx {idx.tolist()}"
        module, a, b = _lora_embedding(answer, embedding, rank, alpha, case)
        weight = embedding.weight.detach().clone()
        expect_close(attempt(module, idx, case=case), embedding(idx), case=case + ", freshly made", hint=(
            "the update must start at zero (B = 0, as in LoRALinear), so that the wrapped model starts as the base"))
        with torch.no_grad():
            a.copy_(torch.randn(a.shape, generator=source))
            b.copy_(torch.randn(b.shape, generator=source))
        got = attempt(module, idx, case=case + ", with random A and B")
        hint = diagnose(got, {
            "scale the update by alpha / rank": lambda: lora_lookup(weight, a, b, idx, 1.0),
            "the scale is alpha / rank, not rank / alpha": lambda: lora_lookup(weight, a, b, idx, rank / alpha),
            "add the base embedding: base(idx) + (alpha / rank) * A[:, idx]^T B^T":
                lambda: lora_lookup(torch.zeros_like(weight), a, b, idx, alpha / rank),
        }, "out = base(idx) + (alpha / rank) * (A^T)[idx] @ B^T: token i's update is column i of B @ A")
        expect_close(got, lora_lookup(weight, a, b, idx, alpha / rank), case=case + ", with random A and B", hint=hint)
    return len(cases) + _check_lora_embedding_in_gpt(answer, generator)


def _check_lora_embedding_in_gpt(answer, generator: torch.Generator) -> int:
    model, idx = tiny_gpt(seed=7).requires_grad_(False), token_ids((2, 9), generator, end_at=(1, 3))
    embedding = model.token_embedding
    case = "a Llama-style GPT whose token_embedding is LoRAEmbedding(model.token_embedding, 4, 8.0), B made random"
    model.token_embedding, a, b = _lora_embedding(answer, embedding, 4, 8.0, case)
    with torch.no_grad():
        b.normal_(generator=generator)
    case += ": model(idx, targets=...).backward()"
    attempt(lm_backward, model, idx, case=case)
    grads = [a.grad, b.grad]
    if any(grad is None or not grad.abs().sum() > 0 for grad in grads) or embedding.weight.grad is not None:
        raise Mismatch(case, "gradients on lora_a and lora_b, none on the embedding", f"lora_a, lora_b: "
                       f"{[describe(g) for g in grads]}, embedding: {describe(embedding.weight.grad)}",
                       "A and B must be Parameters used in forward; the wrapped embedding stays frozen")
    case = "the same GPT: prefill 4 tokens, then decode one at a time with KV caches"
    with torch.no_grad():
        expect_close(attempt(decoded, model, idx, 4, case=case), model(idx), case=case,
                     hint="decoding must match the full pass")
    return 3


def _training_run(model: GPT, data: torch.Tensor, losses: list[float]):
    """batches(epoch) and an evaluate() that returns the scripted losses and keeps the weights it saw."""
    seen = []

    def batches(epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
        return [(data[rows, :-1], data[rows, 1:]) for rows in order.split(2)]

    def evaluate() -> dict[str, float]:
        seen.append(flat_parameters(model))
        return {"loss": losses[min(len(seen), len(losses)) - 1]}

    return batches, evaluate, seen


def _check_history(got, want: list[dict], case: str) -> None:
    """The reader's history must be fit's, record for record, up to the last epoch trained."""
    hint = ("return the history as fit does, up to the last epoch trained: {'epoch': 0, 'val_loss': ...} first, "
            "then {'epoch': e, 'train_loss': the mean of its batches' losses, 'val_loss': evaluate()['loss']}")
    try:  # (epoch, val_loss, train_loss) per record; epoch 0 has no train_loss
        got, want = (torch.tensor([[r["epoch"], r["val_loss"], r["train_loss"] if r["epoch"] else -1.0]
                                   for r in records], dtype=torch.float64).reshape(-1, 3) for records in (got, want))
    except (TypeError, KeyError, IndexError, ValueError, RuntimeError):
        raise Mismatch(case + ": the history", "a list of records (dicts)", describe(got), hint) from None
    expect_close(got, want, case=case + ": the history, (epoch, val_loss, train_loss) per record", hint=hint)


@CHAPTER.exercise("fit_early_stopping", title="Early stopping on the validation loss, keeping the best weights",
                  difficulty="hard", section="1.6 Finetuning", kind="extend the package")
def check_fit_early_stopping(answer) -> int:
    data = torch.randint(VOCAB, (4, 9), generator=torch.Generator().manual_seed(8))
    cases = [([1.0, 0.9, 0.95, 0.8], 1), ([1.0, 1.1, 1.2, 0.5], 2), ([1.0, 0.9, 0.9, 0.8], 1),
             ([1.0, 0.8, 0.85, 0.7, 0.75, 0.76, 0.5], 2), ([1.0, 0.9, 0.8], 5)]  # (losses of epochs 0.., patience)
    fresh = fresh_generator()  # and cases no table of the fixed ones holds: ties are likely at 0.05 steps
    cases += [([1.0] + [round(0.05 * random_int(fresh, 10, 24), 2) for _ in range(random_int(fresh, 1, 4))],
               random_int(fresh, 1, 3)) for _ in range(2)]
    for losses, patience in cases:
        config = FinetuneConfig(epochs=len(losses) - 1, batch_size=2, lr=1e-2, warmup_fraction=0.25, seed=0)
        case = f"validation losses {losses} (epoch 0 first), patience={patience}, epochs={config.epochs}"
        reference = tiny_gpt(seed=8)
        batches, evaluate, expected = _training_run(reference, data, losses)
        history = fit(reference, batches, lm_loss, config, CPU, evaluate=evaluate, progress=False)
        model = tiny_gpt(seed=8)
        batches, evaluate, seen = _training_run(model, data, losses)
        got = attempt(answer, model, batches, lm_loss, config, CPU, evaluate=evaluate, patience=patience, case=case)
        trained, best = early_stop(losses, patience, config.epochs)
        hint = diagnose(len(seen) - 1, {
            "a tie is no improvement: count an epoch as better only when its loss is strictly lower":
                lambda: early_stop(losses, patience, config.epochs, strict=False)[0],
            "you stopped one epoch late: stop as soon as `patience` epochs in a row have not improved":
                lambda: early_stop(losses, patience + 1, config.epochs)[0],
            "you stopped one epoch early: `patience` epochs without improvement are allowed before stopping":
                lambda: early_stop(losses, patience - 1, config.epochs)[0] if patience > 1 else None,
            "patience counts epochs in a row: reset the count when the loss improves":
                lambda: early_stop(losses, patience, config.epochs, reset=False)[0],
        }, f"train epoch after epoch, evaluate() after each; stop after epoch {trained} here")
        expect_equal(len(seen) - 1, trained, case=case + ": epochs trained (evaluate() calls - 1)", hint=hint)
        for epoch in range(1, trained + 1):
            expect_close(seen[epoch], expected[epoch], atol=1e-6, case=f"{case}: the weights after epoch {epoch}",
                         hint="train each epoch as fit does: one OptimizerStep call per batch, epoch e's batches from "
                         "batches(e - 1)" if epoch == 1 else "make one OptimizerStep for the whole run, with "
                         "config.train_config(steps per epoch): its schedule and AdamW's moments run on across epochs")
        _check_history(got, history[: trained + 1], case)
        final = flat_parameters(model)
        hint = diagnose(final, {
            "restore the best epoch's weights, not the last ones; keep a copy, copy.deepcopy(model.state_dict()): "
            "state_dict() alone shares storage with the weights, which go on training": lambda: seen[trained],
        }, f"load the weights of the epoch with the lowest validation loss (epoch {best} here; epoch 0 counts)")
        expect_close(final, expected[best], atol=1e-6, case=case + ": the weights at the end", hint=hint)
    return len(cases)
