"""A tiny training setup shared by the training, checkpoint and distributed tests (not a test file).

A 300-token BPE and a two-layer Llama-style model of 32 dimensions: a step takes milliseconds. Also the
same size of run for ch04-pretraining/pretrain.py, and that script with a hook after each step.
"""

import functools
import textwrap
from pathlib import Path

import numpy as np
import torch

from llmscratch.assets import read_moby_dick
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.text.data import RandomWindowBatches
from llmscratch.text.tokenizer import ENDOFTEXT, BPETokenizer
from llmscratch.training.config import TrainConfig
from llmscratch.training.train import Trainer

TEXT = read_moby_dick()[:40_000]
SPLIT = 36_000  # characters: the rest is the validation text
PRETRAIN = Path(__file__).resolve().parents[1] / "ch04-pretraining" / "pretrain.py"
# pretrain.py's flags for a run of about this size (with --data, --out-dir and --max-steps of the test's own).
PRETRAIN_FLAGS = ["--tokenizer", "bpe:300", "--preset", "llama-tiny", "--context-length", "16", "--batch-size", "2",
                  "--eval-tokens", "128", "--final-eval-tokens", "256", "--peak-tflops", "1", "--no-progress"]


@functools.cache
def tokenizer() -> BPETokenizer:
    return BPETokenizer.train(TEXT[:SPLIT], 300, special_tokens=[ENDOFTEXT], name="tiny")


@functools.cache
def tokens() -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) token arrays, read-only so that no test changes them for another."""
    train = np.array(tokenizer().encode(TEXT[:SPLIT]), dtype=np.uint16)
    val = np.array(tokenizer().encode(TEXT[SPLIT:]), dtype=np.uint16)
    train.flags.writeable = val.flags.writeable = False
    return train, val


# The two designs the distributed tests train: Llama-style with grouped-query attention (4 query heads,
# 2 key/value heads; untied head) and GPT-2-style (biases, learned positions, tied head).
DESIGNS = {"llama": {"tie_embeddings": False},
           "gpt2": {"norm": "layernorm", "mlp": "gelu", "position": "learned", "qkv_bias": True, "bias": True,
                    "n_kv_heads": None, "tie_embeddings": True}}


def model_config(**overrides) -> GPTConfig:
    fields = dict(vocab_size=320, context_length=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                  norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False, bias=False)
    return GPTConfig(**{**fields, **overrides})


def train_config(**overrides) -> TrainConfig:
    # Evaluation, samples and checkpoints only at the end unless a test asks; a fixed MFU peak
    # so that no test measures (and caches) this machine's matmul speed.
    fields = dict(max_steps=8, batch_size=4, lr=3e-3, min_lr=3e-4, warmup_steps=2, eval_interval=1000,
                  eval_tokens=256, final_eval_tokens=512, checkpoint_interval=1000, sample_interval=1000,
                  sample_tokens=8, log_interval=1000, seed=0, peak_tflops=1.0)
    return TrainConfig(**{**fields, **overrides})


def make_trainer(out_dir, model_overrides: dict | None = None, dist_info=None, **train_overrides) -> Trainer:
    """A Trainer on the tiny data; the same seed gives the same initial weights every time."""
    torch.manual_seed(0)
    model = GPT(model_config(**(model_overrides or {})))
    train, val = tokens()
    extra = {} if dist_info is None else {"dist_info": dist_info}
    return Trainer(model, train_config(**train_overrides), train, val, out_dir, tokenizer(), **extra)


def losses(trainer: Trainer) -> list[float]:
    return [record["loss"] for record in trainer.history]


class StopAfter(Trainer):
    """A Trainer that asks to stop after step ``stop_at`` (as SIGTERM would): ``trainer.__class__ = StopAfter``."""

    stop_at = 3

    def _record(self, *args) -> None:
        super()._record(*args)
        if self.step == self.stop_at:
            self.request_stop()


# pretrain.py run as itself, but with {hook} run after each step is recorded (``self`` the Trainer).
HOOKED_PRETRAIN = """
import os, runpy, signal, sys, time
from pathlib import Path
from llmscratch.training.train import Trainer

record = Trainer._record

def record_then_hook(self, *args):
    record(self, *args)
{hook}

Trainer._record = record_then_hook
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def pretrain_with_hook(path: Path, hook: str) -> Path:
    """Write at ``path`` a script that is pretrain.py with ``hook`` (source) run after each recorded step."""
    path.write_text(HOOKED_PRETRAIN.format(hook=textwrap.indent(textwrap.dedent(hook), "    "), script=str(PRETRAIN)),
                    encoding="utf-8")
    return path


class JointBatches:
    """What two data-parallel ranks see together: rank 0's micro-batch, then rank 1's, as one batch."""

    def __init__(self, train: np.ndarray, batch_size: int = 2, seed: int = 0):
        self.streams = [RandomWindowBatches(train, batch_size, 16, seed=seed, rank=r, world_size=2) for r in range(2)]

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [next(stream) for stream in self.streams]  # (B, 16) inputs and targets each
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])  # (2B, 16) each
