"""Finetuning, the parts every task shares: the base model, what trains, and the training loop.

The two tasks live beside this module: ``llmscratch.finetuning.classify`` (a spam classifier) and
``llmscratch.finetuning.instruct`` (an instruction follower). Both start from ``load_base`` (one of our
pretraining runs or a Hugging Face GPT-2 folder), choose what trains with ``set_trainable``
and train with ``fit``, which reuses pretraining's optimizer, schedule and mixed precision.
"""

import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmscratch.finetuning.config import FinetuneConfig
from llmscratch.finetuning.lora import apply_lora, lora_layers, lora_targets, merge_lora, save_adapters
from llmscratch.interrupt import StopRequest, exit_status, stop_on_signals
from llmscratch.model.gpt import GPT, count_parameters
from llmscratch.model.quantize import describe
from llmscratch.model.weights import load_model_and_tokenizer
from llmscratch.progress import progress_bar
from llmscratch.runfolder import present, save_or_rescue
from llmscratch.text.tokenizer import BPETokenizer
from llmscratch.training.optim import OptimizerStep

ADAPTERS_FILE = "adapters.safetensors"


class FinetuneStopped(Exception):
    """Training stopped early on request (Ctrl-C): ``history`` holds the epochs finished, ``step`` the steps;
    ``exit_status`` is the program's (128 + the signal, as ``fit_and_save`` sets it)."""

    def __init__(self, step: int, total_steps: int, history: list[dict]):
        super().__init__(f"stopped after step {step} of {total_steps}")
        self.step, self.total_steps, self.history = step, total_steps, history
        self.exit_status = 130


def load_base(path: str | os.PathLike, map_location: str | torch.device = "cpu",
              tokenizer_path: str | os.PathLike | None = None) -> tuple[GPT, BPETokenizer]:
    """The model and tokenizer to finetune: ``llmscratch.model.weights.load_model_and_tokenizer``.

    A pretraining run folder, the ``checkpoint.pt`` or ``model.safetensors`` export it holds
    (ch04-pretraining/pretrain.py writes both; each carries its tokenizer), or a Hugging Face
    folder, read with GPT-2's vocabulary unless ``tokenizer_path`` names another.
    """
    return load_model_and_tokenizer(path, tokenizer_path, map_location)


def end_of_text_id(tokenizer) -> int:
    """The id of ``<|endoftext|>``: the token that ends responses and pads batches."""
    eot = getattr(tokenizer, "eot_token", None)
    if eot is None:
        raise ValueError(f"the tokenizer {tokenizer!r} has no <|endoftext|> token; train it with "
                         "special_tokens=['<|endoftext|>']")
    return eot


def set_trainable(model: GPT, config: FinetuneConfig, always: Sequence[nn.Module] = ()) -> int:
    """Freeze and unfreeze ``model`` as ``config.trainable`` says; returns the trainable count.

    "head": only the modules in ``always``; "last-k": also the last ``last_k`` blocks and the
    final norm; "all": everything; "lora": adapters on ``config.lora.targets``, plus ``always``.
    ``always`` holds the task's head (a new classification layer, or the language-model head).
    Note a language-model head tied to the token embedding trains the embedding with it.
    """
    check_trainable(model, config)
    if config.trainable == "lora":
        apply_lora(model, config.lora)  # freezes everything else
    else:
        model.requires_grad_(config.trainable == "all")
    if config.trainable == "last-k":
        for module in [*model.blocks[-config.last_k:], model.final_norm]:
            module.requires_grad_(True)
    for module in always:
        module.requires_grad_(True)
    trainable = count_parameters(model, trainable_only=True)
    if trainable == 0:
        raise ValueError(f"trainable={config.trainable!r} leaves no parameter to train")
    return trainable


def check_trainable(model: GPT, config: FinetuneConfig) -> None:
    """ValueError if ``config.trainable`` cannot apply to ``model`` (a quantized model, too many blocks, a LoRA
    rank too large): ``set_trainable``'s checks, for a script to make as soon as the model is loaded."""
    if getattr(model, "quantization", None) is not None:  # its integer weights are buffers: only norms would train
        raise ValueError(f"the model is quantized ({describe(model.quantization)}): its integer weights cannot be "
                         f"trained, and LoRA wraps float linear layers only; finetune the float model it was made "
                         f"from, then quantize the result (ch07-deployment/quantize.py)")
    if config.trainable == "last-k" and config.last_k > len(model.blocks):
        raise ValueError(f"last_k={config.last_k} is more than the model's {len(model.blocks)} blocks")
    if config.trainable == "lora":
        lora_targets(model, config.lora)


