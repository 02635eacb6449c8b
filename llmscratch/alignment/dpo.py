"""DPO as chapter 6's script runs it: the preference pairs of each split, batched with the reference model's
log-probabilities computed once, trained with ``finetune.fit``, scored on held-out pairs, plotted and tabled.

The loss, the reference model and the batches themselves are ``llmscratch.alignment.preference``'s; this module
puts them together into a run (``ch06-alignment/finetune_preferences.py`` adds the flags and the folder).
"""

from pathlib import Path

import torch

from llmscratch.alignment.config import DPOConfig
from llmscratch.alignment.preference import (DPOLoss, PreferenceBatch, ReferenceModel, count_ties, dpo_loss,
                                             encode_pairs, make_pair_batches, precompute_reference, preference_metrics,
                                             sequence_logprobs, validate_pairs)
from llmscratch.device import autocast
from llmscratch.finetuning.finetune import end_of_text_id, fit
from llmscratch.finetuning.instruct import lm_loss, read_json_records, split_records
from llmscratch.interrupt import StopRequest
from llmscratch.model.gpt import evaluating


# --------------------------------------------------------------------------- data
def read_pairs(path: Path, test_mode: bool) -> dict[str, list[dict]]:
    """The preference records of each split (ValueError naming a malformed record or a missing split)."""
    try:
        records = validate_pairs(read_json_records(path))
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    splits = split_records(records, path, test_mode)
    if ties := count_ties(splits["train"], f"{path}, 'train' split"):
        print(f"note: {ties:,} of the {len(splits['train']):,} training pairs in {path} have the same chosen and "
              f"rejected response: they carry no preference")
    return splits


def pair_batches(splits: dict[str, list[dict]], tokenizer, reference: ReferenceModel, config: DPOConfig,
                 context_length: int) -> dict[str, list[PreferenceBatch]]:
    """Each split's batches with the reference's log-probabilities computed once: the reference never changes."""
    eos_id = end_of_text_id(tokenizer)
    batches = {}
    for name, records in splits.items():
        if not records:
            batches[name] = []
            continue
        try:
            pairs = encode_pairs(records, tokenizer, context_length)
        except ValueError as err:
            raise ValueError(f"{name!r} pairs: {err}") from None
        batches[name] = precompute_reference(reference, make_pair_batches(pairs, config.batch_size, eos_id,
                                                                          context_length), config.torch_dtype)
    return batches


# --------------------------------------------------------------------------- training and scores
def train_dpo(model: torch.nn.Module, batches: dict[str, list[PreferenceBatch]], config: DPOConfig,
          device: torch.device, progress: bool, steps: list[dict], stop: StopRequest | None = None) -> list[dict]:
    """DPO on the train batches with ``finetune.fit``; returns its epoch records and appends one record per
    step to ``steps`` (so they are there even if Ctrl-C stops it early, through ``stop``).

    The batches keep their rows (their reference log-probabilities are precomputed); each epoch
    takes them in a new seeded order. After each epoch, the validation pairs are scored.
    """
    dpo = DPOLoss(None, config.beta, config.label_smoothing)  # every batch carries its reference log-probabilities

    def step_loss(policy: torch.nn.Module, batch: PreferenceBatch) -> torch.Tensor:
        loss = dpo(policy, batch)
        record = {"step": len(steps) + 1, "dpo_loss": loss.item(), **dpo.take_metrics()}
        if config.sft_weight > 0:  # DPO lowers the chosen answers' likelihood too; this holds it up
            chosen = batch.n_pairs
            sft = lm_loss(policy, (batch.inputs[:chosen], batch.targets[:chosen]))  # () per chosen-answer token
            loss = loss + config.sft_weight * sft
            record["sft_loss"] = sft.item()
        steps.append({**record, "loss": loss.item()})
        return loss

    def epoch_batches(epoch: int) -> list[PreferenceBatch]:
        order = torch.randperm(len(batches["train"]), generator=torch.Generator().manual_seed(config.seed + epoch))
        return [batches["train"][i] for i in order.tolist()]

    validation = batches["validation"]
    return fit(model, epoch_batches, step_loss, config, device,
               evaluate=(lambda: preference_scores(model, validation, config)) if validation else None,
               progress=progress, description="DPO", stop=stop)


