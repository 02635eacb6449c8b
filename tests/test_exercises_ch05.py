"""Chapter 5's exercise checks: the worked answers pass, plausible wrong answers fail with the right hint."""

import copy
import functools

import torch
from exercise_suite import ExerciseSuite, solutions
from torch import nn

from llmscratch.exercises import ch05
from llmscratch.exercises.ch05_references import early_stop, instruction_rows
from llmscratch.finetuning.instruct import collate
from llmscratch.model.losses import IGNORE_INDEX
from llmscratch.training.optim import OptimizerStep

sol = solutions(ch05)


def verdict(answer, name):
    return ch05.CHAPTER.check(answer, name, quiet=True)


# --------------------------------------------------------------------------- wrong answers
def scores_with(slip):
    """classification_scores with one slip: precision and recall swapped, F1 as a plain mean, no 0 / 0 guard, ham."""
    def answer(predictions, labels):
        if slip == "ham":
            return sol.classification_scores([1 - p for p in predictions], [1 - y for y in labels]) | {
                "accuracy": sol.classification_scores(predictions, labels)["accuracy"]}
        scores = sol.classification_scores(predictions, labels)
        if slip == "swapped":
            scores["precision"], scores["recall"] = scores["recall"], scores["precision"]
        if slip == "mean":
            scores["f1"] = (scores["precision"] + scores["recall"]) / 2
        if slip == "unguarded":
            true_spam = sum(p == 1 and y == 1 for p, y in zip(predictions, labels))
            scores["precision"] = true_spam / sum(p == 1 for p in predictions)
        return scores
    return answer


def collate_with(mask_extra=0, pad_input=None, pad_target=IGNORE_INDEX, eos=True, mask=True, dtype=torch.long):
    """collate_masked as a first attempt often writes it, each usual slip a switch."""
    def answer(pairs, eos_id):
        rows = [[*prompt, *response] + ([eos_id] if eos else []) for prompt, response in pairs]
        width = max(len(row) for row in rows) - 1
        inputs = torch.full((len(rows), width), eos_id if pad_input is None else pad_input, dtype=dtype)
        targets = torch.full((len(rows), width), pad_target, dtype=dtype)
        for i, ((prompt, _), row) in enumerate(zip(pairs, rows)):
            inputs[i, : len(row) - 1], targets[i, : len(row) - 1] = torch.tensor(row[:-1]), torch.tensor(row[1:])
            targets[i, : (len(prompt) - 1 + mask_extra) if mask else 0] = IGNORE_INDEX
        return inputs, targets
    return answer


def merge_with(scale=lambda layer: layer.alpha / layer.rank, in_place=False, bias=True, transposed=False):
    def answer(layer):
        base, update = layer.base, layer.lora_b @ layer.lora_a
        update = scale(layer) * (layer.lora_a.T @ layer.lora_b.T if transposed else update)
        if in_place:
            with torch.no_grad():
                base.weight += update
            return base
        merged = nn.Linear(base.in_features, base.out_features, bias=bias and base.bias is not None)
        with torch.no_grad():
            merged.weight.copy_(base.weight + update)
            if merged.bias is not None:
                merged.bias.copy_(base.bias)
        return merged
    return answer


def score_with(shift=1, first_only=False, mean=False, raw=False, switch_to_eval=False):
    """score_choices with one slip; without switch_to_eval it scores in whatever mode the model is in."""
    @torch.no_grad()
    def answer(model, prompt, choices):
        if switch_to_eval:
            model.eval()
        scores = []
        for choice in choices:
            logits = model(torch.tensor([prompt + choice]))[0]
            logp = logits if raw else torch.log_softmax(logits, dim=-1)
            picked = logp[torch.arange(len(prompt), len(prompt) + len(choice)) - shift, torch.tensor(choice)]
            picked = picked[:1] if first_only else picked
            scores.append(picked.mean() if mean else picked.sum())
        return torch.stack(scores)
    return answer


class LoRAEmbeddingUnscaled(sol.LoRAEmbedding):
    def forward(self, idx):
        return self.base(idx) + self.lora_a.T[idx] @ self.lora_b.T


