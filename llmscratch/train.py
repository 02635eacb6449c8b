"""Pretraining: AdamW, warmup + cosine schedule, accumulation, mixed precision, DDP, checkpoints.

``Trainer(model, config, train_tokens, val_tokens, out_dir, tokenizer).fit()`` runs the same
on a laptop CPU and, launched by ``torchrun``, on many GPUs. The run folder gets
``checkpoint.pt``, ``metrics.jsonl``, ``loss.png``, ``summary.json`` and ``sample.txt``.
"""

import contextlib
import dataclasses
import inspect
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from llmscratch import distributed
from llmscratch.checkpoint import (check_model_config, load_checkpoint, load_model_state, rng_state,
                                   save_checkpoint, set_rng_state)
from llmscratch.data import RandomWindowBatches
from llmscratch.evaluation import autocast, evaluate, token_byte_lengths
from llmscratch.flops import peak_flops
from llmscratch.generate import generate
from llmscratch.model import GPT
from llmscratch.runlog import RunLog
from llmscratch.tokenizer import BPETokenizer

__all__ = ["DTYPES", "TrainConfig", "Trainer", "TrainingDiverged", "TrainingStopped", "autocast", "choose_dtype",
           "configure_optimizer", "learning_rate"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHECKPOINT_FILE = "checkpoint.pt"
# DDP need not re-send buffers before each forward: the only ones (RoPE tables) are the same on every
# process by construction. Newer torch names the option forward_sync_buffers, older broadcast_buffers.
_NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                   if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
                   else {"broadcast_buffers": False})


