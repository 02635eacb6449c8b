"""Direct Preference Optimization (Rafailov et al., 2023): learn from pairs of answers, one preferred.

A preference record is ``{"instruction", "input", "chosen", "rejected"}`` (family and split
optional): two responses to one Alpaca prompt (``llmscratch.finetuning.instruct``), the first preferred.
DPO needs no reward model and no sampling. With log pi(y|x) the summed log-probability of a
response under the policy being trained and log ref(y|x) under a frozen reference model,

    reward(y) = beta * (log pi(y|x) - log ref(y|x))          the implicit reward
    loss      = -log sigmoid(reward(chosen) - reward(rejected))

The loss pushes the chosen response up and the rejected one down, relative to the reference.
beta is the strength of the pull back to the reference (the KL penalty of the RLHF objective
that DPO solves in closed form): small beta lets the policy drift far, large beta keeps it close.
The reference is a frozen copy of the starting model or, for a LoRA model, the same model with
its adapters off (``llmscratch.finetuning.lora.adapters_disabled``): no second copy.
"""

import copy
import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from llmscratch.device import autocast
from llmscratch.finetuning.instruct import collate, encode_records, validate_records
from llmscratch.finetuning.lora import adapters_disabled, lora_layers
from llmscratch.model.gpt import evaluating
from llmscratch.model.losses import IGNORE_INDEX

RESPONSES = ("chosen", "rejected")
Pair = tuple[list[int], list[int], list[int]]  # prompt ids, chosen response ids, rejected response ids


# --------------------------------------------------------------------------- records and batches
def validate_pairs(records) -> list[dict]:
    """The preference records, checked: ValueError naming the index and field of the first bad one.

    chosen and rejected must be non-blank strings; the rest as ``instruct.validate_records``.
    A record whose chosen and rejected responses are equal is allowed: it carries no preference,
    and its loss is log 2 with a zero gradient whatever the model.
    """
    # ValueError, not TypeError, for data of the wrong type too: scripts report ValueErrors as messages.
    if not isinstance(records, list):
        raise ValueError(f"preference data must be a list of records, got {type(records).__name__}")  # noqa: TRY004
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(f"record {index} is a {type(record).__name__}, expected an object with fields "  # noqa: TRY004
                             f"instruction, input, {', '.join(RESPONSES)}")
        for name in RESPONSES:
            problem = _response_problem(record, name)
            if problem:
                raise ValueError(f"record {index}: field {name!r} {problem}")
    for name in RESPONSES:  # the prompt fields, checked as instruction records are
        validate_records([{**record, "output": record[name]} for record in records])
    return records


def count_ties(records: Sequence[dict], source: str) -> int:
    """How many (validated) records carry no preference, their chosen equal to their rejected; ValueError naming
    ``source`` if all of them are such ties (training on them would change nothing)."""
    ties = sum(record["chosen"] == record["rejected"] for record in records)
    if records and ties == len(records):
        raise ValueError(f"{source}: in every one of its {len(records):,} pairs the chosen response equals the "
                         f"rejected one, so there is no preference to learn (DPO's gradient is zero); expected "
                         f"pairs of different responses")
    return ties


def _response_problem(record: dict, name: str) -> str | None:
    """What is wrong with a record's response field, or None."""
    if name not in record:
        return "is missing"
    if not isinstance(record[name], str):
        return f"must be a string, got {type(record[name]).__name__} {record[name]!r}"
    if not record[name].strip():
        return "is empty; a response needs at least one token"
    return None


def encode_pairs(records: Sequence[dict], tokenizer, context_length: int | None = None) -> list[Pair]:
    """(prompt ids, chosen ids, rejected ids) per record, each response encoded as ``instruct.encode_records`` does.

    With ``context_length``, prompt + response + <|endoftext|> must fit in context_length + 1
    tokens for both responses: ValueError naming the records that do not.
    """
    records = validate_pairs(list(records))
    encoded = {}
    for name in RESPONSES:
        try:
            encoded[name] = encode_records([{**r, "output": r[name]} for r in records], tokenizer, context_length)
        except ValueError as err:
            raise ValueError(f"{name} responses: {err}") from None
    return [(prompt, chosen, rejected)
            for (prompt, chosen), (_, rejected) in zip(encoded["chosen"], encoded["rejected"])]


