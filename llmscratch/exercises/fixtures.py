"""What the chapters' checkers share: tiny seeded models, random token ids, and small ways to run a model.

A checker builds its inputs here so that every chapter's cases are the same kind of thing: a
2-layer GPT of 16 dimensions on a 64-token vocabulary, GPT-2 style or Llama-style, with seeded
weights and seeded ids.
"""

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from llmscratch.exercises.checking import Mismatch, attempt, describe
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT

__all__ = ["VOCAB", "build_module", "calls_recorded", "decoded", "flat_parameters", "lm_backward",
           "loss_and_gradient", "tiny_gpt", "token_ids"]

VOCAB = 64  # the tiny models' vocabulary: ids 0 .. 63
LLAMA_STYLE = dict(n_kv_heads=2, norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False, bias=False)


def tiny_gpt(llama: bool = True, seed: int = 0, *, n_layers: int = 2, dropout: float = 0.0,
             lively: bool = False) -> GPT:
    """A small random GPT-2 (learned positions) or Llama-style model (RoPE, 4 query heads on 2 kv heads), in eval mode.

    lively: weights far larger than GPT-2's init, so that the next-token distributions are peaked and
    depend on the earlier tokens and their positions (at the init, the model mostly repeats its input).
    """
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=VOCAB, context_length=16, d_model=16, n_layers=n_layers, n_heads=4,
                          dropout=dropout, **(LLAMA_STYLE if llama else {})))
    if lively:
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if weight.dim() >= 2:
                    weight.normal_(0.0, 1.0 if "embedding" in name else 0.5)
    return model.eval()


def token_ids(shape: tuple, generator: torch.Generator, *, vocab: int = VOCAB, end_at: tuple = (0, -1)) -> torch.Tensor:
    """Random token ids of shape ``shape``, the vocabulary's last id (vocab - 1) at ``end_at``."""
    ids = torch.randint(vocab, shape, generator=generator)
    ids[end_at] = vocab - 1
    return ids


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """Every parameter of ``model`` in one vector (a copy)."""
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def loss_and_gradient(model: GPT, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The mean loss of one batch and its gradient, every parameter's flattened into one vector."""
    model.zero_grad(set_to_none=True)
    loss = model(inputs, targets=targets)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def lm_backward(model: GPT, idx: torch.Tensor) -> None:
    """Backward through the next-token loss of ``idx`` (B, T): its first T - 1 tokens predict the last T - 1."""
    model(idx[:, :-1], targets=idx[:, 1:]).backward()


@contextlib.contextmanager
def calls_recorded(model: GPT) -> Iterator[list[tuple]]:
    """Inside the block, a list that records the (B, T) of every call of ``model``."""
    shapes = []

    def record(module, args, kwargs):
        idx = args[0] if args else kwargs.get("idx")
        shapes.append(tuple(idx.shape))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield shapes
    finally:
        hook.remove()


def decoded(model: GPT, idx: torch.Tensor, prefill_len: int, *, tensor_positions: bool = False) -> torch.Tensor:
    """The logits (B, T, V) of cached decoding: ``prefill_len`` tokens at once, then one at a time.

    tensor_positions: pass each step's position as ``input_pos`` (a tensor, generate's way), not ``start_pos``.
    """
    caches = model.make_kv_caches(idx.size(0))
    pieces = [model(idx[:, :prefill_len], caches)]
    for pos in range(prefill_len, idx.size(1)):
        where = dict(input_pos=torch.tensor([pos])) if tensor_positions else dict(start_pos=pos)
        pieces.append(model(idx[:, pos:pos + 1], caches, **where))
    return torch.cat(pieces, dim=1)


def build_module(answer: Callable, *args: Any, case: str, hint: str,
                 shown: Callable[[Any], str] = describe) -> nn.Module:
    """``answer(*args)``, which must be an ``nn.Module``; ``shown`` says what came back instead."""
    module = attempt(answer, *args, case=case)
    if not isinstance(module, nn.Module):
        raise Mismatch(case, "an nn.Module", shown(module), hint)
    return module
