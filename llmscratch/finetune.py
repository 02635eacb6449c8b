"""Finetuning, the parts every task shares: the base model, what trains, and the training loop.

The two tasks live beside this module: ``llmscratch.classify`` (a spam classifier) and
``llmscratch.instruct`` (an instruction follower). Both start from ``load_base`` (one of our
pretraining runs or a Hugging Face GPT-2 folder), choose what trains with ``set_trainable``
and train with ``fit``, which reuses pretraining's optimizer, schedule and mixed precision.
"""

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmscratch.assets import PRETRAINED_PATH
from llmscratch.distributed import resolve_device
from llmscratch.lora import LoRAConfig, apply_lora, count_parameters
from llmscratch.model import GPT
from llmscratch.tokenizer import BPETokenizer
from llmscratch.evaluation import autocast
from llmscratch.train import DTYPES, TrainConfig, configure_optimizer, learning_rate
from llmscratch.weights import load_model_and_tokenizer

TRAINABLE = ("head", "last-k", "all", "lora")


@dataclass
class FinetuneConfig:
    """How to finetune: epochs, batch, learning rate, precision, and which parameters train."""

    epochs: int = 3
    batch_size: int = 8
    lr: float = 1e-4  # peak learning rate, after warmup; cosine decay to lr * min_lr_ratio
    min_lr_ratio: float = 0.1
    warmup_fraction: float = 0.1  # share of all steps spent warming up
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dtype: str = "float32"  # "float32", "bfloat16" or "float16" (autocast)
    seed: int = 123
    trainable: str = "all"  # "head", "last-k" (last_k blocks + final norm + head), "all" or "lora"
    last_k: int = 1
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # used when trainable == "lora"

    def __post_init__(self):
        for name in ("epochs", "batch_size", "last_k"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"need lr > 0 and 0 <= min_lr_ratio <= 1, got {self.lr}, {self.min_lr_ratio}")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.trainable not in TRAINABLE:
            raise ValueError(f"trainable={self.trainable!r} is not one of {TRAINABLE}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def train_config(self, steps_per_epoch: int) -> TrainConfig:
        """The pretraining config whose optimizer and schedule this run reuses."""
        steps = self.epochs * steps_per_epoch
        return TrainConfig(max_steps=steps, batch_size=self.batch_size, lr=self.lr, min_lr=self.lr * self.min_lr_ratio,
                           warmup_steps=int(self.warmup_fraction * steps), weight_decay=self.weight_decay,
                           grad_clip=self.grad_clip, dtype=self.dtype, seed=self.seed)


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
    AdamW, warmup + cosine schedule and autocast come from ``llmscratch.train``.
    """
    first = batches(0)
    if not first:
        raise ValueError("there are no training batches: the training split is empty")
    train_config = config.train_config(len(first))
    model.to(device)
    optimizer = configure_optimizer(model, train_config, device)
    scaler = torch.amp.GradScaler(device.type, enabled=config.dtype == "float16")
    dtype = train_config.torch_dtype
    trainable = [p for p in model.parameters() if p.requires_grad]
    history = [{"epoch": 0, **({f"val_{k}": v for k, v in evaluate().items()} if evaluate else {})}]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=train_config.max_steps, desc=description, unit="step")
    step = 0
    for epoch in range(1, config.epochs + 1):
        model.train()
        total, count = 0.0, 0
        for batch in first if epoch == 1 else batches(epoch - 1):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, train_config)
            with autocast(device, dtype):
                loss = loss_fn(model, batch)
            loss_value = loss.item()
            if not math.isfinite(loss_value):
                raise ValueError(f"epoch {epoch}, step {step}: the loss is {loss_value}; try a lower learning rate")
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(trainable, config.grad_clip if config.grad_clip > 0 else float("inf"))
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            total, count, step = total + loss_value, count + 1, step + 1
            if bar is not None:
                bar.set_postfix(epoch=epoch, loss=f"{loss_value:.3f}", refresh=False)
                bar.update(1)
        record = {"epoch": epoch, "train_loss": total / count}
        if evaluate is not None:
            record.update({f"val_{k}": v for k, v in evaluate().items()})
        history.append(record)
        if bar is not None:
            bar.write(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
    if bar is not None:
        bar.close()
    model.eval()
    return history


# --------------------------------------------------------------------------- scripts
def add_arguments(parser, defaults: FinetuneConfig) -> None:
    """The command-line flags both finetuning scripts share, with this task's defaults."""
    parser.add_argument("--base", type=Path, default=PRETRAINED_PATH,
                        help="the model to start from: a run folder of ch04-pretraining/pretrain.py (e.g. "
                             "runs/pretrain), the model.safetensors or checkpoint.pt in it, or a Hugging Face "
                             "GPT-2 folder (config.json + model.safetensors); default: the bundled model of "
                             "pretrain.py's default run")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a tokenizer JSON file to use instead of the base's own (or of GPT-2's for a "
                             "Hugging Face folder)")
    parser.add_argument("--trainable", choices=TRAINABLE, default=defaults.trainable,
                        help="what trains: the head only, the last k blocks + final norm + head, everything, "
                             "or LoRA adapters (+ the head)")
    parser.add_argument("--last-k", type=int, default=defaults.last_k, help="blocks that train with --trainable last-k")
    parser.add_argument("--lora", action="store_true", help="shorthand for --trainable lora")
    parser.add_argument("--lora-rank", type=int, default=defaults.lora.rank, help="rank of the LoRA matrices")
    parser.add_argument("--lora-alpha", type=float, default=defaults.lora.alpha,
                        help="LoRA scale: the update is multiplied by alpha / rank")
    parser.add_argument("--epochs", type=int, default=defaults.epochs, help="passes over the training split")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate (warmup, then cosine decay)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="examples per optimizer step")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=defaults.dtype,
                        help="autocast precision (bfloat16 on recent GPUs); weights stay float32")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of the splits, shuffling and init")
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def check_arguments(parser, args) -> None:
    """parser.error (a message and exit status 2) for a shared flag that cannot work; resolves --device."""
    if not args.base.exists():
        parser.error(f"--base {args.base}: no such file or folder (expected a run folder of "
                     "ch04-pretraining/pretrain.py, its model.safetensors or checkpoint.pt, or a Hugging Face "
                     "GPT-2 folder)")
    if args.tokenizer is not None and not args.tokenizer.is_file():
        parser.error(f"--tokenizer {args.tokenizer}: no such file")
    try:
        args.device = resolve_device(args.device)
    except ValueError as err:
        parser.error(f"--device: {err}")


def config_from_args(args) -> FinetuneConfig:
    """The FinetuneConfig the shared flags describe (ValueError naming a bad value)."""
    lora = LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha)
    return FinetuneConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, dtype=args.dtype,
                          seed=args.seed, trainable="lora" if args.lora else args.trainable,
                          last_k=args.last_k, lora=lora)
