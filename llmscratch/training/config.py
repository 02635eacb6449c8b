"""What a pretraining run is asked to do: ``TrainConfig``, each field checked once when the config is made.

The fields are declared with ``llmscratch.config.setting`` (default, flag help and check written once);
``llmscratch.cli`` turns them into ``pretrain.py``'s flags.
"""

from dataclasses import dataclass

import torch

from llmscratch.config import (ConfigError, below_one, check_fields, fraction, non_negative, positive, positive_int,
                               setting)
from llmscratch.device import DTYPES

# How several processes share the model (llmscratch.training.parallel).
PARALLEL = ("ddp", "fsdp", "tp", "fsdp+tp")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")


@dataclass
class TrainConfig:
    """How to train: steps, batch, schedule, precision, and how often to evaluate, sample and save."""

    max_steps: int = setting(1000, "optimizer steps", positive_int)
    batch_size: int = setting(16, "sequences per micro-step on each process", positive_int)
    grad_accum: int = setting(1, "micro-steps per optimizer step: the global batch is batch-size x grad-accum x "
                                 "processes sequences", positive_int)
    lr: float = setting(1e-3, "peak learning rate", positive)  # reached after warmup
    min_lr: float = setting(1e-4, "where the decay ends", non_negative)  # and at most lr
    warmup_steps: int = setting(100, "linear warmup steps", non_negative)
    schedule: str = setting("cosine", "after the warmup: cosine decay to min_lr, or wsd (warmup-stable-decay): "
                                      "lr held, then a linear decay to min_lr over the last decay-fraction of "
                                      "the steps", choices=SCHEDULES)
    decay_fraction: float = setting(0.2, "wsd: the share of max-steps spent decaying", fraction)
    weight_decay: float = setting(0.1, "AdamW weight decay on weight matrices", non_negative)
    optimizer: str = setting("adamw", "adamw, or muon: Muon (orthogonalised momentum) for the blocks' weight "
                                      "matrices and AdamW for embeddings, head and gains, at the same lr",
                             choices=OPTIMIZERS)
    muon_momentum: float = setting(0.95, "Muon's momentum (Nesterov)", below_one)
    beta1: float = 0.9  # AdamW's betas, checked as a pair below
    beta2: float = 0.95
    grad_clip: float = setting(1.0, "clip the global gradient norm to this; 0 turns it off", non_negative)
    eval_interval: int = setting(250, "steps between evaluations", positive_int)
    eval_tokens: int = setting(32_768, "validation tokens per periodic evaluation", positive_int)
    final_eval_tokens: int | None = setting(None, "validation tokens of the final evaluation (default: all of them)",
                                            positive_int)
    checkpoint_interval: int = setting(250, "steps between checkpoints; one is always written at the end",
                                       positive_int)
    sample_interval: int = setting(500, "steps between samples", positive_int)
    sample_prompt: str = setting("Call me", "prompt of the samples")
    sample_tokens: int = setting(48, "tokens generated per sample", non_negative)
    sample_temperature: float = setting(0.8, "temperature of the samples; 0: greedy", non_negative)
    sample_top_k: int | None = setting(50, "sample among the k most likely tokens (None: all)", positive_int)
    log_interval: int = setting(10, "steps between tokens/s and MFU measurements", positive_int)
    dtype: str = setting("float32", "float32, bfloat16 (autocast) or float16 (autocast + gradient scaler)",
                         choices=sorted(DTYPES))
    compile: bool = setting(False, "run the model through torch.compile")
    parallel: str = setting("ddp", "how several processes (torchrun) share the model: ddp keeps a whole copy on "
                                   "each, fsdp shards weights, gradients and AdamW state across them (and saves "
                                   "a sharded checkpoint/ folder), tp splits every block's heads and MLP across "
                                   "all of them (each sees the same batch), fsdp+tp splits them across groups of "
                                   "--tp processes and shards that over the groups; one process trains the same "
                                   "either way", choices=PARALLEL)
    tp: int = setting(1, "tensor-parallel group size with --parallel fsdp+tp (it must divide the number of "
                         "processes, the heads, the key/value heads and d_ff); --parallel tp uses all processes",
                      positive_int)
    activation_checkpointing: bool = setting(False, "recompute each block's activations in backward instead of "
                                                    "storing them (less memory, about 1/3 more compute); "
                                                    "also on one process")
    seed: int = setting(1337, "seed of the weights, data order and samples")
    peak_tflops: float | None = setting(None, "peak TFLOP/s of one device for MFU (default: a table of GPUs, or "
                                              "this CPU measured once)", positive)
    max_time: float | None = setting(None, "seconds: stop early (with a final evaluation and checkpoint)", positive)

    def __post_init__(self):
        check_fields(self)
        if self.min_lr > self.lr:
            raise ConfigError("min_lr", f"must be at most lr={self.lr}", self.min_lr)
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"betas must be in [0, 1), got ({self.beta1}, {self.beta2})")
        if self.parallel != "ddp" and self.compile:
            raise ConfigError("parallel", f"cannot be {self.parallel} with compile (not supported here yet): drop "
                                          f"one of them", self.parallel)
        if self.parallel != "ddp" and self.dtype == "float16":
            raise ConfigError("parallel", f"cannot be {self.parallel} with dtype float16 (its gradient scaler does "
                                          f"not handle sharded gradients): use bfloat16 or float32", self.parallel)
        if self.optimizer == "muon" and self.parallel != "ddp":
            raise ConfigError("optimizer", f"cannot be muon with parallel={self.parallel}: Muon orthogonalises whole "
                                           "weight matrices, which sharding splits (use ddp or adamw)", self.optimizer)
        if self.tp != 1 and self.parallel != "fsdp+tp":
            raise ConfigError("tp", f"is the group size of --parallel fsdp+tp and must be 1 with parallel="
                                    f"{self.parallel} (tp uses every process)", self.tp)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
