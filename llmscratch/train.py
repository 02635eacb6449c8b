"""Pretraining: AdamW, warmup + cosine schedule, accumulation, mixed precision, DDP, checkpoints.

``Trainer(model, config, train_tokens, val_tokens, out_dir).fit()`` runs the same on a laptop
CPU and, launched by ``torchrun``, on many GPUs. The run folder gets ``checkpoint.pt``,
``metrics.jsonl``, ``loss.png`` and ``summary.json``.
"""

import contextlib
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from llmscratch import distributed
from llmscratch.checkpoint import load_checkpoint, load_model_state, rng_state, save_checkpoint, set_rng_state, unwrap
from llmscratch.data import RandomWindowBatches
from llmscratch.flops import peak_flops
from llmscratch.generate import generate
from llmscratch.model import GPT
from llmscratch.tokenizer import BPETokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class TrainConfig:
    """How to train: steps, batch, schedule, precision, and how often to evaluate and save."""

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
    eval_tokens: int = 32_768  # validation tokens per periodic evaluation (the final one uses all)
    checkpoint_interval: int = 250
    sample_interval: int = 500
    sample_prompt: str = "Call me"
    sample_tokens: int = 48
    log_interval: int = 10
    dtype: str = "float32"  # "float32", "bfloat16" (autocast) or "float16" (autocast + grad scaler)
    compile: bool = False
    seed: int = 1337
    peak_tflops: float | None = None  # override the peak used for MFU

    def __post_init__(self):
        for name in ("max_steps", "batch_size", "grad_accum", "eval_interval", "eval_tokens",
                     "checkpoint_interval", "sample_interval", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 < self.lr or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 < lr and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError(f"warmup_steps, weight_decay and grad_clip must be >= 0, got "
                             f"{self.warmup_steps}, {self.weight_decay}, {self.grad_clip}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


class TrainingDiverged(RuntimeError):
    """The loss or the gradient became NaN or infinite."""


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warmup from 0 to ``lr``, then cosine decay to ``min_lr`` at ``max_steps``."""
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
    # fused runs the whole update in one kernel per dtype on CUDA; foreach batches it on CPU.
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2),
                             fused=fused, foreach=None if fused else True)


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision for the forward pass; a no-op context in float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def token_byte_lengths(tokenizer: BPETokenizer, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) UTF-8 byte length of each token id (0 for special and padding ids)."""
    lengths = torch.zeros(vocab_size, dtype=torch.float64)
    for token_id, token in tokenizer.vocab.items():
        lengths[token_id] = len(token)
    return lengths


@torch.no_grad()
def evaluate(model: nn.Module, tokens: np.ndarray, token_bytes: torch.Tensor, batch_size: int,
             device: torch.device, dtype: torch.dtype, max_tokens: int | None = None,
             dist_info: distributed.DistInfo = distributed.DistInfo()) -> dict[str, float]:
    """Loss (nats/token), perplexity and bits per byte over consecutive windows of ``tokens``.

    Every token after the first is predicted once. Bits per byte divide the total loss by the
    bytes those tokens stand for, so models with different tokenizers compare honestly.
    With several processes each evaluates its share of the windows and the sums are reduced.
    """
    context = unwrap(model).config.context_length
    n_windows = (min(len(tokens), max_tokens or len(tokens)) - 1) // context
    if n_windows < 1:
        raise ValueError(f"the validation split has {len(tokens)} tokens, fewer than one window "
                         f"of context_length + 1 = {context + 1}")
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # nats, tokens, bytes
    mine = list(range(dist_info.rank, n_windows, dist_info.world_size))
    for first in range(0, len(mine), batch_size):
        starts = mine[first : first + batch_size]
        windows = np.stack([tokens[s * context : s * context + context + 1] for s in starts])
        windows = torch.from_numpy(windows.astype(np.int64)).to(device)  # (B, T + 1)
        inputs, targets = windows[:, :-1], windows[:, 1:]  # (B, T) each
        with autocast(device, dtype):
            logits = model(inputs)  # (B, T, V)
        nats = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
        totals += torch.stack([nats.double(), torch.tensor(targets.numel(), dtype=torch.float64, device=device),
                               token_bytes.to(device)[targets].sum()])
    distributed.all_reduce_sum(totals)
    model.train(was_training)
    nats, count, n_bytes = totals.tolist()
    loss = nats / count
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
            "bits_per_byte": nats / math.log(2) / n_bytes if n_bytes else float("nan")}


class Trainer:
    """Owns a training run: the model (compiled and/or DDP-wrapped), optimizer, data and run folder."""

    def __init__(self, model: GPT, config: TrainConfig, train_tokens: np.ndarray, val_tokens: np.ndarray,
                 out_dir: str | Path, tokenizer: BPETokenizer,
                 dist_info: distributed.DistInfo = distributed.DistInfo()):
        self.config = config
        self.dist = dist_info
        self.device = dist_info.device
        self.out_dir = Path(out_dir)
        self.tokenizer = tokenizer
        self.val_tokens = val_tokens
        self.raw_model = model.to(self.device)
        self.model: nn.Module = self.raw_model
        if config.compile:
            self.model = torch.compile(self.model)
        if dist_info.enabled:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = nn.parallel.DistributedDataParallel(self.model, device_ids=device_ids)
        self.optimizer = configure_optimizer(self.raw_model, config, self.device)
        # fp16 has too few exponent bits for small gradients: scale the loss up, unscale before the step.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=config.dtype == "float16")
        self.batches = RandomWindowBatches(train_tokens, config.batch_size, model.config.context_length,
                                           seed=config.seed, rank=dist_info.rank, world_size=dist_info.world_size)
        self.token_bytes = token_byte_lengths(tokenizer, model.config.vocab_size)
        self.step = 0
        self.tokens_per_step = config.batch_size * config.grad_accum * model.config.context_length * dist_info.world_size
        peak = peak_flops(self.device, config.torch_dtype, config.peak_tflops)
        self.peak_flops_all = None if peak is None else peak * dist_info.world_size
        self.history: list[dict] = []  # this process's log records
        self.speed: dict[str, float] = {}  # the latest tokens/s and MFU

    # ------------------------------------------------------------------ one step
    def train_step(self) -> tuple[float, float]:
        """One optimizer step over ``grad_accum`` micro-batches; returns (loss, gradient norm)."""
        config, model = self.config, self.model
        lr = learning_rate(self.step, config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total_loss = torch.zeros((), device=self.device)
        for micro in range(config.grad_accum):
            inputs, targets = (t.to(self.device, non_blocking=True) for t in next(self.batches))  # (B, T)
            # DDP all-reduces gradients on every backward; only the last micro-step needs it.
            last = micro == config.grad_accum - 1
            sync = contextlib.nullcontext() if last or not self.dist.enabled else model.no_sync()
            with sync:
                with autocast(self.device, config.torch_dtype):
                    logits = model(inputs)  # (B, T, V)
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / config.grad_accum
                self.scaler.scale(loss).backward()
            total_loss += loss.detach()
        self.scaler.unscale_(self.optimizer)
        max_norm = config.grad_clip if config.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), max_norm)
        loss_value, norm_value = total_loss.item(), grad_norm.item()
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
            # The gradients are all-reduced, so every process sees the same bad norm and stops.
            raise TrainingDiverged(
                f"step {self.step}: loss {loss_value}, gradient norm {norm_value}; the last good "
                f"checkpoint (if any) is kept in {self.out_dir / CHECKPOINT_FILE}"
            )
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_value, norm_value

    # ------------------------------------------------------------------ the run
    def fit(self, resume: bool = False, progress: bool = True) -> dict:
        """Train to ``max_steps`` (from the last checkpoint when ``resume``); returns the summary."""
        config = self.config
        if resume:
            self.load()  # also restores the random state the interrupted run had
        else:
            torch.manual_seed(config.seed + self.dist.rank)  # dropout differs between processes
        self.out_dir.mkdir(parents=True, exist_ok=True)
        bar = None
        if self.dist.is_main and progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=config.max_steps, initial=self.step, desc="pretraining", unit="step")
        self.model.train()
        window_start, window_steps = time.perf_counter(), 0
        while self.step < config.max_steps:
            loss, grad_norm = self.train_step()
            window_steps += 1
            record = {"step": self.step, "loss": loss, "lr": learning_rate(self.step - 1, config),
                      "grad_norm": grad_norm}
            if self.step % config.log_interval == 0 or self.step == config.max_steps:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                self.speed = self._speed(window_steps, time.perf_counter() - window_start)
                record.update(self.speed)
                window_start, window_steps = time.perf_counter(), 0
            if self.step % config.eval_interval == 0 or self.step == config.max_steps:
                final = self.step == config.max_steps
                metrics = self.evaluate(None if final else config.eval_tokens)
                record.update({f"val_{k}": v for k, v in metrics.items()})
            if self.step % config.sample_interval == 0 or self.step == config.max_steps:
                record["sample"] = self.sample()
            self._log(record, bar)
            if self.step % config.checkpoint_interval == 0 or self.step == config.max_steps:
                self.save()
        if bar is not None:
            bar.close()
        return self.finish()

    def _speed(self, steps: int, seconds: float) -> dict:
        tokens_per_s = steps * self.tokens_per_step / seconds
        speed = {"tokens_per_s": tokens_per_s}
        if self.peak_flops_all:
            flops = self.raw_model.flops_per_token() * tokens_per_s
            speed["mfu"] = flops / self.peak_flops_all
        return speed

    def evaluate(self, max_tokens: int | None = None) -> dict[str, float]:
        return evaluate(self.model, self.val_tokens, self.token_bytes, self.config.batch_size, self.device,
                        self.config.torch_dtype, max_tokens, self.dist)

    def sample(self) -> str:
        """Greedy continuation of the sample prompt, from rank 0's view of the model."""
        prompt = self.tokenizer.encode(self.config.sample_prompt, allowed_special="all") or [0]
        idx = torch.tensor([prompt], device=self.device)
        with autocast(self.device, self.config.torch_dtype):
            out = generate(self.raw_model, idx, max_new_tokens=self.config.sample_tokens)
        return self.tokenizer.decode(out[0].tolist())

    def _log(self, record: dict, bar) -> None:
        self.history.append(record)
        if not self.dist.is_main:
            return
        with open(self.out_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if bar is not None:
            shown = {"loss": f"{record['loss']:.3f}", "lr": f"{record['lr']:.2e}"}
            if "tokens_per_s" in self.speed:
                shown["tok/s"] = f"{self.speed['tokens_per_s']:,.0f}"
            if "mfu" in self.speed:
                shown["mfu"] = f"{100 * self.speed['mfu']:.1f}%"
            bar.set_postfix(shown, refresh=False)
            bar.update(1)
            if "val_loss" in record:
                bar.write(f"step {record['step']}: val loss {record['val_loss']:.3f}, "
                          f"bits/byte {record['val_bits_per_byte']:.3f}")
            if "sample" in record:
                bar.write(f"sample: {record['sample']!r}")
        if "val_loss" in record:
            self.plot()

    # ------------------------------------------------------------------ files
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
        }

    def save(self) -> None:
        state = self.state_dict()  # every process takes part in the gathers
        if self.dist.is_main:
            save_checkpoint(self.out_dir / CHECKPOINT_FILE, state)
        distributed.barrier()  # nobody runs ahead (or exits) while rank 0 is writing

    def load(self) -> None:
        path = self.out_dir / CHECKPOINT_FILE
        if not path.is_file():
            raise ValueError(f"--resume: there is no checkpoint at {path} to resume from")
        distributed.barrier()
        state = load_checkpoint(path, map_location=self.device)
        if state["model_config"] != self.raw_model.config.to_dict():
            differs = {k: (v, state["model_config"].get(k)) for k, v in self.raw_model.config.to_dict().items()
                       if state["model_config"].get(k) != v}
            raise ValueError(f"the checkpoint was trained with another model config; (now, checkpoint): {differs}")
        load_model_state(self.raw_model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.step = state["step"]
        if len(state["batches"]) != self.dist.world_size:
            raise ValueError(f"the checkpoint was written by {len(state['batches'])} processes, this run "
                             f"has {self.dist.world_size}; exact resume needs the same number")
        set_rng_state(state["rng"][self.dist.rank])
        self.batches.load_state_dict(state["batches"][self.dist.rank])
        if self.dist.is_main:
            self._truncate_metrics()

    def _truncate_metrics(self) -> None:
        """Drop the log lines of steps after the checkpoint: the resumed run writes them again."""
        path = self.out_dir / "metrics.jsonl"
        if path.is_file():
            kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                    if line and json.loads(line)["step"] <= self.step]
            path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def plot(self) -> None:
        """loss.png: training loss per step and validation loss at each evaluation."""
        from matplotlib.figure import Figure  # no pyplot: no global backend, safe in notebooks

        records = [json.loads(line) for line in (self.out_dir / "metrics.jsonl").read_text().splitlines()]
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=0.8, alpha=0.6, label="train")
        val = [r for r in records if "val_loss" in r]
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per token)")
        ax.set_title(f"{self.raw_model.num_params():,} parameters, {self.tokens_per_step:,} tokens per step")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.out_dir / "loss.png", dpi=110)

    def finish(self) -> dict:
        """Write summary.json (final validation metrics) and return it."""
        last_eval = next((r for r in reversed(self.history) if "val_loss" in r), None)
        if last_eval is None:  # resumed a finished run: nothing was evaluated in this process
            last_eval = {f"val_{k}": v for k, v in self.evaluate().items()}
        summary = {
            "steps": self.step,
            "tokens_seen": self.step * self.tokens_per_step,
            "parameters": self.raw_model.num_params(),
            "val_loss": last_eval.get("val_loss"),
            "val_perplexity": last_eval.get("val_perplexity"),
            "val_bits_per_byte": last_eval.get("val_bits_per_byte"),
            "sample": next((r["sample"] for r in reversed(self.history) if "sample" in r), None),
        }
        if self.dist.is_main:
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        return summary
