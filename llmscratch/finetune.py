"""Finetuning, the parts every task shares: the base model, what trains, and the training loop.

The two tasks live beside this module: ``llmscratch.classify`` (a spam classifier) and
``llmscratch.instruct`` (an instruction follower). Both start from ``load_base`` (one of our
pretraining runs or a Hugging Face GPT-2 folder), choose what trains with ``set_trainable``
and train with ``fit``, which reuses pretraining's optimizer, schedule and mixed precision.
"""

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from llmscratch.config import FinetuneConfig
from llmscratch.lora import apply_lora
from llmscratch.model import GPT, count_parameters
from llmscratch.optim import OptimizerStep
from llmscratch.progress import progress_bar
from llmscratch.tokenizer import BPETokenizer
from llmscratch.weights import load_model_and_tokenizer


def load_base(path: str | os.PathLike, map_location: str | torch.device = "cpu",
              tokenizer_path: str | os.PathLike | None = None) -> tuple[GPT, BPETokenizer]:
    """The model and tokenizer to finetune: ``llmscratch.weights.load_model_and_tokenizer``.

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
    if config.trainable == "last-k" and config.last_k > len(model.blocks):
        raise ValueError(f"last_k={config.last_k} is more than the model's {len(model.blocks)} blocks")
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


def fit(
    model: nn.Module,
    batches: Callable[[int], list[Any]],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    config: FinetuneConfig,
    device: torch.device,
    evaluate: Callable[[], dict[str, float]] | None = None,
    progress: bool = True,
    description: str = "finetuning",
) -> list[dict[str, float]]:
    """Train for ``config.epochs``; returns one record per epoch (epoch 0: before training).

    batches(epoch) lists that epoch's batches (shuffled as the caller likes); loss_fn(model,
    batch) is the mean loss of one batch; evaluate() gives validation metrics after each epoch.
    Each batch is one step of pretraining's ``llmscratch.optim.OptimizerStep`` (AdamW, warmup +
    cosine schedule, autocast); a NaN or infinite loss raises its ``TrainingDiverged``.
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
            record = {"epoch": epoch, "train_loss": total / count, **_validation(evaluate)}
            history.append(record)
            if bar is not None:
                bar.write(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
    model.eval()
    return history


def _validation(evaluate: Callable[[], dict[str, float]] | None) -> dict[str, float]:
    return {f"val_{k}": v for k, v in evaluate().items()} if evaluate is not None else {}
