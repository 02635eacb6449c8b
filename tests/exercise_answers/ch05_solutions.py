"""Worked answers to chapter 5's exercises, word for word the answer cells of ch05-finetuning/solutions.ipynb.

Each ``# %%`` line starts one cell (the percent format that editors run as notebook cells);
``python -m llmscratch.exercises ch05 tests/exercise_answers/ch05_solutions.py`` passes every row.
"""

# %% imports
import copy
import functools

import torch
from torch import nn

from llmscratch.model.gpt import evaluating
from llmscratch.model.losses import IGNORE_INDEX
from llmscratch.training.optim import OptimizerStep


# %% last_token_logits
def last_token_logits(logits, lengths):
    """Row b of logits (B, T, C) at position lengths[b] - 1, its last real token: (B, C)."""
    rows = torch.arange(logits.size(0), device=logits.device)  # (B,)
    return logits[rows, lengths - 1]  # (B, C): one (row, position) pair per row

# %% classification_scores
def classification_scores(predictions, labels):
    """Accuracy, and the precision, recall and F1 of the spam class (1); a ratio of 0 / 0 is 0."""
    true_spam = sum(p == 1 and y == 1 for p, y in zip(predictions, labels))
    flagged = sum(p == 1 for p in predictions)  # predicted spam
    spam = sum(y == 1 for y in labels)  # really spam
    precision = true_spam / flagged if flagged else 0.0
    recall = true_spam / spam if spam else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    accuracy = sum(p == y for p, y in zip(predictions, labels)) / len(labels)
    return {"accuracy": accuracy, "precision": precision, "recall": recall, "f1": f1}

# %% collate_masked
def collate_masked(pairs, eos_id):
    """Inputs and targets (B, T) of prompt + answer + <|endoftext|>, the prompt's targets set to -100."""
    rows = [[*prompt, *answer, eos_id] for prompt, answer in pairs]
    width = max(len(row) for row in rows) - 1  # inputs and targets are one shorter than their row
    inputs = torch.full((len(rows), width), eos_id, dtype=torch.long)  # (B, T), padded with eos_id
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)  # (B, T), padded with -100
    for i, ((prompt, _), row) in enumerate(zip(pairs, rows)):
        inputs[i, : len(row) - 1] = torch.tensor(row[:-1])
        targets[i, : len(row) - 1] = torch.tensor(row[1:])  # target t is token t + 1
        targets[i, : len(prompt) - 1] = IGNORE_INDEX  # targets 0 .. len(prompt) - 2 are prompt tokens
    return inputs, targets

# %% merged_linear
def merged_linear(layer):
    """A plain nn.Linear computing what the LoRALinear `layer` computes: W + (alpha / rank) B A, new storage."""
    base = layer.base
    merged = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                       device=base.weight.device, dtype=base.weight.dtype)
    with torch.no_grad():
        update = layer.alpha / layer.rank * (layer.lora_b @ layer.lora_a)  # (out, rank) @ (rank, in)
        merged.weight.copy_(base.weight + update)  # a new matrix: the base (maybe tied) stays as it was
        if base.bias is not None:
            merged.bias.copy_(base.bias)
    return merged

# %% score_choices
@torch.no_grad()
def score_choices(model, prompt_ids, choices):
    """log p(choice | prompt) for each choice (a list of ids), summed over its tokens: (n_choices,)."""
    device = next(model.parameters()).device
    scores = []
    with evaluating(model):  # dropout off, then back to the mode the model was in
        for choice in choices:
            ids = torch.tensor([list(prompt_ids) + list(choice)], device=device)  # (1, P + C)
            logp = torch.log_softmax(model(ids)[0].double(), dim=-1)  # (P + C, V)
            positions = torch.arange(len(prompt_ids) - 1, ids.size(1) - 1, device=device)  # (C,) predict the choice
            scores.append(logp[positions, ids[0, len(prompt_ids):]].sum())
    return torch.stack(scores)  # (n_choices,)

# %% LoRAEmbedding
class LoRAEmbedding(nn.Module):
    """A frozen nn.Embedding plus a trainable low-rank update: row i gains (alpha / rank) * column i of B A."""

    def __init__(self, embedding, rank, alpha):
        super().__init__()
        self.base = embedding
        self.base.requires_grad_(False)
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        vocab, dim = embedding.weight.shape
        factory = dict(device=embedding.weight.device, dtype=embedding.weight.dtype)
        self.lora_a = nn.Parameter(torch.randn(rank, vocab, **factory))  # (rank, V): random, as nn.Embedding's
        self.lora_b = nn.Parameter(torch.zeros(dim, rank, **factory))  # (d, rank): zero, so no update at first

    @property
    def weight(self):
        return self.base.weight  # what GPT reads as model.token_embedding.weight (and a tied lm_head shares)

    def forward(self, idx):
        update = self.lora_a.T[idx] @ self.lora_b.T  # (..., rank) @ (rank, d) -> (..., d)
        return self.base(idx) + self.scaling * update  # (..., d)

    def merged(self):
        """A plain nn.Embedding with the update folded into a new table."""
        vocab, dim = self.base.weight.shape
        merged = nn.Embedding(vocab, dim, device=self.base.weight.device, dtype=self.base.weight.dtype)
        with torch.no_grad():
            merged.weight.copy_(self.base.weight + self.scaling * (self.lora_b @ self.lora_a).T)  # (V, d)
        return merged

# %% fit_early_stopping
def fit_early_stopping(model, batches, loss_fn, config, device, evaluate, patience):
    """fit, stopped once the validation loss has not improved for `patience` epochs in a row; keeps the best weights."""
    first = batches(0)
    optimizer_step = OptimizerStep(model, config.train_config(len(first)), device, advice="try a lower learning rate")
    batch_loss = functools.partial(loss_fn, model)
    history = [{"epoch": 0, "val_loss": evaluate()["loss"]}]
    best_loss, best_state, waited = history[0]["val_loss"], copy.deepcopy(model.state_dict()), 0
    for epoch in range(1, config.epochs + 1):
        model.train()
        losses = [optimizer_step([batch], batch_loss)[0] for batch in (first if epoch == 1 else batches(epoch - 1))]
        history.append({"epoch": epoch, "train_loss": sum(losses) / len(losses), "val_loss": evaluate()["loss"]})
        if history[-1]["val_loss"] < best_loss:  # strictly lower: a tie is no improvement
            best_loss, best_state, waited = history[-1]["val_loss"], copy.deepcopy(model.state_dict()), 0
        else:
            waited += 1
            if waited == patience:
                break
    model.load_state_dict(best_state)
    model.eval()
    return history