class LoRAEmbeddingNotFrozen(sol.LoRAEmbedding):
    def __init__(self, embedding, rank, alpha):
        super().__init__(embedding, rank, alpha)
        embedding.requires_grad_(True)


class LoRAEmbeddingBothRandom(sol.LoRAEmbedding):
    def __init__(self, embedding, rank, alpha):
        super().__init__(embedding, rank, alpha)
        nn.init.normal_(self.lora_b)


class LoRAEmbeddingNoWeight(nn.Module):
    """Holds the adapters but hides the embedding's weight (no `weight` property)."""

    def __init__(self, embedding, rank, alpha):
        super().__init__()
        self.inner = sol.LoRAEmbedding(embedding, rank, alpha)
        self.lora_a, self.lora_b = self.inner.lora_a, self.inner.lora_b

    def forward(self, idx):
        return self.inner(idx)


def early_stopping_with(patience_slack=0, strict=True, reset=True, copy_state=True, restore=True, fresh_steps=False):
    """fit_early_stopping with one slip: patience off by one, a tie as improvement, no reset, no copy, ..."""
    def answer(model, batches, loss_fn, config, device, evaluate, patience):
        first = batches(0)

        def new_step():
            return OptimizerStep(model, config.train_config(len(first)), device, advice="lower the learning rate")

        optimizer_step, batch_loss = new_step(), functools.partial(loss_fn, model)
        history = [{"epoch": 0, "val_loss": evaluate()["loss"]}]
        best, state, waited = history[0]["val_loss"], copy.deepcopy(model.state_dict()), 0
        for epoch in range(1, config.epochs + 1):
            optimizer_step = new_step() if fresh_steps and epoch > 1 else optimizer_step
            losses = [optimizer_step([b], batch_loss)[0] for b in (first if epoch == 1 else batches(epoch - 1))]
            history.append({"epoch": epoch, "train_loss": sum(losses) / len(losses), "val_loss": evaluate()["loss"]})
            loss = history[-1]["val_loss"]
            if loss < best or (not strict and loss == best):
                best, waited = loss, 0 if reset else waited
                state = copy.deepcopy(model.state_dict()) if copy_state else model.state_dict()
            else:
                waited += 1
                if waited == patience + patience_slack:
                    break
        if restore:
            model.load_state_dict(state)
        return history
    return answer