def fit(
    model: nn.Module,
    batches: Callable[[int], list[Any]],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    config: FinetuneConfig,
    device: torch.device,
    evaluate: Callable[[], dict[str, float]] | None = None,
    progress: bool = True,
    description: str = "finetuning",
    stop: StopRequest | None = None,
) -> list[dict[str, float]]:
    """Train for ``config.epochs``; returns one record per epoch (epoch 0: before training).

    batches(epoch) lists that epoch's batches (shuffled as the caller likes); loss_fn(model,
    batch) is the mean loss of one batch; evaluate() gives validation metrics after each epoch.
    Each batch is one step of pretraining's ``llmscratch.training.optim.OptimizerStep`` (AdamW, warmup +
    cosine schedule, autocast); a NaN or infinite loss raises its ``TrainingDiverged``. Once
    ``stop.stop_requested`` is set, the step under way finishes and FinetuneStopped is raised.
    """
    first = batches(0)
    if not first:
        raise ValueError("there are no training batches: the training split is empty")
    train_config = config.train_config(len(first))
    model.to(device)
    optimizer_step = OptimizerStep(model, train_config, device, advice="try a lower learning rate")
    batch_loss = functools.partial(loss_fn, model)
    history = [{"epoch": 0, **_validation(evaluate)}]
    with progress_bar(progress, train_config.max_steps, description, "step") as bar:
        for epoch in range(1, config.epochs + 1):
            model.train()
            total, count = 0.0, 0
            for batch in first if epoch == 1 else batches(epoch - 1):
                loss, _ = optimizer_step([batch], batch_loss)
                total, count = total + loss, count + 1
                if bar is not None:
                    bar.set_postfix(epoch=epoch, loss=f"{loss:.3f}", refresh=False)
                    bar.update(1)
                if stop is not None and stop.stop_requested and optimizer_step.step < train_config.max_steps:
                    model.eval()
                    raise FinetuneStopped(optimizer_step.step, train_config.max_steps, history)
            record = {"epoch": epoch, "train_loss": total / count, **_validation(evaluate)}
            history.append(record)
            if bar is not None:
                bar.write(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
    model.eval()
    return history


def _validation(evaluate: Callable[[], dict[str, float]] | None) -> dict[str, float]:
    return {f"val_{k}": v for k, v in evaluate().items()} if evaluate is not None else {}


# --------------------------------------------------------------------------- the end of a run
def fit_and_save(gpt: nn.Module, train: Callable[[StopRequest], list[dict]], out_dir: Path, model_file: str,
                 save_model: Callable[[Path], None],
                 outputs: Sequence[str]) -> tuple[list[dict], FinetuneStopped | None]:
    """Run ``train(stop)`` (``fit``, with Ctrl-C asking it to stop), then save the model before anything else.

    Saved first, the weights survive whatever comes next (scoring, reports, another Ctrl-C).
    Returns fit's history and, if Ctrl-C stopped it early, the FinetuneStopped (the model trained
    so far is saved all the same). The saving is ``save_finetuned``'s; ``gpt`` is the GPT being
    finetuned (inside a classifier, its ``gpt``: its LoRA adapters are saved under a plain GPT's names).
    """
    stop, stopped = StopRequest(), None
    try:
        with stop_on_signals(stop, saving="then saving the model trained so far"):
            history = train(stop)
    except FinetuneStopped as err:
        history, stopped = err.history, err
        stopped.exit_status = exit_status(stop)
    save_finetuned(gpt, out_dir, model_file, save_model, outputs)
    return history, stopped


def save_finetuned(gpt: nn.Module, out_dir: Path, model_file: str, save_model: Callable[[Path], None],
                   outputs: Sequence[str]) -> None:
    """Save the trained weights as ``out_dir/model_file`` (or in a rescue folder that the SaveFailed names).

    ``save_model(path)`` writes the model. With LoRA, first the adapters of ``gpt`` alone
    (``ADAPTERS_FILE``), then they are merged into it. Earlier results among ``outputs`` that this
    run does not replace are deleted (the folder was given with --overwrite): they describe another
    model.
    """
    written = [model_file]
    if lora_layers(gpt):
        save_or_rescue(out_dir, lambda folder: save_adapters(gpt, folder / ADAPTERS_FILE), "the LoRA adapters")
        merge_lora(gpt)
        written.append(ADAPTERS_FILE)
    save_or_rescue(out_dir, lambda folder: save_model(folder / model_file), "the finetuned model")
    for name in present(out_dir, outputs):
        if name not in written:
            (out_dir / name).unlink()