@dataclasses.dataclass(frozen=True)
class PreferenceBatch:
    """B pairs as 2B rows: rows :B are prompt + chosen response, rows B: prompt + rejected response.

    targets are the next-token ids of the responses and their <|endoftext|>, IGNORE_INDEX on
    the prompt and the padding. reference_logprobs (2B,), once computed (``precompute_reference``).
    """

    inputs: torch.Tensor  # (2B, T)
    targets: torch.Tensor  # (2B, T)
    reference_logprobs: torch.Tensor | None = None  # (2B,)

    @property
    def n_pairs(self) -> int:
        return self.inputs.size(0) // 2


def collate_pairs(pairs: Sequence[Pair], eos_id: int, max_length: int | None = None) -> PreferenceBatch:
    """One batch of pairs: ``instruct.collate`` of the chosen rows, then the rejected rows, prompts masked.

    Rows are padded on the right to the longest and cut to max_length tokens (as collate does).
    An empty response is a ValueError naming the pair: it would give a log-probability of nothing.
    """
    if not pairs:
        raise ValueError("collate_pairs needs at least one pair")
    for index, (_, chosen, rejected) in enumerate(pairs):
        for name, response in zip(RESPONSES, (chosen, rejected)):
            if not response:
                raise ValueError(f"pair {index}: its {name} response is empty ({response!r}); "
                                 "each response needs at least one token before <|endoftext|>")
    rows = [(prompt, chosen) for prompt, chosen, _ in pairs] + [(prompt, rejected) for prompt, _, rejected in pairs]
    inputs, targets = collate(rows, eos_id, mask_prompt=True, max_length=max_length)  # (2B, T) each
    return PreferenceBatch(inputs, targets)


