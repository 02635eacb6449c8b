"""Chapter 5's references: what the right answer and each usual mistake compute, written out.

``llmscratch.exercises.ch05`` compares a reader's answer with these to name the mistake it reproduces:
each function is the plain computation, and each keyword switch one usual slip.
"""

import torch

from llmscratch.model.gpt import GPT, evaluating
from llmscratch.model.losses import IGNORE_INDEX

__all__ = ["choice_logprobs", "early_stop", "instruction_rows", "lora_lookup"]


def instruction_rows(pairs, eos_id: int, masked=lambda n: n - 1, pad_input=None, pad_target=IGNORE_INDEX,
                     stop_target=True, eos=True):
    """Inputs and targets of prompt + answer + eos rows, each usual mistake a switch: ``masked(len(prompt))``
    targets hidden at the start of each row, the pads, whether the row ends in eos and that target stays."""
    rows = [[*prompt, *answer, *([eos_id] if eos else [])] for prompt, answer in pairs]
    width = max(len(row) for row in rows) - 1
    inputs = torch.full((len(rows), width), eos_id if pad_input is None else pad_input)  # (B, T)
    targets = torch.full((len(rows), width), pad_target)  # (B, T)
    for i, ((prompt, _), row) in enumerate(zip(pairs, rows)):
        inputs[i, : len(row) - 1] = torch.tensor(row[:-1])
        targets[i, : len(row) - 1] = torch.tensor(row[1:])
        targets[i, : masked(len(prompt))] = IGNORE_INDEX
        if not stop_target:
            targets[i, len(row) - 2] = pad_target
    return inputs, targets


def choice_logprobs(model: GPT, prompt: list[int], choices: list[list[int]], *, shift: int = 1, first_only=False,
                     mean=False, normalised=True) -> torch.Tensor:
    """log p(choice | prompt) summed over each choice's tokens in float64; each usual mistake a switch."""
    scores = []
    with evaluating(model), torch.no_grad():
        for choice in choices:
            logits = model(torch.tensor([prompt + choice]))[0].double()  # (P + C, V)
            logp = torch.log_softmax(logits, dim=-1) if normalised else logits
            positions = torch.arange(len(prompt), len(prompt) + len(choice)) - shift  # where each token is predicted
            picked = logp[positions, torch.tensor(choice)][: 1 if first_only else None]  # (C,)
            scores.append(picked.mean() if mean else picked.sum())
    return torch.stack(scores)  # (n_choices,)


def lora_lookup(weight, a, b, idx, scale) -> torch.Tensor:
    return (weight.double()[idx] + scale * a.double().T[idx] @ b.double().T).float()  # (..., d)


def early_stop(losses: list[float], patience: int, epochs: int, strict=True, reset=True) -> tuple[int, int]:
    """(epochs trained, best epoch) of early stopping on scripted validation losses; each usual mistake a switch."""
    best, waited = 0, 0
    for epoch in range(1, epochs + 1):
        if losses[epoch] < losses[best] or (not strict and losses[epoch] == losses[best]):
            best, waited = epoch, 0 if reset else waited
        else:
            waited += 1
        if waited >= patience:
            return epoch, best
    return epochs, best
