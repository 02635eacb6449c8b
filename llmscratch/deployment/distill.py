"""Knowledge distillation: a small student trained on a frozen teacher's next-token distributions.

Hinton, Vinyals and Dean (2015), "Distilling the Knowledge in a Neural Network": the one right token
says little about the others; the teacher's whole distribution says which of them were plausible
too. Softened by a temperature T > 1, its small probabilities weigh more. The loss mixes both:

    loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * cross-entropy

The T^2 assumes a high temperature: where T is large against the logits' spread, softmax(z / T) is about
(1 + (z - mean z) / T) / V, the KL's gradient shrinks as 1 / T^2, and the factor keeps it on the
cross-entropy's scale, so that alpha alone sets the mix. Near T = 1 it does not: on a batch of the bundled
teacher the gradient times T^2 still falls 7.5x from T = 1 to 4 (ch07, section 3.2).

The defaults, T = 1 and alpha = 1 (the teacher's distribution alone), came first of four settings for
the default student after 60 steps (held-out bits per byte, seed 0: 2.536 at T = 1, alpha = 1; 2.590 at
T = 1, alpha = 0.5; 2.602 at T = 2, alpha = 0.5; 2.674 from scratch): a language model's next-token
distribution is soft already (the bundled teacher's loss is 4.6 nats per token), so it needs no
softening, and it carries more per token than the one token that came.

``DistillationTrainer`` is the pretraining ``Trainer`` with this loss. With alpha = 0 (or no teacher)
it is the ordinary Trainer, step for step: a distilled student and one trained from scratch differ in
the loss alone (same initial weights, data order, optimizer and schedule for a seed).
``teacher_agreement`` says how close a student came to its teacher on held-out text, and how often a
speculative decoder would accept its drafts.
"""

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from llmscratch.config import check_fields, fraction, positive, setting
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT, evaluating
from llmscratch.model.losses import IGNORE_INDEX
from llmscratch.text.data import split_text
from llmscratch.text.tokenizer import BPETokenizer
from llmscratch.training.config import TrainConfig
from llmscratch.training.train import Trainer

__all__ = ["STUDENT_SHAPE", "DistillConfig", "DistillationTrainer", "distillation_loss", "student_config",
           "teacher_agreement", "text_splits", "train_student"]

# The default student: a third of the bundled teacher's depth and half its width, about 6x fewer FLOPs per
# token (most of them in the 4,096-row output head), small enough to draft tokens for it cheaply.
STUDENT_SHAPE = {"n_layers": 2, "d_model": 128, "n_heads": 4, "n_kv_heads": 2, "d_ff": 576}


@dataclass(frozen=True)
class DistillConfig:
    """How much of the loss comes from the teacher, and how softened its distributions are."""

    temperature: float = setting(1.0, "softens both distributions in the KL term (T > 1: the teacher's small "
                                      "probabilities weigh more)", positive)
    alpha: float = setting(1.0, "weight of the teacher's KL term; 1 - alpha goes to the ordinary cross-entropy "
                                "(0: the student trains from scratch)", fraction)

    def __post_init__(self):
        check_fields(self)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                      temperature: float, alpha: float) -> torch.Tensor:
    """alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * cross-entropy(student, targets): a () mean per token.

    student_logits, teacher_logits: (..., V); targets: (...) next-token ids, IGNORE_INDEX (-100) for positions
    that do not count (both terms skip them). The KL is summed over the vocabulary and averaged over the
    counted tokens (``F.kl_div(..., reduction="batchmean")`` of (N, V) rows), in float32 or better whatever the
    logits' dtype. Why T^2: the KL's gradient with respect to a student logit is (q_T - p_T) / T, which for large T
    shrinks as 1 / T^2 (Hinton et al. 2015, section 2.1); the factor keeps it on the cross-entropy's scale,
    so that alpha alone sets the mix at high T (near T = 1 it does not: see the module docstring).
    """
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    if not (isinstance(alpha, (int, float)) and 0 <= alpha <= 1):
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if student_logits.size(-1) != teacher_logits.size(-1):
        raise ValueError(f"the student has {student_logits.size(-1)} logits per token and the teacher "
                         f"{teacher_logits.size(-1)}: distillation needs one vocabulary (the same tokenizer)")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} must have the same shape")
    if targets.shape != student_logits.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must have the logits' shape without the vocabulary, "
                         f"{tuple(student_logits.shape[:-1])}")
    dtype = torch.promote_types(student_logits.dtype, torch.float32)  # bfloat16 logits: float32 sums
    student = student_logits.to(dtype).flatten(0, -2)  # (N, V)
    targets = targets.flatten()  # (N,)
    loss = torch.zeros((), dtype=dtype, device=student.device)
    if alpha > 0:
        log_q = F.log_softmax(student / temperature, dim=-1)  # (N, V) the student's softened log-probabilities
        log_p = F.log_softmax(teacher_logits.to(dtype).flatten(0, -2) / temperature, dim=-1)  # (N, V) the teacher's
        kl = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)  # (N,) KL(p || q) of each token
        loss = loss + alpha * temperature**2 * kl[targets != IGNORE_INDEX].mean()
    if alpha < 1:
        loss = loss + (1 - alpha) * F.cross_entropy(student, targets, ignore_index=IGNORE_INDEX)
    return loss


def student_config(teacher: GPTConfig, **shape) -> GPTConfig:
    """The teacher's config (vocabulary, context, architecture) with the student's shape: STUDENT_SHAPE, then
    ``shape`` (any GPTConfig field). One vocabulary for both is what distillation and drafting need."""
    return dataclasses.replace(teacher, **{**STUDENT_SHAPE, "dropout": 0.0, **shape})