WRONG = [  # (exercise, wrong answer, the smallest failing input it must report, the hint it must get)
    ("last_token_logits", lambda logits, lengths: logits[:, -1], "lengths [1]", "you read the last column"),
    ("last_token_logits", lambda logits, lengths: logits[torch.arange(len(lengths)), lengths], "lengths [1]",
     "off by one"),
    ("last_token_logits", lambda logits, lengths: logits[:, lengths - 1], "lengths [1]",
     "index rows and positions together"),
    ("classification_scores", scores_with("swapped"), "predictions [1, 1, 0]", "swapped"),
    ("classification_scores", scores_with("mean"), "predictions [1, 1, 0]", "harmonic mean"),
    ("classification_scores", scores_with("unguarded"), "predictions [0], labels [0]", "guard each division"),
    ("classification_scores", scores_with("ham"), "predictions [1], labels [1]", "spam (class 1) is the positive"),
    ("collate_masked", collate_with(mask_extra=1), "([([40], [62])]", "you also hid the first answer token"),
    ("collate_masked", collate_with(mask=False), "([([10, 39], [62])]", "mask the prompt"),
    ("collate_masked", collate_with(pad_target=63), "the targets", "pad the targets with -100"),
    ("collate_masked", collate_with(pad_input=0), "the inputs", "pad the inputs with eos_id"),
    ("collate_masked", collate_with(eos=False), "([([40], [62])]", "end every row with eos_id"),
    ("collate_masked", collate_with(dtype=torch.int32), "([([40], [62])]", "exactly torch.long (int64)"),
    ("merged_linear", merge_with(scale=lambda layer: 1.0), "nn.Linear(3, 2, bias=True), rank=1", "scale the update"),
    ("merged_linear", merge_with(scale=lambda layer: layer.rank / layer.alpha), "rank=1, alpha=2",
     "not rank / alpha"),
    ("merged_linear", merge_with(transposed=True), "nn.Linear(3, 2", "the update is B @ A, of shape (out, in)"),
    ("merged_linear", merge_with(in_place=True), "nn.Linear(3, 2", "leave the LoRA layer's base weight"),
    ("merged_linear", merge_with(bias=False), "nn.Linear(3, 2, bias=True)", "keep the base layer's bias"),
    ("score_choices", score_with(shift=0), "prompt [5], choices [[7]]", "off by one"),
    ("score_choices", score_with(first_only=True), "choices [[10, 11]", "not only the first"),
    ("score_choices", score_with(mean=True), "choices [[10, 11]", "not their mean"),
    ("score_choices", score_with(raw=True), "prompt [5], choices [[7]]", "log_softmax over the vocabulary"),
    ("score_choices", score_with(), "dropout 0.5, in training mode", "score with dropout off"),
    ("score_choices", score_with(switch_to_eval=True), "the model's mode afterwards", "put the model back"),
    ("LoRAEmbedding", LoRAEmbeddingUnscaled, "nn.Embedding(5, 3), rank=1", "scale the update by alpha / rank"),
    ("LoRAEmbedding", LoRAEmbeddingNotFrozen, "nn.Embedding(5, 3)", "freeze the wrapped embedding"),
    ("LoRAEmbedding", LoRAEmbeddingBothRandom, "freshly made", "the update must start at zero"),
    ("LoRAEmbedding", LoRAEmbeddingNoWeight, "nn.Embedding(5, 3)", "expose the wrapped embedding's matrix"),
    ("fit_early_stopping", early_stopping_with(patience_slack=1), "[1.0, 0.9, 0.95, 0.8]", "one epoch late"),
    ("fit_early_stopping", early_stopping_with(strict=False), "[1.0, 0.9, 0.9, 0.8]", "a tie is no improvement"),
    ("fit_early_stopping", early_stopping_with(reset=False), "patience=2, epochs=6", "reset the count"),
    ("fit_early_stopping", early_stopping_with(copy_state=False), "the weights at the end", "copy.deepcopy"),
    ("fit_early_stopping", early_stopping_with(restore=False), "the weights at the end", "not the last ones"),
    ("fit_early_stopping", early_stopping_with(fresh_steps=True), "the weights after epoch 2",
     "one OptimizerStep for the whole run"),
]


class TestChapter5(ExerciseSuite):
    chapter, folder, wrong = ch05, "ch05-finetuning", WRONG
    slow = {"fit_early_stopping", "score_choices"}


# --------------------------------------------------------------------------- chapter 5 only
def test_the_references_of_the_usual_mistakes_start_from_the_package():
    # The checker's own construction of a batch, without a slip, is the package's collate.
    pairs = [([1, 2, 3], [4]), ([5], [6, 7, 8, 9]), ([10, 11], [12, 13])]
    for got, expected in zip(instruction_rows(pairs, 63), collate(pairs, 63, mask_prompt=True)):
        assert torch.equal(got, expected)
    assert early_stop([1.0, 0.8, 0.85, 0.7, 0.75, 0.76, 0.5], patience=2, epochs=6) == (5, 3)


def test_a_wrong_answer_that_is_no_module_or_raises_is_a_verdict_not_a_traceback():
    assert "subclass torch.nn.Module" in verdict(lambda embedding, rank, alpha: "a string", "LoRAEmbedding").detail
    assert "ZeroDivisionError" in verdict(lambda *args, **kwargs: 1 / 0, "fit_early_stopping").detail
    history = verdict(lambda *args, **kwargs: "no history", "fit_early_stopping")
    assert history.status == "failed" and "epochs trained" in history.detail
    assert "return the two tensors" in verdict(lambda pairs, eos_id: None, "collate_masked").detail
    assert "keys" in verdict(lambda predictions, labels: [0.5], "classification_scores").detail