def make_pair_batches(pairs: Sequence[Pair], batch_size: int, eos_id: int, max_length: int | None = None,
                      shuffle_seed: int | None = None) -> list[PreferenceBatch]:
    """``collate_pairs``d batches of batch_size pairs (2 x batch_size rows), in a seeded random order if asked."""
    order = list(range(len(pairs)))
    if shuffle_seed is not None:
        order = torch.randperm(len(order), generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
    return [collate_pairs([pairs[i] for i in order[start : start + batch_size]], eos_id, max_length)
            for start in range(0, len(order), batch_size)]


# --------------------------------------------------------------------------- log-probabilities
def token_logprobs(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The log-probability of each target token, 0 where the target is IGNORE_INDEX: (N, T).

    inputs and targets (N, T) as ``collate_pairs`` makes them. The log-softmax runs in float32
    (float64 for a float64 model) even when the logits come out of autocast in bfloat16.
    Clarity first: the whole (N, T, V) logits are made, as ``model(inputs)`` makes them.
    """
    keep = targets != IGNORE_INDEX  # (N, T)
    logits = model(inputs)  # (N, T, V)
    wide = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits.to(wide), dim=-1)  # (N, T, V)
    picked = logp.gather(-1, targets.masked_fill(~keep, 0).unsqueeze(-1)).squeeze(-1)  # (N, T)
    return torch.where(keep, picked, 0.0)  # (N, T)


def sequence_logprobs(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probability of each row's targets, and how many there are: (N,) and (N,).

    ``token_logprobs``, summed per row; IGNORE_INDEX targets (prompt, padding) count for nothing.
    Nothing is checked here, at every step: ``collate_pairs`` gives every row a response token.
    """
    counts = (targets != IGNORE_INDEX).sum(dim=-1)  # (N,): at least 1 each, as ``collate_pairs`` makes them
    return token_logprobs(model, inputs, targets).sum(dim=-1), counts  # (N,), (N,)


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` in eval mode with no parameter that trains: a reference model."""
    reference = copy.deepcopy(model).eval()
    return reference.requires_grad_(False)


class ReferenceModel:
    """The frozen model the policy is measured against; ``logprobs`` hides which kind it is.

    Made from the policy before it trains: a LoRA policy (``apply_lora`` done) is its own
    reference with the adapters off, no copy; any other policy gets a ``frozen_copy``. With LoRA
    the reference is the model under the adapters, the starting point only while the adapters
    are fresh (B = 0): merge earlier adapters (an instruction-tuning run's, say) first.
    """

    def __init__(self, policy: nn.Module):
        self.shares_policy = bool(lora_layers(policy))
        self.model = policy if self.shares_policy else frozen_copy(policy)

    def logprobs(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``sequence_logprobs`` under the reference (dropout off): (N,) sums and (N,) counts."""
        if not self.shares_policy:
            self.model.to(inputs.device)  # follows the policy if fit() moved it; a no-op after the first time
        return self.apply(sequence_logprobs, inputs, targets)

    @torch.no_grad()
    def apply(self, score, *args):
        """score(the reference model, *args) with no gradient and dropout off: any scoring under the reference."""
        if not self.shares_policy:
            return score(self.model, *args)
        with evaluating(self.model), adapters_disabled(self.model):
            return score(self.model, *args)


def precompute_reference(reference: ReferenceModel, batches: Sequence[PreferenceBatch],
                         dtype: torch.dtype = torch.float32) -> list[PreferenceBatch]:
    """The batches with their reference log-probabilities filled in, computed once under autocast(dtype).

    The reference never changes, so this saves one forward pass per training step; reuse these
    batches as they are (shuffle their order, not their rows: re-collating drops the values).
    Use the training dtype: then a fresh policy's log-probabilities equal these exactly.
    """
    device = next(reference.model.parameters()).device
    done = []
    for batch in batches:
        with autocast(device, dtype):
            logprobs, _ = reference.logprobs(batch.inputs.to(device), batch.targets.to(device))  # (2B,)
        done.append(dataclasses.replace(batch, reference_logprobs=logprobs))
    return done


# --------------------------------------------------------------------------- the loss and its metrics
def implicit_rewards(policy_logprobs: torch.Tensor, reference_logprobs: torch.Tensor, beta: float) -> torch.Tensor:
    """beta * (log pi(y|x) - log ref(y|x)) per response, detached: what DPO's policy implies about y."""
    return beta * (policy_logprobs - reference_logprobs).detach()


def check_dpo_settings(beta: float, label_smoothing: float = 0.0) -> None:
    """ValueError unless beta is a positive finite number and label_smoothing is in [0, 0.5)."""
    if isinstance(beta, bool) or not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta must be a positive finite number (the pull towards the reference), got {beta!r}")
    if not (isinstance(label_smoothing, (int, float)) and 0.0 <= label_smoothing < 0.5):
        raise ValueError(f"label_smoothing must be in [0, 0.5) (the chance a label is wrong), got {label_smoothing!r}")


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float,
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean DPO loss over B pairs of summed log-probabilities (B,) each; also the chosen and rejected rewards (B,).

    loss = -log sigmoid(beta * margin), margin = (log pi - log ref)(chosen) - (log pi - log ref)(rejected);
    logsigmoid stays finite for any margin. label_smoothing eps (conservative DPO, Mitchell 2023)
    assumes each label is flipped with probability eps: (1 - eps) * loss(margin) + eps * loss(-margin).
    """
    chosen_ratio = policy_chosen - reference_chosen  # (B,)
    rejected_ratio = policy_rejected - reference_rejected  # (B,)
    scaled_margin = beta * (chosen_ratio - rejected_ratio)  # (B,)
    losses = -(1 - label_smoothing) * F.logsigmoid(scaled_margin) - label_smoothing * F.logsigmoid(-scaled_margin)
    chosen_rewards = implicit_rewards(policy_chosen, reference_chosen, beta)  # (B,)
    rejected_rewards = implicit_rewards(policy_rejected, reference_rejected, beta)  # (B,)
    return losses.mean(), chosen_rewards, rejected_rewards


def preference_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen_tokens: torch.Tensor,
                       beta: float) -> dict[str, torch.Tensor]:
    """What a DPO run is watched by, as 0-d tensors (no device sync), from B pairs' rewards (B,):

    accuracy: share of pairs whose chosen reward beats the rejected one (a tie is a miss);
    chosen_reward, rejected_reward, margin: their means, and the mean of their difference;
    chosen_log_ratio_per_token: sum over the chosen responses of log pi - log ref (the rewards
    over beta) divided by their tokens (``chosen_tokens`` (B,)). It is how far the policy has
    moved from the reference on the data, in nats per token: KL-like, but not a KL divergence,
    which would average over the policy's own samples, where this is positive or negative.
    """
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "accuracy": (chosen_rewards > rejected_rewards).float().mean(),
        "chosen_reward": chosen_rewards.mean(),
        "rejected_reward": rejected_rewards.mean(),
        "margin": (chosen_rewards - rejected_rewards).mean(),
        "chosen_log_ratio_per_token": chosen_rewards.sum() / beta / chosen_tokens.sum(),
    }


def dpo_step_loss(policy: nn.Module, reference: ReferenceModel | None, batch: PreferenceBatch, beta: float,
                  label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DPO loss of one batch (chosen and rejected rows in one forward pass) and its ``preference_metrics``.

    The reference log-probabilities come from the batch if precomputed, else from ``reference``.
    To train, pass ``DPOLoss`` (which wraps this) to ``finetune.fit`` or ``optim.OptimizerStep``.
    """
    device = next(policy.parameters()).device
    inputs, targets = batch.inputs.to(device), batch.targets.to(device)  # (2B, T) each
    policy_logprobs, tokens = sequence_logprobs(policy, inputs, targets)  # (2B,), (2B,)
    if batch.reference_logprobs is not None:
        reference_logprobs = batch.reference_logprobs.to(device)  # (2B,)
    elif reference is not None:
        reference_logprobs, _ = reference.logprobs(inputs, targets)  # (2B,)
    else:
        raise ValueError("the batch has no precomputed reference_logprobs and no reference model was given")
    n = batch.n_pairs
    loss, chosen_rewards, rejected_rewards = dpo_loss(policy_logprobs[:n], policy_logprobs[n:],
                                                      reference_logprobs[:n], reference_logprobs[n:],
                                                      beta, label_smoothing)
    return loss, preference_metrics(chosen_rewards, rejected_rewards, tokens[:n], beta)


class DPOLoss:
    """DPO as a loss function: ``loss_fn(policy, batch) -> loss``, the form ``finetune.fit`` takes.

    For ``OptimizerStep`` directly: ``step([batch], functools.partial(loss_fn, policy))``. Each
    call's metrics are kept until ``take_metrics`` returns their means (over batches) and clears them.
    """

    def __init__(self, reference: ReferenceModel | None, beta: float, label_smoothing: float = 0.0):
        check_dpo_settings(beta, label_smoothing)  # now, not at the first step
        self.reference, self.beta, self.label_smoothing = reference, beta, label_smoothing
        self.metrics: list[dict[str, torch.Tensor]] = []

    def __call__(self, policy: nn.Module, batch: PreferenceBatch) -> torch.Tensor:
        loss, metrics = dpo_step_loss(policy, self.reference, batch, self.beta, self.label_smoothing)
        self.metrics.append(metrics)
        return loss

    def take_metrics(self) -> dict[str, float]:
        """The mean of each metric over the batches since the last take, each batch weighing the same (empty if none)."""
        taken, self.metrics = self.metrics, []
        return {name: torch.stack([m[name] for m in taken]).mean().item() for name in taken[0]} if taken else {}
