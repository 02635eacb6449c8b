"""Pretraining: the run around the optimizer step: data, evaluation, samples, checkpoints, DDP, FSDP or TP.

``Trainer(model, config, train_tokens, val_tokens, out_dir, tokenizer).fit()`` runs the same
on a laptop CPU and, launched by ``torchrun``, on many GPUs (``config.parallel``: each process a
whole copy under DDP, a shard under FSDP, a slice of every block's heads and MLP under tensor
parallelism, see ``llmscratch.training.parallel``). The step itself (AdamW,
schedule, accumulation, mixed precision) is ``llmscratch.training.optim``; the run folder
(``llmscratch.training.runlog``) gets ``checkpoint.pt`` (``checkpoint/`` with any parallel but "ddp"),
``metrics.jsonl``, ``loss.png``, ``summary.json`` and ``sample.txt``.
"""

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from llmscratch.model.checkpoint import export_state_dict, load_checkpoint, load_model_state, save_checkpoint
from llmscratch.model.gpt import GPT
from llmscratch.model.moe import expert_load
from llmscratch.text.data import RandomWindowBatches
from llmscratch.text.tokenizer import BPETokenizer
from llmscratch.training import distributed
from llmscratch.training.config import TrainConfig
from llmscratch.training.evaluation import evaluate, token_byte_lengths
from llmscratch.training.flops import peak_flops
from llmscratch.training.optim import OptimizerStep, learning_rate
from llmscratch.training.parallel import fused_qkv_state, parallelize, qkv_sizes, split_qkv_state
from llmscratch.training.resume import (check_model_config, load_sharded, load_sharded_renamed, read_meta, rng_state,
                                        save_sharded, set_rng_state)
from llmscratch.training.runlog import RunLog, sample_text

# The training API in one import: the config, the step's schedule and optimizer, and the run.
__all__ = ["Trainer", "TrainingStopped"]

CHECKPOINT_FILE = "checkpoint.pt"
SHARDED_CHECKPOINT_DIR = "checkpoint"  # with parallel != "ddp": a folder of DCP shards (llmscratch.training.resume)


class TrainingStopped(Exception):
    """``Trainer.request_stop`` was called: the run saved a checkpoint of ``step`` and stopped there."""

    def __init__(self, step: int, path: Path):
        super().__init__(f"stopped at step {step}; {path} holds that step, and a resumed run restarts from it")
        self.step = step