def text_splits(tokenizer: BPETokenizer, text: str, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) token arrays of ``text`` cut by characters as ch04's pretrain.py cuts it: the bundled teacher
    trained on the first 90% of Moby-Dick, so its held-out tenth is new to teacher and student alike."""
    train_text, val_text = split_text(text, val_fraction)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    return tuple(np.array(tokenizer.encode(part, allowed_special="all"), dtype=dtype)
                 for part in (train_text, val_text))


class DistillationTrainer(Trainer):
    """The pretraining Trainer whose loss is ``distillation_loss`` against a frozen teacher.

    The teacher runs in eval mode under no_grad: it gets no gradient and its weights never change (the
    optimizer holds the student's parameters alone). Without a teacher, or with alpha = 0, each step is the
    Trainer's own (the model's chunked cross-entropy), and the teacher is never run.
    """

    def __init__(self, student: GPT, teacher: GPT | None, config: TrainConfig, train_tokens: np.ndarray,
                 val_tokens: np.ndarray, out_dir: str | Path, tokenizer: BPETokenizer,
                 distill: DistillConfig = DistillConfig(), **trainer_options):
        if teacher is not None:
            if teacher.config.vocab_size != student.config.vocab_size:
                raise ValueError(f"the student's vocabulary has {student.config.vocab_size} ids and the teacher's "
                                 f"{teacher.config.vocab_size}: distillation needs one vocabulary")
            if teacher.config.context_length < student.config.context_length:
                raise ValueError(f"the student's context_length {student.config.context_length} is longer than the "
                                 f"teacher's {teacher.config.context_length}: the teacher cannot read its windows")
        super().__init__(student, config, train_tokens, val_tokens, out_dir, tokenizer, **trainer_options)
        self.teacher = None if teacher is None else teacher.to(self.device).eval()
        self.distill = distill

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.teacher is None or self.distill.alpha == 0:
            return super()._loss(batch)  # from scratch: exactly the ordinary training step
        inputs, targets = (t.to(self.device, non_blocking=True) for t in batch)  # (B, T) each
        with torch.no_grad():
            teacher_logits = self.teacher(inputs)  # (B, T, V), no graph
        student_logits = self.wrapped(inputs)  # (B, T, V)
        return distillation_loss(student_logits, teacher_logits, targets, self.distill.temperature,
                                 self.distill.alpha)  # () mean over B * T


def train_student(config: GPTConfig, teacher: GPT | None, tokenizer: BPETokenizer, train_tokens: np.ndarray,
                  val_tokens: np.ndarray, train: TrainConfig, distill: DistillConfig, out_dir: str | Path,
                  progress: bool = False, **trainer_options) -> tuple[GPT, dict]:
    """A fresh student of ``config`` (weights seeded by ``train.seed``) trained against ``teacher``; returns it
    and the Trainer's summary, plus ``wall_seconds`` (the whole fit: steps, evaluations, checkpoints)."""
    torch.manual_seed(train.seed)  # the same initial weights for the distilled and the from-scratch student
    trainer = DistillationTrainer(GPT(config), teacher, train, train_tokens, val_tokens, out_dir, tokenizer, distill,
                                  **trainer_options)
    start = time.perf_counter()
    summary = trainer.fit(progress=progress)
    return trainer.model, {**summary, "wall_seconds": time.perf_counter() - start}


@torch.no_grad()
def teacher_agreement(student: GPT, teacher: GPT, tokens: np.ndarray, batch_size: int = 8,
                      device: torch.device | str = "cpu", max_tokens: int | None = None) -> dict[str, float]:
    """How close the student's next-token distributions q are to the teacher's p at temperature 1, per token.

    Over consecutive windows of the first ``max_tokens`` of ``tokens`` (all by default): ``kl``, the mean
    KL(p || q) in nats; ``acceptance``, the mean of sum_v min(p_v, q_v), the chance that speculative sampling
    keeps a token drafted from q (Leviathan et al. 2023); ``top1_agreement``, how often both rank the same
    token first (greedy decoding keeps a greedy draft then).
    """
    context = min(student.config.context_length, teacher.config.context_length)
    usable = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
    n_windows = usable // context
    if n_windows < 1:
        raise ValueError(f"teacher_agreement needs at least one window of {context} tokens, got {usable}")
    sums = torch.zeros(3, dtype=torch.float64)  # KL, overlap, same first choice
    with evaluating(student), evaluating(teacher):
        for first in range(0, n_windows, batch_size):
            starts = range(first * context, min(first + batch_size, n_windows) * context, context)
            windows = np.stack([tokens[s : s + context] for s in starts]).astype(np.int64)  # (B, T)
            ids = torch.from_numpy(windows).to(device)
            log_q = F.log_softmax(student(ids).float(), dim=-1)  # (B, T, V)
            log_p = F.log_softmax(teacher(ids).float(), dim=-1)  # (B, T, V)
            kl = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)  # (B, T)
            overlap = torch.minimum(log_p, log_q).exp().sum(-1)  # (B, T)
            same = log_p.argmax(-1) == log_q.argmax(-1)  # (B, T)
            sums += torch.stack([kl.sum(), overlap.sum(), same.sum()]).double().cpu()
    kl, overlap, same = (sums / (n_windows * context)).tolist()
    return {"kl": kl, "acceptance": overlap, "top1_agreement": same}
