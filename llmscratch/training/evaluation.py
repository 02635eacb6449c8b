"""Evaluation of a language model: loss, perplexity and bits per byte over held-out text.

Loss per token depends on the tokenizer (a character model predicts more, easier tokens
than a BPE model), so runs with different vocabularies are compared in bits per byte: the
total loss in bits divided by the number of UTF-8 bytes the predicted tokens stand for.
Scores of generated text and multiple choice are in ``llmscratch.alignment.metrics``.
"""

import math

import numpy as np
import torch
from torch import nn

from llmscratch.device import autocast
from llmscratch.model.gpt import evaluating, unwrap
from llmscratch.model.losses import IGNORE_INDEX
from llmscratch.training import distributed


def token_byte_lengths(tokenizer, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) float64: UTF-8 byte length of each token id (0 for special and padding ids).

    ``tokenizer.vocab`` maps id -> bytes, as ``BPETokenizer`` does; its ``added_text`` tokens count as text.
    """
    lengths = torch.zeros(vocab_size, dtype=torch.float64)
    text = {tokenizer.special_tokens[name]: name.encode("utf-8") for name in getattr(tokenizer, "added_text", ())}
    for token_id, token in {**tokenizer.vocab, **text}.items():  # added text (Qwen3's "<think>") is text too
        if token_id >= vocab_size:
            raise ValueError(f"token id {token_id} does not fit a model vocabulary of {vocab_size}")
        lengths[token_id] = len(token)
    return lengths


def bits_per_byte(loss: float, bytes_per_token: float) -> float:
    """Convert a loss in nats per token to bits per byte of text."""
    return loss / math.log(2) / bytes_per_token


@torch.no_grad()
def evaluate(model: nn.Module, tokens: np.ndarray, token_bytes: torch.Tensor, batch_size: int,
             device: torch.device, dtype: torch.dtype = torch.float32, max_tokens: int | None = None,
             dist_info: distributed.DistInfo = distributed.DistInfo(), lockstep: bool = False) -> dict[str, float]:
    """Loss (nats/token), perplexity and bits per byte over consecutive windows of ``tokens``.

    The first ``max_tokens`` tokens (all by default) are cut into windows of the model's
    context length, and every token of a window but the first is predicted once. With several
    processes each evaluates every world_size-th window and the sums are added up, so every
    process gets the same numbers. ``model`` is a ``GPT`` (compiled or not) and computes the loss
    itself (``model(inputs, targets=...)``); it must not be DDP-wrapped (its forward would talk
    to the other processes, which evaluate different windows). ``lockstep``: every process runs
    the same number of forward passes (a sharded model computes each one with all processes); one
    with fewer windows runs its last batch again, uncounted. The sums are taken over all processes
    of the default group: ranks that share ``dist_info.rank`` (a tensor-parallel group) add equal
    totals, which leaves the ratios as they are.
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError("evaluate the model inside DistributedDataParallel, not the wrapper")
    context = unwrap(model).config.context_length
    usable = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
    n_windows = (usable - 1) // context
    if n_windows < 1:
        raise ValueError(f"evaluation needs at least context_length + 1 = {context + 1} tokens, got {usable}")
    nats = count = n_bytes = 0.0
    mine = range(dist_info.rank, n_windows, dist_info.world_size)
    most = math.ceil(n_windows / dist_info.world_size) if lockstep else len(mine)  # windows of the busiest rank
    with evaluating(model):
        for first in range(0, most, batch_size):
            starts = [s * context for s in mine[first : first + batch_size]]
            n_real = len(starts)
            # A short last batch is padded with copies of its last window (and their loss dropped):
            # one shape for every batch, so a compiled model is not compiled again for the remainder.
            starts += (starts[-1:] or [0]) * (batch_size - n_real)
            windows = np.stack([tokens[s : s + context + 1] for s in starts])  # (B, T + 1)
            windows = torch.from_numpy(windows.astype(np.int64)).to(device)
            inputs, targets = windows[:, :-1], windows[:, 1:].clone()  # (B, T) each
            n_bytes += token_bytes[targets[:n_real].cpu()].sum().item()
            targets[n_real:] = IGNORE_INDEX  # the padding rows do not count
            with autocast(device, dtype):
                mean = model(inputs, targets=targets)  # () mean over the real rows; no (B, T, V) logits kept
            nats += mean.item() * n_real * context if n_real else 0.0  # (no real rows: the mean is 0/0)
            count += n_real * context
    # float64 keeps the sums exact enough; on CUDA the tensor must live on the GPU for NCCL.
    totals = torch.tensor([nats, count, n_bytes], dtype=torch.float64,
                          device=device if device.type == "cuda" else "cpu")
    nats, count, n_bytes = distributed.all_reduce_sum(totals).tolist()
    loss = nats / count
    bytes_per_token = n_bytes / count
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "bits_per_byte": bits_per_byte(loss, bytes_per_token) if n_bytes else float("nan"),
            "bytes_per_token": bytes_per_token}


def held_out_bits(model: nn.Module, tokenizer, text: str, device: torch.device, batch_size: int = 16,
                  max_windows: int | None = None) -> dict[str, float]:
    """The model's bits per byte on ``text``, in windows of its context (the first ``max_windows`` only, if given),
    beside a uniform guess's over its vocabulary: "bits_per_byte", "uniform_bits_per_byte", and "predicted", the
    number of tokens scored."""
    tokens = np.array(tokenizer.encode(text, allowed_special="all"), dtype=np.int64)
    context = model.config.context_length
    max_tokens = None if max_windows is None else max_windows * context + 1
    result = evaluate(model, tokens, token_byte_lengths(tokenizer, model.config.vocab_size), batch_size, device,
                      max_tokens=max_tokens)
    usable = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
    # What a model that learned nothing pays: ln V nats for every token, whatever it is.
    uniform = bits_per_byte(math.log(model.config.vocab_size), result["bytes_per_token"])
    return {"bits_per_byte": result["bits_per_byte"], "uniform_bits_per_byte": uniform,
            "predicted": (usable - 1) // context * context}