class Trainer:
    """Owns a training run: the model, the optimizer step, the data, evaluation and the run folder.

    Three handles on one network: ``model``, the GPT (its weights are saved, sampled and
    exported; under FSDP with several processes its parameters are sharded DTensors);
    ``compiled``, what evaluation runs (``model`` through torch.compile, or ``model`` itself);
    ``wrapped``, what training steps run (``compiled``, inside DDP with several processes and
    parallel="ddp").
    """

    def __init__(self, model: GPT, config: TrainConfig, train_tokens: np.ndarray, val_tokens: np.ndarray,
                 out_dir: str | Path, tokenizer: BPETokenizer,
                 dist_info: distributed.DistInfo = distributed.DistInfo(), run_info: dict | None = None):
        for name in ("eval_tokens", "final_eval_tokens"):
            if getattr(config, name) is not None and getattr(config, name) < model.config.context_length + 1:
                raise ValueError(f"{name}={getattr(config, name)} is less than one evaluation window "
                                 f"(context_length + 1 = {model.config.context_length + 1} tokens)")
        self.config = config
        self.dist = dist_info
        self.device = dist_info.device
        self.out_dir = Path(out_dir)
        self.tokenizer = tokenizer
        self.val_tokens = val_tokens
        self.run_info = run_info or {}  # saved in the checkpoint as it is (e.g. the script's flags)
        self.model = model
        # Checked and split before anything else is built (llmscratch.training.parallel): DDP, FSDP, TP or both.
        setup = parallelize(model, config, dist_info)
        self.dp, self.tp, self.sharded, self.fsdp = setup.dp, setup.tp, setup.sharded, setup.fsdp
        self.dp_rank = dist_info.rank // self.tp  # the ranks of one tp group see the same batches
        self.compiled, self.wrapped, self.grad_sync = setup.compiled, setup.wrapped, setup.grad_sync
        self.compute_dtype = setup.autocast_dtype  # float32 under FSDP: its policy casts to bfloat16
        # Built after sharding: AdamW's moments are made like the (sharded) parameters they follow. Its
        # fused CUDA kernel takes DTensors (DTensor shards the _fused_adamw_ op like any pointwise one).
        step_config = dataclasses.replace(config, dtype="float32") if self.fsdp else config
        self.optimizer_step = OptimizerStep(self.model, step_config, self.device, advice=(
            f"training stopped. The last good checkpoint (if any) is kept in {self.checkpoint_path}"))
        self.batches = RandomWindowBatches(train_tokens, config.batch_size, model.config.context_length,
                                           seed=config.seed, rank=self.dp_rank, world_size=self.dp)
        self.token_bytes = token_byte_lengths(tokenizer, model.config.vocab_size)
        sequences_per_step = config.batch_size * config.grad_accum * self.dp
        self.tokens_per_step = sequences_per_step * model.config.context_length
        peak = peak_flops(self.device, config.torch_dtype, config.peak_tflops)
        self.peak_flops_all = None if peak is None else peak * dist_info.world_size  # every process counts
        self.log = RunLog(self.out_dir, enabled=dist_info.is_main,
                          title=f"{model.num_params():,} parameters, {self.tokens_per_step:,} tokens per step")
        self.history: list[dict] = []  # this process's records since it started
        self.train_seconds = 0.0  # time spent in train_step since this process started
        self.window_seconds, self.window_steps = 0.0, 0  # since the last speed measurement
        self.saved_step: int | None = None  # the step the checkpoint holds, once this process saved or loaded it
        self.stop_requested = False  # set by request_stop (e.g. from a signal handler)

    @property
    def split_qkv(self) -> bool:
        """True when attention's qkv is three tensors q, k, v (tensor parallelism, ``parallel.SplitQKV``)."""
        return self.sharded and self.tp > 1

    @property
    def checkpoint_path(self) -> Path:
        """checkpoint.pt, or the checkpoint/ folder of DCP shards with parallel != "ddp" (any number of processes)."""
        return self.out_dir / (SHARDED_CHECKPOINT_DIR if self.config.parallel != "ddp" else CHECKPOINT_FILE)

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (in this run and the runs it resumed)."""
        return self.optimizer_step.step

    # ------------------------------------------------------------------ one step
    def train_step(self) -> tuple[float, float]:
        """One optimizer step over ``grad_accum`` micro-batches; returns (mean loss, gradient norm)."""
        micro_batches = [next(self.batches) for _ in range(self.config.grad_accum)]
        return self.optimizer_step(micro_batches, self._loss, self.grad_sync)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = (t.to(self.device, non_blocking=True) for t in batch)  # (B, T)
        # The model's own loss path: the (B, T, V) logits are never stored (llmscratch.model.losses).
        return self.wrapped(inputs, targets=targets)  # () mean over B * T

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
            if self.step >= config.max_steps:  # finished: its summary and sample stay as they are
                raise ValueError(f"cannot resume: the checkpoint is at step {self.step}, and max_steps is "
                                 f"{config.max_steps}: there is nothing left to train; a larger max_steps "
                                 f"(pretrain.py: --max-steps) continues the run")
        else:
            torch.manual_seed(config.seed + self.dp_rank)  # dropout masks differ between batches, not within a tp group
            self.log.start()
        if on_start is not None:
            on_start()
        self.wrapped.train()
        deadline = None if config.max_time is None else time.monotonic() + config.max_time
        with self.log.progress(progress and self.dist.is_main, config.max_steps, initial=self.step):
            while self.step < config.max_steps:
                loss, grad_norm = self._timed_step()
                out_of_time = deadline is not None and distributed.any_process(time.monotonic() > deadline,
                                                                               self.device)
                last = self.step == config.max_steps or out_of_time
                self._record(loss, grad_norm, last)
                if self.step % config.checkpoint_interval == 0 or last:
                    self.save()
                if out_of_time:
                    break
                # Every process stops after the same step (a signal may reach them at different times).
                if not last and distributed.any_process(self.stop_requested, self.device):
                    if self.saved_step != self.step:
                        self.save()
                    raise TrainingStopped(self.step, self.checkpoint_path)
        return self.finish()

    def request_stop(self) -> None:
        """Stop after the step under way, with a checkpoint of it (safe to call from a signal handler)."""
        self.stop_requested = True

    def _timed_step(self) -> tuple[float, float]:
        start = time.perf_counter()
        loss, grad_norm = self.train_step()  # .item() inside waits for the GPU: the timing is honest
        elapsed = time.perf_counter() - start
        self.train_seconds += elapsed
        self.window_seconds += elapsed
        self.window_steps += 1
        return loss, grad_norm

    def _record(self, loss: float, grad_norm: float, last: bool) -> None:
        """Log the step just taken: loss and learning rate; at their intervals speed, validation, a sample."""
        config = self.config
        record = {"step": self.step, "loss": loss, "lr": learning_rate(self.step - 1, config), "grad_norm": grad_norm}
        if self.step % config.log_interval == 0 or last:
            record.update(self._speed())
        if self.step % config.eval_interval == 0 or last:
            metrics = self.evaluate(config.final_eval_tokens if last else config.eval_tokens)
            record.update({f"val_{k}": v for k, v in metrics.items()})
            if (load := expert_load(self.model)) is not None:  # the router's statistics since the last evaluation
                record["expert_load"] = load
                record["balance_loss"] = self.model.balance_loss().item()
        # A sharded model's forward needs every rank (each gathers the weights with the others), so all
        # of them generate the sample: the same seeded generator gives the same text everywhere.
        if (self.step % config.sample_interval == 0 or last) and (self.dist.is_main or self.sharded):
            text = sample_text(self.model, self.tokenizer, config, self.device)
            self._reshard()
            if self.dist.is_main:
                record["sample"] = text
        self.history.append(record)
        self.log.append(record)

    def _speed(self) -> dict:
        """Tokens per second and model FLOPs utilisation since the last measurement, over all processes."""
        tokens_per_s = self.window_steps * self.tokens_per_step / max(self.window_seconds, 1e-9)
        self.window_seconds, self.window_steps = 0.0, 0
        speed = {"tokens_per_s": tokens_per_s}
        if self.peak_flops_all:
            speed["mfu"] = self.model.flops_per_token() * tokens_per_s / self.peak_flops_all
        return speed

    def evaluate(self, max_tokens: int | None = None) -> dict[str, float]:
        """Validation loss, perplexity and bits per byte (the same on every process)."""
        # No activations are kept for a backward pass: a whole optimizer step's sequences fit at once.
        batch_size = self.config.batch_size * self.config.grad_accum
        # Each data-parallel rank evaluates every dp-th window (a tp group shares them); sharded, every
        # rank runs as many forward passes as the busiest one (they compute each forward together).
        dist_info = dataclasses.replace(self.dist, rank=self.dp_rank, world_size=self.dp)
        metrics = evaluate(self.compiled, self.val_tokens, self.token_bytes, batch_size, self.device,
                           self.compute_dtype, max_tokens, dist_info, lockstep=self.sharded)
        self._reshard()
        return metrics

    def _reshard(self) -> None:
        """Free the gathered weights a forward outside training leaves behind: FSDP keeps the root's
        (embeddings, head) gathered after a forward, since in training its backward comes next."""
        if self.fsdp:
            self.model.reshard()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue exactly, gathered from every process (unsharded)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer_step.optimizer.state_dict(),
                **self.run_state()}

    def run_state(self) -> dict:
        """The state but the weights and the optimizer: step, float16 scaler, every rank's random and data state."""
        return {
            "scaler": self.optimizer_step.scaler.state_dict(),
            "step": self.step,
            "rng": distributed.all_gather_objects(rng_state()),
            "batches": distributed.all_gather_objects(self.batches.state_dict()),
            "model_config": self.model.config.to_dict(),
            "train_config": dataclasses.asdict(self.config),
            "tokenizer": self.tokenizer.to_json(),
            "run": self.run_info,
        }

    def save(self) -> None:
        """Write the checkpoint: checkpoint.pt (rank 0; the others wait so nobody runs ahead or exits
        mid-write), or with parallel != "ddp" the checkpoint/ folder, each rank writing its shards."""
        if self.config.parallel != "ddp":
            # Under tensor parallelism the checkpoint holds q, k and v as three tensors (parallel.SplitQKV).
            meta = {**self.run_state(), "split_qkv": self.split_qkv, "mesh": (self.dp, self.tp)}
            save_sharded(self.checkpoint_path, self.model, self.optimizer_step.optimizer, meta,
                         self.dist.is_main)
        else:
            state = self.state_dict()  # every process takes part in the gathers
            if self.dist.is_main:
                save_checkpoint(self.checkpoint_path, state)
            distributed.barrier()
        self.saved_step = self.step

    def load(self) -> None:
        """Continue from the checkpoint: rank 0 reads checkpoint.pt (or checkpoint/meta.pt) and hands it to
        every process; sharded weights and optimizer state are read by every process itself."""
        if self.config.parallel != "ddp":
            return self._load_sharded()
        state = None
        if self.dist.is_main:
            try:
                state = load_checkpoint(self.checkpoint_path, map_location="cpu")
            except ValueError as err:
                state = {"error": f"cannot resume: {err}{self._other_format_hint()}"}
        state = distributed.broadcast_object(state)  # no shared filesystem needed between nodes
        if "error" in state:
            raise ValueError(state["error"])
        check_model_config(state["model_config"], self.model.config)
        self._check_resumable(state)
        if len(state["batches"]) != self.dist.world_size:
            raise ValueError(f"the checkpoint was written by {len(state['batches'])} process(es), this run "
                             f"has {self.dist.world_size}; exact resume needs the same number")
        load_model_state(self.model, state["model"])
        self.optimizer_step.load_state_dict(state)
        self.batches.load_state_dict(state["batches"][self.dist.rank])
        set_rng_state(state["rng"][self.dist.rank])
        self.saved_step = self.step
        self.log.truncate(self.step)

    def _load_sharded(self) -> None:
        """Continue from checkpoint/, written by this number of processes (exactly) or another one."""
        meta = None
        if self.dist.is_main:
            try:
                meta = read_meta(self.checkpoint_path)
            except ValueError as err:
                meta = {"error": f"cannot resume: {err}{self._other_format_hint()}"}
        meta = distributed.broadcast_object(meta)
        if "error" in meta:
            raise ValueError(meta["error"])
        check_model_config(meta["model_config"], self.model.config)
        self._check_resumable(meta)
        if meta.get("split_qkv", False) == self.split_qkv:
            load_sharded(self.checkpoint_path, self.model, self.optimizer_step.optimizer)  # weights: exact
        else:
            self._load_other_qkv_layout()
        self.optimizer_step.step = meta["step"]
        # Older checkpoints (FSDP only) have no mesh: as many data streams as processes.
        if tuple(meta.get("mesh", (len(meta["batches"]), 1))) == (self.dp, self.tp):
            self.batches.load_state_dict(meta["batches"][self.dist.rank])
            set_rng_state(meta["rng"][self.dist.rank])
        else:
            self._reseed(len(meta["batches"]), tuple(meta.get("mesh", (len(meta["batches"]), 1))))
        self.saved_step = self.step
        self.log.truncate(self.step)

    def _check_resumable(self, state: dict) -> None:
        """ValueError if the checkpoint's optimizer or training tokens are not this run's (before loading any)."""
        saved = state["train_config"].get("optimizer", "adamw")  # checkpoints from before Muon: AdamW
        if saved != self.config.optimizer:
            raise ValueError(f"cannot resume: the checkpoint holds the state of optimizer {saved!r}, this run uses "
                             f"{self.config.optimizer!r} (pretrain.py: --optimizer); resume with the run's own")
        tokens = {batches["num_tokens"] for batches in state["batches"]}
        if tokens != {len(self.batches.tokens)}:
            raise ValueError(f"cannot resume: the checkpoint's run trained on {min(tokens):,} tokens, this run's "
                             f"training split has {len(self.batches.tokens):,}: its data or tokenizer differ "
                             f"(pretrain.py: --data, --tokenizer, --val-fraction); resume with the run's own")

    def _load_other_qkv_layout(self) -> None:
        """Load a checkpoint whose attention stores q, k, v the other way (split under tensor parallelism,
        fused otherwise): renamed through whole tensors (``resume.load_sharded_renamed``)."""
        sizes = qkv_sizes(self.model.config)
        convert = functools.partial(split_qkv_state, sizes=sizes) if self.split_qkv else fused_qkv_state
        load_sharded_renamed(self.checkpoint_path, self.model, self.optimizer_step.optimizer, convert)

    def _reseed(self, saved_world_size: int, saved_mesh: tuple[int, int]) -> None:
        """New data streams and random state after a resume on another mesh (number of processes, dp x tp).

        Each data-parallel rank had its own stream of windows; N streams do not become M. The new ones
        are seeded from (seed, step, world size): reproducible, and unlike the streams of step 0.
        """
        if self.dist.is_main:
            warnings.warn(f"the checkpoint was written by {saved_world_size} process(es) (dp x tp = {saved_mesh[0]} x "
                          f"{saved_mesh[1]}) and this run has {self.dist.world_size} ({self.dp} x {self.tp}): weights "
                          f"and optimizer state continue exactly, the data streams cannot (they start anew, seeded "
                          f"from the step)", stacklevel=4)
        seed = int(np.random.SeedSequence([self.config.seed, self.step, self.dist.world_size]).generate_state(1)[0])
        batches = self.batches
        self.batches = RandomWindowBatches(batches.tokens, batches.batch_size, batches.context_length, seed=seed,
                                           rank=self.dp_rank, world_size=self.dp)
        torch.manual_seed(seed + self.dp_rank)

    def _other_format_hint(self) -> str:
        """Advice when the run folder holds the other kind of checkpoint (saved with the other --parallel)."""
        sharded = self.config.parallel != "ddp"
        other = self.out_dir / (CHECKPOINT_FILE if sharded else SHARDED_CHECKPOINT_DIR)
        if not other.exists():
            return ""
        return (f"; {self.out_dir} holds {other.name}{'' if sharded else '/'} instead, written with parallel="
                f"{'ddp' if sharded else 'fsdp, tp or fsdp+tp'}: resume with that setting")

    def export(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write the weights as one ordinary model.safetensors (rank 0); every process must call it.

        Sharded, the full weights are gathered to rank 0's CPU first (one tensor at a time on the
        device, so a model larger than one device's memory still exports).
        """
        if self.sharded:
            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                              cpu_offload=True))
            state = fused_qkv_state(state)  # tensor parallel: q, k, v back into the one qkv matrix
        else:
            state = self.model.state_dict()
        if self.dist.is_main:
            export_state_dict(state, self.model.config, path, self.tokenizer, dtype)
        distributed.barrier()

    def finish(self) -> dict:
        """The summary (final validation metrics, speed, the last sample), also written to the run folder."""
        last_eval = next(r for r in reversed(self.history) if "val_loss" in r)  # the last step always has one
        sample = next((r["sample"] for r in reversed(self.history) if "sample" in r), None)
        steps_here = len(self.history)
        summary = {
            "steps": self.step,
            "tokens_seen": self.step * self.tokens_per_step,
            "parameters": self.model.num_params(),
            "val_loss": last_eval["val_loss"],
            "val_perplexity": last_eval["val_perplexity"],
            "val_bits_per_byte": last_eval["val_bits_per_byte"],
            "train_seconds": self.train_seconds,  # this process's training time (since a resume, if any)
            "tokens_per_s": steps_here * self.tokens_per_step / self.train_seconds if self.train_seconds else None,
            "sample": sample,
        }
        self.log.finish(summary)  # summary.json and sample.txt
        return summary