@torch.no_grad()
def preference_scores(model: torch.nn.Module, batches: list[PreferenceBatch], config: DPOConfig) -> dict[str, float]:
    """DPO loss, reward accuracy, margin and rewards over every pair of the batches (each pair counts once),
    and likelihood_accuracy: how often the model itself gives the chosen answer the higher log-probability."""
    device = next(model.parameters()).device
    totals = dict.fromkeys(("loss", "accuracy", "margin", "chosen_reward", "rejected_reward",
                            "likelihood_accuracy"), 0.0)
    pairs = 0
    with evaluating(model):
        for batch in batches:
            with autocast(device, config.torch_dtype):
                logprobs, tokens = sequence_logprobs(model, batch.inputs.to(device), batch.targets.to(device))  # (2B,)
            reference, n = batch.reference_logprobs.to(device), batch.n_pairs  # (2B,)
            loss, chosen, rejected = dpo_loss(logprobs[:n], logprobs[n:], reference[:n], reference[n:], config.beta,
                                              config.label_smoothing)  # (), (B,), (B,)
            metrics = preference_metrics(chosen, rejected, tokens[:n], config.beta)
            for name in ("accuracy", "margin", "chosen_reward", "rejected_reward"):
                totals[name] += metrics[name].item() * n
            totals["loss"] += loss.item() * n
            totals["likelihood_accuracy"] += (logprobs[:n] > logprobs[n:]).sum().item()
            pairs += n
    return {name: total / pairs for name, total in totals.items()}


# --------------------------------------------------------------------------- the run's plot and table
def plot_dpo(steps: list[dict], history: list[dict], steps_per_epoch: int, test_accuracy: float, path: Path) -> None:
    """dpo.png: the DPO loss and reward margin per step, validation scores after each epoch, test accuracy at the end."""
    from matplotlib.figure import Figure  # no pyplot: no global backend

    fig = Figure(figsize=(11, 3.6))
    loss_ax, margin_ax, accuracy_ax = fig.subplots(1, 3)
    x = [s["step"] for s in steps]
    loss_ax.plot(x, [s["loss"] for s in steps], lw=0.8, label="train batch")
    margin_ax.plot(x, [s["margin"] for s in steps], lw=0.8, label="train batch")
    accuracy_ax.plot(x, [s["accuracy"] for s in steps], lw=0.6, alpha=0.5, label="train batch")
    held_out = [(r["epoch"] * steps_per_epoch, r) for r in history if "val_accuracy" in r]
    if held_out:
        ends = [step for step, _ in held_out]
        loss_ax.plot(ends, [r["val_loss"] for _, r in held_out], "o-", label="validation")
        margin_ax.plot(ends, [r["val_margin"] for _, r in held_out], "o-", label="validation")
        accuracy_ax.plot(ends, [r["val_accuracy"] for _, r in held_out], "o-", label="validation")
    accuracy_ax.plot([x[-1]], [test_accuracy], "k*", markersize=10, label="test pairs")
    for ax, title in ((loss_ax, "DPO loss"), (margin_ax, "reward margin (chosen - rejected)"),
                      (accuracy_ax, "preference accuracy")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def preference_table(results: dict[str, dict]) -> str:
    """A Markdown table of the held-out pairs' scores, one column per model."""
    names = list(results)
    rows = [("reward accuracy (chosen above rejected)", "accuracy", "{:.1%}"),
            ("likelihood accuracy (chosen more likely)", "likelihood_accuracy", "{:.1%}"),
            ("mean reward margin", "margin", "{:.3f}"), ("DPO loss", "loss", "{:.3f}")]
    lines = ["| held-out pairs | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    lines += [f"| {label} | " + " | ".join(form.format(results[n][key]) for n in names) + " |"
              for label, key, form in rows]
    return "\n".join(lines)
