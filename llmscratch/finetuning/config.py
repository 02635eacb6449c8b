"""What a finetuning run is asked to do: ``FinetuneConfig`` and its ``LoRAConfig``, each field checked once."""

from dataclasses import dataclass, field

import torch

from llmscratch.config import below_one, check_fields, fraction, non_negative, positive, positive_int, setting
from llmscratch.device import DTYPES
from llmscratch.training.config import TrainConfig

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
