"""The optimizer step that pretraining and finetuning share: AdamW, its schedule, and one update.

``OptimizerStep(model, config, device)`` owns the AdamW optimizer and the float16 gradient
scaler; calling it with micro-batches and a loss function takes one whole step: learning rate
from the schedule, forward under autocast, backward of every micro-batch (gradients add up),
unscale, clip, the update, and a check that the loss and gradients are still finite.
"""

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from llmscratch import distributed
from llmscratch.config import TrainConfig
from llmscratch.device import autocast

__all__ = ["OptimizerStep", "TrainingDiverged", "configure_optimizer", "learning_rate"]


class TrainingDiverged(RuntimeError):
    """The loss (or, outside float16, the gradient) became NaN or infinite; no update was made."""


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warmup from 0 to ``lr``, then cosine decay to ``min_lr`` at ``max_steps`` (step is 0-based)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))  # 1 -> 0
    return config.min_lr + cosine * (config.lr - config.min_lr)


def configure_optimizer(model: nn.Module, config: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW that decays the weight matrices (and embedding tables) but not gains or biases.

    Decay pulls weights towards zero; for a norm's gain that means towards "switch the feature
    off", and biases and gains are too few to overfit, so they are left alone.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # fused runs the whole update in one kernel per dtype on CUDA; foreach batches it elsewhere.
    fused = torch.device(device).type == "cuda"
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2),
                             fused=fused, foreach=None if fused else True)


class OptimizerStep:
    """AdamW on ``model``'s trainable parameters, stepped by calling it; ``step`` counts the steps taken.

    advice: what the divergence message tells the user to do (or where the last good state is).
    """

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device, advice: str):
        self.config = config
        self.device = device
        self.advice = advice
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = configure_optimizer(model, config, device)
        # fp16 has too few exponent bits for small gradients: scale the loss up, unscale before the step.
        self.scaler = torch.amp.GradScaler(device.type, enabled=config.dtype == "float16")
        self.step = 0

    def __call__(self, micro_batches: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor],
                 ddp: nn.parallel.DistributedDataParallel | None = None) -> tuple[float, float]:
        """One update from the gradients of all ``micro_batches``; returns (mean loss, gradient norm).

        loss_fn(batch) is the mean loss of one micro-batch, computed through ``ddp`` when there is one.
        Raises ``TrainingDiverged`` (the gradients dropped, the weights untouched) on a non-finite loss.
        """
        config = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.step, config)
        total_loss = torch.zeros((), device=self.device)
        for micro, batch in enumerate(micro_batches):
            # DDP all-reduces gradients on every backward; only the last micro-step needs it.
            last = micro == len(micro_batches) - 1
            with contextlib.nullcontext() if last or ddp is None else ddp.no_sync():
                with autocast(self.device, config.torch_dtype):
                    loss = loss_fn(batch) / len(micro_batches)  # their sum is the mean over the step
                self.scaler.scale(loss).backward()
            total_loss += loss.detach()
        self.scaler.unscale_(self.optimizer)
        max_norm = config.grad_clip if config.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        loss_value = distributed.all_reduce_mean(total_loss).item()  # the global batch's loss, for the log
        norm_value = grad_norm.item()
        # In float16 an infinite gradient is routine: the scaler skips that step and lowers its scale.
        bad_norm = not math.isfinite(norm_value) and not self.scaler.is_enabled()
        if not math.isfinite(loss_value) or bad_norm:
            # The loss is averaged and the gradients all-reduced, so every process stops here together.
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingDiverged(f"step {self.step + 1}: loss {loss_value}, gradient norm {norm_value}; "
                                   f"{self.advice}")
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_value, norm_value

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (a scaler state only matters in float16)."""
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler.is_enabled() and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.step = state["step"]
