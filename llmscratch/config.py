"""What a run is asked to do: the pretraining and finetuning configs, each field checked once here.

A field is declared with ``setting``: its default, the help of its command-line flag and its check,
written once. The configs check every field when they are made (a ``ConfigError`` naming the field),
and ``llmscratch.cli`` turns the same fields into the scripts' flags.
"""

import math
import numbers
import types
from collections.abc import Callable, Sequence
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from llmscratch.device import DTYPES

__all__ = ["ConfigError", "DPOConfig", "FinetuneConfig", "GRPOConfig", "LoRAConfig", "PARALLEL", "TRAINABLE", "TrainConfig", "setting"]

# How several processes share the model (llmscratch.parallel).
PARALLEL = ("ddp", "fsdp", "tp", "fsdp+tp")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")

Check = Callable[[Any], str | None]  # the problem with a value ("must be ..."), or None when it is fine


class ConfigError(ValueError):
    """A value a config refuses: which field, what it must be, and what it got."""

    def __init__(self, name: str, problem: str, value: Any):
        super().__init__(f"{name} {problem}, got {value!r}")
        self.name, self.problem, self.value = name, problem, value


def setting(default: Any, help: str, check: Check | None = None, choices: Sequence | None = None):
    """A config field: its default, the help of its flag, and its check (or the values it may take)."""
    return field(default=default, metadata={"help": help, "check": check, "choices": choices})


def positive_int(value) -> str | None:
    return None if value >= 1 else "must be a positive integer"


def positive(value) -> str | None:
    return None if value > 0 else "must be positive"


def non_negative(value) -> str | None:
    return None if value >= 0 else "must be >= 0"


def fraction(value) -> str | None:
    return None if 0 <= value <= 1 else "must be in [0, 1]"


def below_one(value) -> str | None:
    return None if 0 <= value < 1 else "must be in [0, 1)"


def check_fields(config) -> None:
    """ConfigError for the first field its declaration refuses; None passes where the type allows it."""
    for f in fields(config):
        value = getattr(config, f.name)
        if "help" not in f.metadata or (value is None and optional(f.type)):
            continue
        choices, check = f.metadata["choices"], f.metadata["check"]
        if choices is not None:
            problem = None if value in choices else f"must be one of {list(choices)}"
        else:
            problem = kind_problem(f.type, value) or (check(value) if check else None)
        if problem:
            raise ConfigError(f.name, problem, value)


def kind_problem(annotation, value) -> str | None:
    """What is wrong with the kind of value for a field declared bool, int or float (bool is no number here)."""
    kinds = types_of(annotation)
    if bool in kinds:
        return None if isinstance(value, bool) else "must be True or False"
    if int in kinds:
        return None if isinstance(value, numbers.Integral) and not isinstance(value, bool) else "must be an integer"
    if float in kinds:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            return "must be a finite number"  # inf and NaN, said plainly
    return None


def types_of(annotation) -> tuple:
    """The types an annotation names: (int, NoneType) for ``int | None``."""
    return annotation.__args__ if isinstance(annotation, types.UnionType) else (annotation,)


def optional(annotation) -> bool:
    return type(None) in types_of(annotation)


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


# Every linear layer inside the blocks: attention (qkv, out_proj) and the MLP (GPT-2's fc, proj;
# Llama's gate, up, down). The output head is left out: it is often tied to the embedding.
DEFAULT_TARGETS = ("*.attn.qkv", "*.attn.out_proj", "*.mlp.*")


@dataclass(frozen=True)
class LoRAConfig:
    """Rank and scale of the adapters, and which linear layers get one (glob patterns on names)."""

    rank: int = setting(8, "rank of the LoRA matrices", positive_int)
    alpha: float = setting(16.0, "LoRA scale: the update is multiplied by alpha / rank", positive)
    dropout: float = setting(0.0, "dropout on the input of the LoRA update", below_one)
    targets: tuple[str, ...] = setting(DEFAULT_TARGETS, "glob patterns of the linear layers that get adapters",
                                       lambda value: None if value and not isinstance(value, str) else
                                       "must be a non-empty tuple of name patterns")

    def __post_init__(self):
        check_fields(self)
        object.__setattr__(self, "targets", tuple(self.targets))  # a list given is kept as a tuple


TRAINABLE = ("head", "last-k", "all", "lora")


