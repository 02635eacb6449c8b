"""Sharded data parallel (FSDP2): each process keeps 1/N of the weights, gradients and AdamW state.

Under DDP every one of N processes holds the whole model: all parameters, all gradients and both
AdamW moments (16 bytes per float32 parameter). ``apply_fsdp`` turns each parameter into a
``DTensor`` sharded along its first dimension: rank r keeps the r-th of N row blocks of every
matrix (``param.to_local()``), so parameters, their gradients and the optimizer state built over
them are about 1/N per process. What happens in a step:

* forward: before a block runs, its parameters are all-gathered (the full block exists for a
  moment on every rank), and freed again after it ran;
* backward: the block is gathered again, its gradients are computed in full and then
  reduce-scattered: each rank keeps the averaged gradient rows of its own shard;
* optimizer: AdamW updates each rank's shard only, with no communication.

Every rank must run every forward (the gathers are collectives), so evaluation and sampling run on
all ranks. Sharding one ``Block`` at a time bounds what is unsharded at once to about one block;
the root (embeddings, final norm, the output head, tied to the embedding or not) is one more unit.
"""

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from llmscratch.model import GPT

__all__ = ["GradientSync", "apply_fsdp", "checkpoint_activations", "is_sharded", "local_bytes"]


def apply_fsdp(model: GPT, mesh: DeviceMesh | None, mixed_precision: bool = False) -> GPT:
    """Shard ``model`` in place over ``mesh`` (None: all processes); returns the same GPT.

    Each ``Block`` becomes one FSDP unit, then the root takes what is left. With a tied output
    head the shared matrix stays one parameter (``lm_head.weight is token_embedding.weight``).
    mixed_precision: FSDP's own bfloat16 policy instead of autocast: the float32 shards are
    gathered as bfloat16 (half the traffic, bfloat16 compute) and gradients are reduced in
    float32; the optimizer keeps updating float32 shards.
    """
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def checkpoint_activations(model: GPT) -> GPT:
    """Keep only each block's input in the forward pass and recompute the block in backward.

    Activation memory drops from every intermediate of every block to one tensor (B, T, d) per
    block plus one block's intermediates at a time, for about one more forward of compute.
    The parameter names do not change (the block's forward is replaced, not wrapped in a module);
    dropout masks are recomputed from the saved random state, so the gradients are the same.
    """
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def is_sharded(model: nn.Module) -> bool:
    """True when ``model``'s parameters are DTensors (sharded by ``apply_fsdp``)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


class GradientSync:
    """``no_sync()`` for an FSDP model, like DDP's: the micro-steps inside keep gradients unreduced.

    Inside, each rank accumulates the full (unsharded) gradients of the micro-batches; the last
    micro-step's backward reduce-scatters their sum once. That saves N-1 reduce-scatters per step
    at the cost of holding full gradients between micro-steps (``OptimizerStep`` calls it).
    """

    def __init__(self, model: nn.Module):
        self.model = model

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this process holds for parameters, gradients and optimizer state (its shards, under FSDP).

    A tied matrix counts once. Gradients are counted where they exist (after a backward, before
    ``zero_grad``); an optimizer's state exists after its first step. FSDP pads a shard's first
    dimension to a multiple of N internally; these are the unpadded shard sizes (``to_local()``).
    """
    params = list(model.parameters())  # each shared parameter once
    nbytes = {"parameters": sum(_local(p).numel() * p.element_size() for p in params),
              "gradients": sum(_local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None),
              "optimizer": 0}
    if optimizer is not None:
        for state in optimizer.state.values():
            nbytes["optimizer"] += sum(_local(v).numel() * v.element_size() for v in state.values()
                                       if isinstance(v, torch.Tensor) and v.dim() > 0)  # not the step count
    return nbytes