@dataclass
class TrainConfig:
    """How to train: steps, batch, schedule, precision, and how often to evaluate, sample and save."""

    max_steps: int = 1000
    batch_size: int = 16  # sequences per micro-step, per process
    grad_accum: int = 1  # micro-steps per optimizer step
    lr: float = 1e-3  # peak learning rate, reached after warmup
    min_lr: float = 1e-4  # floor of the cosine decay
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    eval_interval: int = 250
    eval_tokens: int = 32_768  # validation tokens per periodic evaluation
    final_eval_tokens: int | None = None  # validation tokens of the final evaluation; None: all
    checkpoint_interval: int = 250
    sample_interval: int = 500
    sample_prompt: str = "Call me"
    sample_tokens: int = 48
    sample_temperature: float = 0.8  # 0: greedy
    sample_top_k: int | None = 50
    log_interval: int = 10  # steps between tokens/s and MFU measurements
    dtype: str = "float32"  # "float32", "bfloat16" (autocast) or "float16" (autocast + grad scaler)
    compile: bool = False
    seed: int = 1337
    peak_tflops: float | None = None  # override the peak used for MFU (per process)
    max_time: float | None = None  # seconds: stop early (with a final evaluation and checkpoint)

    def __post_init__(self):
        for name in ("max_steps", "batch_size", "grad_accum", "eval_interval", "eval_tokens",
                     "checkpoint_interval", "sample_interval", "log_interval"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not 0 < self.lr < math.inf or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 < lr and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        for name in ("warmup_steps", "weight_decay", "grad_clip", "sample_tokens", "sample_temperature"):
            if not getattr(self, name) >= 0:  # also rejects NaN
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"betas must be in [0, 1), got ({self.beta1}, {self.beta2})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.sample_top_k is not None and self.sample_top_k < 1:
            raise ValueError(f"sample_top_k must be >= 1 or None, got {self.sample_top_k}")
        if self.final_eval_tokens is not None and self.final_eval_tokens < 1:
            raise ValueError(f"final_eval_tokens must be a positive integer or None, got {self.final_eval_tokens}")
        for name in ("peak_tflops", "max_time"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive (or None), got {getattr(self, name)!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


class TrainingDiverged(RuntimeError):
    """The loss (or, outside float16, the gradient) became NaN or infinite."""


class TrainingStopped(Exception):
    """``Trainer.request_stop`` was called: the run saved a checkpoint of ``step`` and stopped there."""

    def __init__(self, step: int, path: Path):
        super().__init__(f"stopped at step {step}; {path} holds that step, and a resumed run restarts from it")
        self.step = step


def choose_dtype(device: torch.device) -> str:
    """The precision a run uses by default: bf16 on GPUs that have it, fp16 on older GPUs, else fp32.

    On CPU float32 stays the default: without AMX matrix units bfloat16 autocast was slower than
    float32 on the 2-core machine measured for ``benchmarks/RESULTS.md``, and no more accurate.
    """
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


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


class Trainer:
    """Owns a training run: the model (compiled and/or DDP-wrapped), optimizer, data and run folder."""

    def __init__(self, model: GPT, config: TrainConfig, train_tokens: np.ndarray, val_tokens: np.ndarray,
                 out_dir: str | Path, tokenizer: BPETokenizer,
                 dist_info: distributed.DistInfo = distributed.DistInfo(), run_info: dict | None = None):
        self.config = config
        self.dist = dist_info
        self.device = dist_info.device
        self.out_dir = Path(out_dir)
        self.tokenizer = tokenizer
        self.val_tokens = val_tokens
        self.run_info = run_info or {}  # saved in the checkpoint as it is (e.g. the script's flags)
        self.raw_model = model.to(self.device)
        # Compile first, then wrap (as nanoGPT does): DDP's no_sync and hooks stay plain Python.
        self.eval_model: nn.Module = torch.compile(self.raw_model) if config.compile else self.raw_model
        self.model: nn.Module = self.eval_model
        if dist_info.enabled:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = nn.parallel.DistributedDataParallel(self.eval_model, device_ids=device_ids,
                                                             **_NO_BUFFER_SYNC)
        self.optimizer = configure_optimizer(self.raw_model, config, self.device)
        # fp16 has too few exponent bits for small gradients: scale the loss up, unscale before the step.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=config.dtype == "float16")
        self.batches = RandomWindowBatches(train_tokens, config.batch_size, model.config.context_length,
                                           seed=config.seed, rank=dist_info.rank, world_size=dist_info.world_size)
        self.token_bytes = token_byte_lengths(tokenizer, model.config.vocab_size)
        self.step = 0
        sequences_per_step = config.batch_size * config.grad_accum * dist_info.world_size
        self.tokens_per_step = sequences_per_step * model.config.context_length
        peak = peak_flops(self.device, config.torch_dtype, config.peak_tflops)
        self.peak_flops_all = None if peak is None else peak * dist_info.world_size  # every process counts
        self.log = RunLog(self.out_dir, enabled=dist_info.is_main)
        self.history: list[dict] = []  # this process's records since it started
        self.train_seconds = 0.0  # time spent in train_step since this process started
        self.saved_step: int | None = None  # the step checkpoint.pt holds, once this process saved or loaded it
        self.stop_requested = False  # set by request_stop (e.g. from a signal handler)
        for name in ("eval_tokens", "final_eval_tokens"):
            if getattr(config, name) is not None and getattr(config, name) < model.config.context_length + 1:
                raise ValueError(f"{name}={getattr(config, name)} is less than one evaluation window "
                                 f"(context_length + 1 = {model.config.context_length + 1} tokens)")

    # ------------------------------------------------------------------ one step
    def train_step(self) -> tuple[float, float]:
        """One optimizer step over ``grad_accum`` micro-batches; returns (mean loss, gradient norm)."""
        config = self.config
        lr = learning_rate(self.step, config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total_loss = torch.zeros((), device=self.device)
        for micro in range(config.grad_accum):
            inputs, targets = (t.to(self.device, non_blocking=True) for t in next(self.batches))  # (B, T)
            # DDP all-reduces gradients on every backward; only the last micro-step needs it.
            last = micro == config.grad_accum - 1
            sync = contextlib.nullcontext() if last or not self.dist.enabled else self.model.no_sync()
            with sync:
                with autocast(self.device, config.torch_dtype):
                    # The model's own loss path: the (B, T, V) logits are never stored (llmscratch.losses).
                    loss = self.model(inputs, targets=targets) / config.grad_accum  # mean over B * T
                self.scaler.scale(loss).backward()
            total_loss += loss.detach()
        self.scaler.unscale_(self.optimizer)
        max_norm = config.grad_clip if config.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), max_norm)
        loss_value = distributed.all_reduce_mean(total_loss).item()  # the global batch's loss, for the log
        norm_value = grad_norm.item()
        # In float16 an infinite gradient is routine: the scaler skips that step and lowers its scale.
        bad_norm = not math.isfinite(norm_value) and not self.scaler.is_enabled()
        if not math.isfinite(loss_value) or bad_norm:
            # The loss is averaged and the gradients all-reduced, so every process stops here together.
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingDiverged(
                f"step {self.step + 1}: loss {loss_value}, gradient norm {norm_value}; training stopped. "
                f"The last good checkpoint (if any) is kept in {self.out_dir / CHECKPOINT_FILE}"
            )
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_value, norm_value

    # ------------------------------------------------------------------ the run
    def fit(self, resume: bool = False, progress: bool = True, on_start: Callable[[], None] | None = None) -> dict:
        """Train to ``max_steps`` (from the last checkpoint when ``resume``); returns the summary.

        on_start: called once the run is set up (a resumed checkpoint accepted), before the first
        step, e.g. to record the run's flags only when they fit. After ``request_stop`` the run
        saves a checkpoint at the end of the step under way and raises ``TrainingStopped``.
        """
        config = self.config
        if resume:
            self.load()  # also restores the random state the interrupted run had
        else:
            torch.manual_seed(config.seed + self.dist.rank)  # dropout masks differ between processes
            self.log.start()
        if on_start is not None:
            on_start()
        bar = None
        if self.dist.is_main and progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=config.max_steps, initial=self.step, desc="pretraining", unit="step")
        self.model.train()
        deadline = None if config.max_time is None else time.monotonic() + config.max_time
        window_seconds, window_steps = 0.0, 0
        while self.step < config.max_steps:
            start = time.perf_counter()
            loss, grad_norm = self.train_step()  # .item() inside waits for the GPU: the timing is honest
            elapsed = time.perf_counter() - start
            self.train_seconds += elapsed
            window_seconds, window_steps = window_seconds + elapsed, window_steps + 1
            out_of_time = deadline is not None and distributed.any_process(time.monotonic() > deadline, self.device)
            last = self.step == config.max_steps or out_of_time
            record = {"step": self.step, "loss": loss, "lr": learning_rate(self.step - 1, config),
                      "grad_norm": grad_norm}
            if self.step % config.log_interval == 0 or last:
                record.update(self._speed(window_steps, window_seconds))
                window_seconds, window_steps = 0.0, 0
            if self.step % config.eval_interval == 0 or last:
                metrics = self.evaluate(config.final_eval_tokens if last else config.eval_tokens)
                record.update({f"val_{k}": v for k, v in metrics.items()})
            if (self.step % config.sample_interval == 0 or last) and self.dist.is_main:
                record["sample"] = self.sample()
            self._record(record, bar)
            if self.step % config.checkpoint_interval == 0 or last:
                self.save()
            if out_of_time:
                break
            # Every process stops after the same step (a signal may reach them at different times).
            if not last and distributed.any_process(self.stop_requested, self.device):
                if self.saved_step != self.step:
                    self.save()
                if bar is not None:
                    bar.close()
                raise TrainingStopped(self.step, self.out_dir / CHECKPOINT_FILE)
        if bar is not None:
            bar.close()
        return self.finish()

    def request_stop(self) -> None:
        """Stop after the step under way, with a checkpoint of it (safe to call from a signal handler)."""
        self.stop_requested = True

    def _speed(self, steps: int, seconds: float) -> dict:
        """Tokens per second and model FLOPs utilisation, over all processes."""
        tokens_per_s = steps * self.tokens_per_step / max(seconds, 1e-9)
        speed = {"tokens_per_s": tokens_per_s}
        if self.peak_flops_all:
            speed["mfu"] = self.raw_model.flops_per_token() * tokens_per_s / self.peak_flops_all
        return speed

    def evaluate(self, max_tokens: int | None = None) -> dict[str, float]:
        """Validation loss, perplexity and bits per byte (the same on every process)."""
        # No activations are kept for a backward pass: a whole optimizer step's sequences fit at once.
        batch_size = self.config.batch_size * self.config.grad_accum
        return evaluate(self.eval_model, self.val_tokens, self.token_bytes, batch_size, self.device,
                        self.config.torch_dtype, max_tokens, self.dist)

    def sample(self) -> str:
        """A continuation of the sample prompt, from its own seeded generator (the run's random state is untouched)."""
        config = self.config
        prompt = self.tokenizer.encode(config.sample_prompt, allowed_special="all")
        prompt = prompt[-self.raw_model.config.context_length:] or [self.tokenizer.eot_token or 0]
        idx = torch.tensor([prompt], device=self.device)  # (1, T)
        generator = torch.Generator(self.device).manual_seed(config.seed)
        fits = len(prompt) + config.sample_tokens - 1 <= self.raw_model.config.context_length
        with autocast(self.device, config.torch_dtype):
            out = generate(self.raw_model, idx, config.sample_tokens, temperature=config.sample_temperature,
                           top_k=config.sample_top_k, use_cache=fits, generator=generator)  # (1, T + n)
        # Ids past the tokenizer's vocabulary (rows that pad the embedding to a round size) decode to nothing.
        return self.tokenizer.decode([i for i in out[0].tolist() if i < self.tokenizer.vocab_size])

    def _record(self, record: dict, bar) -> None:
        self.history.append(record)
        self.log.append(record)
        if "val_loss" in record:
            self.plot()
        if bar is None:
            return
        shown = {"loss": f"{record['loss']:.3f}", "lr": f"{record['lr']:.2e}"}
        speed = next((r for r in reversed(self.history) if "tokens_per_s" in r), {})
        if "tokens_per_s" in speed:
            shown["tok/s"] = f"{speed['tokens_per_s']:,.0f}"
        if "mfu" in speed:
            shown["mfu"] = f"{100 * speed['mfu']:.1f}%"
        bar.set_postfix(shown, refresh=False)
        bar.update(1)
        if "val_loss" in record:
            bar.write(f"step {record['step']}: val loss {record['val_loss']:.3f}, "
                      f"bits/byte {record['val_bits_per_byte']:.3f}")
        if "sample" in record:
            bar.write(f"sample: {record['sample']!r}")

    def plot(self) -> None:
        """Redraw loss.png from metrics.jsonl (main process only)."""
        self.log.plot(f"{self.raw_model.num_params():,} parameters, {self.tokens_per_step:,} tokens per step")

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue exactly, gathered from every process."""
        return {
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "rng": distributed.all_gather_objects(rng_state()),
            "batches": distributed.all_gather_objects(self.batches.state_dict()),
            "model_config": self.raw_model.config.to_dict(),
            "train_config": dataclasses.asdict(self.config),
            "tokenizer": self.tokenizer.to_json(),
            "run": self.run_info,
        }

    def save(self) -> None:
        """Write checkpoint.pt (rank 0; the others wait so nobody runs ahead or exits mid-write)."""
        state = self.state_dict()  # every process takes part in the gathers
        if self.dist.is_main:
            save_checkpoint(self.out_dir / CHECKPOINT_FILE, state)
        distributed.barrier()
        self.saved_step = self.step

    def load(self) -> None:
        """Continue from checkpoint.pt: rank 0 reads it and hands it to every process."""
        path = self.out_dir / CHECKPOINT_FILE
        state = None
        if self.dist.is_main:
            try:
                state = load_checkpoint(path, map_location="cpu")
            except ValueError as err:
                state = {"error": f"cannot resume: {err}"}
        state = distributed.broadcast_object(state)  # no shared filesystem needed between nodes
        if "error" in state:
            raise ValueError(state["error"])
        check_model_config(state["model_config"], self.raw_model.config)
        if len(state["batches"]) != self.dist.world_size:
            raise ValueError(f"the checkpoint was written by {len(state['batches'])} process(es), this run "
                             f"has {self.dist.world_size}; exact resume needs the same number")
        load_model_state(self.raw_model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler.is_enabled() and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.batches.load_state_dict(state["batches"][self.dist.rank])
        set_rng_state(state["rng"][self.dist.rank])
        self.step = self.saved_step = state["step"]
        self.log.truncate(self.step)

    def finish(self) -> dict:
        """Write summary.json (final validation metrics, speed) and sample.txt; return the summary."""
        last_eval = next((r for r in reversed(self.history) if "val_loss" in r), None)
        if last_eval is None:  # resumed a finished run: nothing was evaluated in this process
            last_eval = {f"val_{k}": v for k, v in self.evaluate(self.config.final_eval_tokens).items()}
        sample = next((r["sample"] for r in reversed(self.history) if "sample" in r), None)
        steps_here = len(self.history)
        summary = {
            "steps": self.step,
            "tokens_seen": self.step * self.tokens_per_step,
            "parameters": self.raw_model.num_params(),
            "val_loss": last_eval["val_loss"],
            "val_perplexity": last_eval["val_perplexity"],
            "val_bits_per_byte": last_eval["val_bits_per_byte"],
            "train_seconds": self.train_seconds,  # this process's training time (since a resume, if any)
            "tokens_per_s": steps_here * self.tokens_per_step / self.train_seconds if self.train_seconds else None,
            "sample": sample,
        }
        if self.dist.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
            if sample is not None:
                (self.out_dir / "sample.txt").write_text(sample + "\n", encoding="utf-8")
        return summary