@dataclass
class FinetuneConfig:
    """How to finetune: epochs, batch, learning rate, precision, and which parameters train."""

    epochs: int = setting(3, "passes over the training split", positive_int)
    batch_size: int = setting(8, "examples per optimizer step", positive_int)
    lr: float = setting(1e-4, "peak learning rate (warmup, then cosine decay)", positive)
    min_lr_ratio: float = setting(0.1, "end of the cosine decay, as a fraction of lr", fraction)
    warmup_fraction: float = setting(0.1, "share of all steps spent warming up", below_one)
    weight_decay: float = setting(0.1, "AdamW weight decay on weight matrices", non_negative)
    grad_clip: float = setting(1.0, "clip the global gradient norm to this; 0 turns it off", non_negative)
    dtype: str = setting("float32", "autocast precision (bfloat16 on recent GPUs); weights stay float32",
                         choices=sorted(DTYPES))
    seed: int = setting(123, "seed of the splits, shuffling and init")
    trainable: str = setting("all", "what trains: the head only, the last k blocks + final norm + head, "
                                    "everything, or LoRA adapters (+ the head)", choices=TRAINABLE)
    last_k: int = setting(1, "blocks that train with --trainable last-k", positive_int)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # used when trainable == "lora"

    def __post_init__(self):
        check_fields(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def train_config(self, steps_per_epoch: int) -> TrainConfig:
        """The pretraining config whose optimizer and schedule this run reuses."""
        steps = self.epochs * steps_per_epoch
        return TrainConfig(max_steps=steps, batch_size=self.batch_size, lr=self.lr, min_lr=self.lr * self.min_lr_ratio,
                           warmup_steps=int(self.warmup_fraction * steps), weight_decay=self.weight_decay,
                           grad_clip=self.grad_clip, dtype=self.dtype, seed=self.seed)


@dataclass
class DPOConfig(FinetuneConfig):
    """How to tune on preference pairs with DPO (``llmscratch.preference``): a finetuning run, plus DPO's settings."""

    batch_size: int = setting(8, "preference pairs per optimizer step (twice as many rows)", positive_int)
    beta: float = setting(0.1, "DPO's pull towards the starting model: small lets the model drift far from it",
                          positive)
    label_smoothing: float = setting(0.0, "the assumed chance that a pair's preference is wrong (conservative "
                                          "DPO); 0 trusts every pair",
                                     lambda value: None if 0 <= value < 0.5 else "must be in [0, 0.5)")
    sft_weight: float = setting(0.0, "weight of the chosen answers' next-token loss, added to DPO's to keep their "
                                     "likelihood up (RPO); 0: DPO alone", non_negative)


@dataclass
class GRPOConfig(FinetuneConfig):
    """How to tune with reinforcement learning on checked answers (``llmscratch.grpo``): a finetuning run that
    samples its own training data."""

    steps: int = setting(150, "sampling rounds; each samples a group per prompt, then updates", positive_int)
    prompts_per_step: int = setting(16, "training prompts per sampling round", positive_int)
    group_size: int = setting(8, "answers sampled per prompt: the group its advantages are measured in",
                              lambda value: None if value >= 2 else "must be at least 2")
    updates_per_step: int = setting(1, "optimizer steps on each round's samples (above 1, the clip matters)",
                                    positive_int)
    temperature: float = setting(1.0, "sampling temperature of the rounds", positive)
    clip: float = setting(0.2, "PPO's clip: the ratio to the sampling policy is held within 1 +- clip", positive)
    kl_weight: float = setting(0.0, "weight of the KL penalty to the starting model; 0: none (and no reference "
                                    "model kept)", non_negative)
    format_weight: float = setting(0.0, "reward for an answer of the right form, on top of 1 for a right one; "
                                        "with scaled advantages, wrong answers that differ only in form then get "
                                        "full-size advantages, so 0 by default", non_negative)
    scale_advantages: bool = setting(True, "divide each group's advantages by its reward spread (GRPO); off: "
                                           "Dr. GRPO's centred rewards")
    normalisation: str = setting("sequence", "how token losses are averaged: per answer then over answers, "
                                             "over all tokens, or by a constant", choices=("sequence", "token",
                                                                                           "constant"))
    max_new_tokens: int = setting(24, "longest sampled answer", positive_int)

    def train_config(self, steps_per_epoch: int = 0) -> TrainConfig:
        """The pretraining config whose optimizer and schedule this run reuses: one step per update."""
        return dataclasses.replace(super().train_config(1), max_steps=self.steps * self.updates_per_step,
                                   warmup_steps=int(self.warmup_fraction * self.steps * self.updates_per_step))
