"""The optimizer step that pretraining and finetuning share: AdamW (or Muon), its schedule, and one update.

``OptimizerStep(model, config, device)`` owns the optimizer and the float16 gradient scaler; calling it with micro-batches and a loss function takes one whole step: learning rate
from the schedule, forward under autocast, backward of every micro-batch (gradients add up),
unscale, clip, the update, and a check that the loss and gradients are still finite.
"""

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from llmscratch.device import autocast
from llmscratch.interrupt import TrainingDiverged
from llmscratch.training import distributed
from llmscratch.training.config import TrainConfig

__all__ = ["Muon", "OptimizerStep", "configure_optimizer", "learning_rate", "orthogonalize"]

# The quintic Newton-Schulz coefficients of the Muon speedruns: they push every singular value of a
# matrix scaled to norm <= 1 into roughly [0.7, 1.2] in five steps (steep at 0, not converging to exactly 1).
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)
MUON_RMS = 0.2  # Muon's update is scaled to this RMS, about AdamW's, so one lr and weight decay serve both


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warmup to ``lr``, then the schedule's decay to ``min_lr`` at ``max_steps`` (step is 0-based).

    The warmup follows nanoGPT's convention: step s < warmup_steps gets lr * (s + 1) / warmup_steps, so the
    first step already trains at lr / warmup_steps (a step at 0 would be wasted) and step warmup_steps - 1
    reaches lr.

    cosine: half a cosine from lr down to min_lr. wsd (warmup-stable-decay): lr held until the last
    ``decay_fraction`` of the steps (never before the warmup ends), then a straight line to min_lr.
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.schedule == "wsd":
        decay_start = max(config.warmup_steps, config.max_steps - int(config.decay_fraction * config.max_steps))
        if step < decay_start:
            return config.lr
        progress = min(1.0, (step - decay_start) / max(1, config.max_steps - decay_start))  # 0 -> 1
        return config.lr + progress * (config.min_lr - config.lr)
    progress = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))  # 1 -> 0
    return config.min_lr + cosine * (config.lr - config.min_lr)


def orthogonalize(matrix: torch.Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NEWTON_SCHULZ,
                  eps: float = 1e-7) -> torch.Tensor:
    """About U V^T for ``matrix`` = U S V^T (2-D): every singular value moved towards 1, the directions kept.

    Scaled to Frobenius norm 1 (so every singular value is at most 1), then ``steps`` times
    X <- a X + (b X X^T + c (X X^T)^2) X, which maps each singular value s to a s + b s^3 + c s^5
    and leaves U and V alone. Computed on the wide side (rows <= columns: X X^T is the smaller
    Gram matrix), in float32 or the matrix's dtype if wider.
    """
    a, b, c = coefficients
    x = matrix.to(torch.promote_types(matrix.dtype, torch.float32))
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T  # (rows, rows)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).to(matrix.dtype)


class Muon(torch.optim.Optimizer):
    """Muon on the parameter groups marked ``muon=True`` (weight matrices), AdamW on the others.

    Muon keeps a momentum of the gradient (Nesterov by default) and steps along its orthogonalised
    direction (``orthogonalize``): every singular direction of the update moves by the same amount,
    so the rare directions that a plain gradient step barely moves are learned as fast as the
    common ones. The step is scaled by ``MUON_RMS`` * sqrt(max(rows, cols)): a matrix whose singular
    values are all 1 has an RMS of 1 / sqrt(max(rows, cols)), so the update's RMS is ``MUON_RMS``,
    about a typical AdamW update's, and one learning rate and decoupled weight decay serve both kinds
    of group (as Moonshot AI's Muon does; the speedruns' own scaling wants a ~10x larger rate). The
    other groups (embeddings, the output head, gains and biases) get AdamW as ``torch.optim.AdamW`` computes it.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum,
                        nesterov=nesterov, ns_steps=ns_steps, muon=False)
        super().__init__(params, defaults)
        problems = []  # the constructor is Muon's door: every step after it trusts these
        if not 0 <= momentum < 1:
            problems.append(f"momentum must be in [0, 1), got {momentum}")
        if ns_steps < 1:
            problems.append(f"ns_steps must be at least 1, got {ns_steps}")
        if shapes := [tuple(p.shape) for group in self.param_groups if group["muon"]
                      for p in group["params"] if p.dim() != 2]:
            problems.append(f"Muon orthogonalises 2-D weight matrices; a muon group holds shapes {shapes}")
        if problems:
            raise ValueError("; ".join(problems))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                p.mul_(1 - lr * decay)  # decoupled weight decay, as AdamW's
                if group["muon"]:
                    self._muon_update(p, state, group)
                else:
                    self._adamw_update(p, state, group)
        return loss

    @staticmethod
    def _muon_update(p: torch.Tensor, state: dict, group: dict) -> None:
        grad, momentum = p.grad, group["momentum"]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buffer = state["momentum_buffer"]
        buffer.lerp_(grad, 1 - momentum)  # an average of past gradients
        direction = grad.lerp(buffer, momentum) if group["nesterov"] else buffer  # a look ahead along it
        update = orthogonalize(direction, group["ns_steps"])  # every singular value ~1: RMS ~ 1/sqrt(max side)
        p.add_(update, alpha=-group["lr"] * MUON_RMS * max(p.shape) ** 0.5)

    @staticmethod
    def _adamw_update(p: torch.Tensor, state: dict, group: dict) -> None:
        grad, (beta1, beta2) = p.grad, group["betas"]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        step = state["step"].item()
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denominator = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denominator, value=-group["lr"] / (1 - beta1**step))


def muon_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The weight matrices Muon trains: every 2-D parameter except embedding tables and the output head."""
    others = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(model, "lm_head", None)
    if head is not None:
        others |= {id(p) for p in head.parameters()}
    return [p for p in model.parameters() if p.requires_grad and p.dim() == 2 and id(p) not in others]


def configure_optimizer(model: nn.Module, config: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW that decays the weight matrices (and embedding tables) but not gains or biases; with
    ``config.optimizer == "muon"``, ``Muon`` whose Muon groups are the blocks' weight matrices.

    Decay pulls weights towards zero; for a norm's gain that means towards "switch the feature
    off", and biases and gains are too few to overfit, so they are left alone.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "muon":
        matrices = {id(p) for p in muon_parameters(model)}
        groups = [{"params": [p for p in params if id(p) in matrices], "weight_decay": config.weight_decay,
                   "muon": True},
                  {"params": [p for p in params if p.dim() >= 2 and id(p) not in matrices],
                   "weight_decay": config.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return Muon([g for g in groups if g["params"]], lr=config.lr, betas=(config.beta1, config.beta2),
                    momentum=config.muon_momentum)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # fused runs the whole update in one kernel per dtype on CUDA; foreach batches it elsewhere.
    fused = torch.device(device).type == "cuda"
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2),
                             fused=fused, foreach=None if fused else True)


class OptimizerStep:
    """AdamW (or Muon) on ``model``'s trainable parameters, stepped by calling it; ``step`` counts the steps taken.

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
