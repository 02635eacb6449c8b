"""Classification finetuning: a GPT whose language-model head becomes a small classification head.

A causal model's last token is the only one that has attended to the whole text, so its
output is the one we classify. Texts are padded on the right, per batch: padding comes after
the last real token, so (with causal attention) it cannot change that token's output.
"""

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llmscratch.assets import SMS_SPAM_PATH
from llmscratch.device import autocast
from llmscratch.finetuning.lora import lora_layers
from llmscratch.model.checkpoint import config_from_dict, load_checkpoint, load_model_state, save_checkpoint
from llmscratch.model.gpt import GPT, evaluating
from llmscratch.text.corpus import read_text_file
from llmscratch.text.hf_tokenizer import tokenizer_from_json
from llmscratch.text.tokenizer import BPETokenizer

SPAM_LABELS = ("ham", "spam")  # class 0, class 1 (the positive class)


# --------------------------------------------------------------------------- data
def balanced_splits(examples: Sequence[tuple[str, int]], fractions: Sequence[float] = (0.7, 0.1, 0.2),
                    seed: int = 123, names: Sequence[str] | None = None) -> dict[str, list[tuple[str, int]]]:
    """Train/validation/test splits with every class equally often in each.

    Duplicate texts are dropped first (so no text sits in two splits), then every class is
    cut down to the size of the smallest one by a seeded random choice. ValueError if a class
    is too small to put one example in every split; ``names`` (one per class) label the message.
    """
    if len(fractions) != 3 or any(f <= 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-9:
        raise ValueError(f"fractions must be three positive numbers summing to 1, got {tuple(fractions)}")
    by_class: dict[int, list[str]] = {}
    for text, label in dict(examples).items():  # keeps one (the last) label per distinct text
        by_class.setdefault(label, []).append(text)
    if len(by_class) < 2:
        raise ValueError(f"need examples of at least two classes, got classes {sorted(by_class)}")

    def sizes(per_class: int) -> tuple[int, int, int]:  # examples of each class in train, validation, test
        n_train, n_val = int(fractions[0] * per_class), int(fractions[1] * per_class)
        return n_train, n_val, per_class - n_train - n_val

    per_class = min(len(texts) for texts in by_class.values())
    if min(sizes(per_class)) < 1:
        needed = next(k for k in range(per_class, 10**6) if min(sizes(k)) >= 1)
        counts = " and ".join(f"{len(by_class[label]):,} {names[label] if names else f'of class {label}'}"
                              for label in sorted(by_class))
        raise ValueError(f"too few examples: {counts} (distinct texts); every class needs at least {needed} "
                         f"to give each split (fractions {tuple(fractions)}) one example of it")
    rng = random.Random(seed)
    splits: dict[str, list[tuple[str, int]]] = {"train": [], "validation": [], "test": []}
    n_train, n_val, _ = sizes(per_class)
    for label in sorted(by_class):
        texts = rng.sample(sorted(by_class[label]), per_class)
        splits["train"] += [(t, label) for t in texts[:n_train]]
        splits["validation"] += [(t, label) for t in texts[n_train:n_train + n_val]]
        splits["test"] += [(t, label) for t in texts[n_train + n_val:]]
    for split in splits.values():
        rng.shuffle(split)
    return splits


def read_labelled_texts(path: str | os.PathLike, labels: Sequence[str]) -> list[tuple[str, int]]:
    """(text, index of its label in ``labels``) per line of a ``label<TAB>text`` file.

    Empty lines are skipped; ValueError naming the file and line of anything else malformed.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"no labelled text file at {path}")
    lines = read_text_file(path).split("\n")  # not splitlines: texts may hold \x0c etc.
    examples = []
    for number, line in enumerate(lines, start=1):
        if not line:
            continue
        label, tab, text = line.partition("\t")
        if not tab:
            raise ValueError(f"{path}, line {number}: no tab in {line[:40]!r}; expected label<TAB>text "
                             f"with a label in {tuple(labels)}")
        if label not in labels:
            raise ValueError(f"{path}, line {number}: label {label[:40]!r} is not one of {tuple(labels)}")
        if not text.strip():
            raise ValueError(f"{path}, line {number}: the text after the label is empty")
        examples.append((text, labels.index(label)))
    if not examples:
        raise ValueError(f"{path} holds no labelled lines (expected label<TAB>text per line)")
    return examples


def spam_splits(seed: int = 123, path: str | os.PathLike = SMS_SPAM_PATH) -> dict[str, list[tuple[str, int]]]:
    """Balanced 70/10/20 splits of the bundled SMS Spam Collection, or of another ham/spam TSV (1 = spam)."""
    return balanced_splits(read_labelled_texts(path, SPAM_LABELS), seed=seed, names=SPAM_LABELS)


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, T) cut to max_length and right-padded with pad_id to the longest, and lengths (B,)."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("every sequence in a batch needs at least one token")
    cut = [list(s[:max_length]) for s in sequences]
    longest = max(len(s) for s in cut)
    ids = torch.full((len(cut), longest), pad_id, dtype=torch.long)  # (B, T)
    for row, seq in enumerate(cut):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return ids, torch.tensor([len(s) for s in cut], dtype=torch.long)  # (B, T), (B,)


def make_batches(encoded: Sequence[tuple[list[int], int]], batch_size: int, pad_id: int, max_length: int,
                 shuffle_seed: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(ids (B, T), lengths (B,), labels (B,)) batches of encoded examples, optionally shuffled."""
    order = list(range(len(encoded)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    batches = []
    for start in range(0, len(order), batch_size):
        chosen = [encoded[i] for i in order[start : start + batch_size]]
        ids, lengths = pad_batch([ids for ids, _ in chosen], pad_id, max_length)
        batches.append((ids, lengths, torch.tensor([label for _, label in chosen], dtype=torch.long)))
    return batches


# --------------------------------------------------------------------------- model
class GPTClassifier(nn.Module):
    """A GPT with its language-model head replaced by a linear layer to ``n_classes`` outputs.

    A head tied to the token embedding is untied by the replacement; the embedding stays.
    """

    def __init__(self, gpt: GPT, n_classes: int):
        super().__init__()
        if n_classes < 2:
            raise ValueError(f"n_classes must be at least 2, got {n_classes}")
        self.n_classes = n_classes
        weight = gpt.lm_head.weight
        gpt.lm_head = nn.Linear(gpt.config.d_model, n_classes, device=weight.device, dtype=weight.dtype)
        self.gpt = gpt

    @property
    def head(self) -> nn.Linear:
        return self.gpt.lm_head

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Class logits (B, n_classes) read at the last real token of each row of ids (B, T)."""
        if lengths.min() < 1 or lengths.max() > ids.size(1):
            raise ValueError(f"lengths must be in 1..{ids.size(1)}, got {lengths.tolist()}")
        logits = self.gpt(ids)  # (B, T, n_classes): the head is applied at every position
        rows = torch.arange(ids.size(0), device=ids.device)  # (B,)
        return logits[rows, lengths.to(ids.device) - 1]  # (B, n_classes)


def classification_loss(model: GPTClassifier, batch) -> torch.Tensor:
    device = next(model.parameters()).device
    ids, lengths, labels = (t.to(device) for t in batch)
    return F.cross_entropy(model(ids, lengths).float(), labels)


# --------------------------------------------------------------------------- metrics
def classification_metrics(predictions: Sequence[int], labels: Sequence[int], n_classes: int = 2,
                           positive: int | None = 1) -> dict:
    """Accuracy, precision, recall, F1 and the confusion matrix (rows: true class, columns: predicted).

    Precision, recall and F1 are those of class ``positive``, or, with positive=None, their
    mean over the classes (macro average). A ratio with nothing to count (0/0) is 0.
    """
    if len(predictions) != len(labels) or not labels:
        raise ValueError(f"need as many predictions as labels, and at least one; got {len(predictions)}, {len(labels)}")
    confusion = [[0] * n_classes for _ in range(n_classes)]
    for predicted, true in zip(predictions, labels):
        confusion[true][predicted] += 1

    def ratio(a: int, b: int) -> float:
        return a / b if b else 0.0

    def scores(c: int) -> tuple[float, float, float]:
        true_pos = confusion[c][c]
        precision = ratio(true_pos, sum(row[c] for row in confusion))
        recall = ratio(true_pos, sum(confusion[c]))
        return precision, recall, ratio(2 * precision * recall, precision + recall)

    per_class = [scores(c) for c in ([positive] if positive is not None else range(n_classes))]
    precision, recall, f1 = (sum(s[i] for s in per_class) / len(per_class) for i in range(3))
    correct = sum(confusion[c][c] for c in range(n_classes))
    return {"accuracy": correct / len(labels), "precision": precision, "recall": recall, "f1": f1,
            "confusion": confusion}


@torch.no_grad()
def evaluate_classifier(model: GPTClassifier, batches, dtype: torch.dtype = torch.float32,
                        positive: int | None = 1) -> dict:
    """Mean loss and ``classification_metrics`` over batches, in eval mode."""
    device = next(model.parameters()).device
    predictions, labels, loss_sum = [], [], 0.0
    with evaluating(model):
        for ids, lengths, batch_labels in batches:
            with autocast(device, dtype):
                logits = model(ids.to(device), lengths.to(device)).float()  # (B, n_classes)
            loss_sum += F.cross_entropy(logits, batch_labels.to(device), reduction="sum").item()
            predictions += logits.argmax(-1).tolist()
            labels += batch_labels.tolist()
    metrics = classification_metrics(predictions, labels, model.n_classes, positive)
    return {"loss": loss_sum / len(labels), **metrics}


# --------------------------------------------------------------------------- using it
@dataclass
class Classifier:
    """A finetuned classifier with its tokenizer: ``classify(text)`` gives a label."""

    model: GPTClassifier
    tokenizer: BPETokenizer
    labels: tuple[str, ...]
    pad_id: int
    max_length: int

    @torch.no_grad()
    def probabilities(self, text: str) -> dict[str, float]:
        """The probability of each label for one text."""
        ids = self.tokenizer.encode(text, disallowed_special=())[: self.max_length] or [self.pad_id]
        device = next(self.model.parameters()).device
        with evaluating(self.model):
            logits = self.model(torch.tensor([ids], device=device), torch.tensor([len(ids)], device=device))  # (1, C)
        probs = torch.softmax(logits.float()[0], dim=-1).tolist()
        return dict(zip(self.labels, probs))

    def classify(self, text: str) -> str:
        probs = self.probabilities(text)
        return max(probs, key=probs.get)

    def save(self, path: str | os.PathLike) -> None:
        """One checkpoint file (atomic) with the weights, config, labels and tokenizer."""
        if lora_layers(self.model):
            raise ValueError("the model still has LoRA adapters: merge_lora(classifier.model) before saving")
        save_checkpoint(path, {
            "model": self.model.state_dict(), "model_config": self.model.gpt.config.to_dict(),
            "labels": list(self.labels), "pad_id": self.pad_id, "max_length": self.max_length,
            "tokenizer": self.tokenizer.to_json(),
        })

    @classmethod
    def load(cls, path: str | os.PathLike, map_location: str | torch.device = "cpu") -> "Classifier":
        """The classifier ``save`` wrote; ``load_checkpoint`` refuses a damaged file or broken weights."""
        state = load_checkpoint(path, map_location)
        if "labels" not in state:
            raise ValueError(f"{path} is a language model's checkpoint (it has no 'labels'), not a text classifier; "
                             f"give the classifier.pt that ch05-finetuning/finetune_classifier.py saves "
                             f"(Classifier.save)")
        model = GPTClassifier(GPT(config_from_dict(state["model_config"], str(path))), len(state["labels"]))
        load_model_state(model, state["model"])
        tokenizer = tokenizer_from_json(state["tokenizer"], source=str(Path(path)))
        return cls(model.to(map_location).eval(), tokenizer, tuple(state["labels"]), state["pad_id"],
                   state["max_length"])
