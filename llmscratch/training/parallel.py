"""Sharded data parallel (FSDP2) and tensor parallelism (TP): each process keeps a part of the model.

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

Tensor parallelism (``apply_tp``, Megatron's split) cuts every block's matrices instead: each of tp
ranks computes its n_heads/tp query heads (n_kv_heads/tp key/value heads) and d_ff/tp of the MLP on
the whole batch, and one all-reduce after attention and one after the MLP sum the ranks' parts. The
ranks of a tp group read the same batches; ``fsdp+tp`` (a dp x tp mesh) shards those tp shards again
over dp with FSDP, as torchtitan does.

``parallelize`` does all of it for the Trainer. Sharded, the model is cut on PyTorch's "meta" device
(shapes, no memory) and only then given memory and filled from rank 0's weights, broadcast one tensor
at a time: the other ranks can build their GPT on "meta" too, so no process but rank 0 (on its CPU) and
no GPU ever holds the whole model.
"""

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.model.rope import RotaryEmbedding
from llmscratch.training.distributed import DistInfo
from llmscratch.training.memory import check_mesh

__all__ = ["GradientSync", "Parallelized", "SplitQKV", "apply_fsdp", "apply_tp", "checkpoint_activations",
           "fused_qkv_state", "is_sharded", "local_bytes", "mesh_shape", "parallelize", "qkv_sizes", "split_qkv_state"]

# DDP need not re-send buffers before each forward: the only ones (RoPE tables) are the same on every
# process by construction. Newer torch names the option forward_sync_buffers, older broadcast_buffers.
_NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                   if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
                   else {"broadcast_buffers": False})


@dataclasses.dataclass
class Parallelized:
    """A GPT set up for training under ``TrainConfig.parallel``: what runs it and how its ranks are laid out."""

    dp: int  # data-parallel ranks (each sees its own batches)
    tp: int  # tensor-parallel ranks per group (they see the same batches)
    sharded: bool  # the parameters are DTensors: FSDP and/or TP across several processes
    fsdp: bool  # sharded by FSDP (its policy casts to bfloat16, no autocast)
    compiled: nn.Module  # what evaluation runs: the model, through torch.compile or not
    wrapped: nn.Module  # what training steps run: ``compiled``, inside DDP under parallel="ddp"
    grad_sync: object | None  # what holds gradients back between micro-steps (DDP, GradientSync) or None
    autocast_dtype: torch.dtype  # the dtype of autocast (float32: none)


def mesh_shape(model_config: GPTConfig, config, world_size: int) -> tuple[int, int]:
    """(dp, tp) of ``world_size`` processes under ``config.parallel``; ValueError naming what does not divide."""
    tp = world_size if config.parallel == "tp" else config.tp  # tp: one group of all the processes
    return check_mesh(model_config, config.parallel, world_size, tp)


def parallelize(model: GPT, config, dist_info: DistInfo) -> Parallelized:
    """Move ``model`` to its device and split it across ``dist_info``'s processes as ``config.parallel`` says.

    The mesh (dp x tp) is checked first: tp must divide the processes, heads and d_ff
    (``memory.check_mesh``). Sharded (FSDP and/or TP) only across several processes: one process
    trains as under DDP. Tensor parallelism comes first, then FSDP shards the tp shards (as
    torchtitan does); compile comes before DDP's wrapper, so its no_sync and hooks stay plain Python.
    """
    dp, tp = mesh_shape(model.config, config, dist_info.world_size)
    if config.activation_checkpointing:
        checkpoint_activations(model)
    sharded = config.parallel != "ddp" and dist_info.enabled
    fsdp = sharded and config.parallel in ("fsdp", "fsdp+tp")
    if not sharded:
        model.to(dist_info.device)
    else:
        # Cut on the meta device, then filled from rank 0's weights (whole on its CPU): the other ranks may
        # build their GPT on "meta" too, so a large model is never whole on them, nor on any GPU.
        full = model.state_dict() if dist_info.is_main else {}
        model.to("meta")  # (new Parameter objects: the tied head is tied again below)
        if model.config.tie_embeddings:
            model.lm_head.weight = model.token_embedding.weight
        device_type = dist_info.device.type
        if tp == 1:
            dp_mesh = init_device_mesh(device_type, (dp,))
        else:
            mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
            apply_tp(model, mesh["tp"])
            full = split_qkv_state(full, qkv_sizes(model.config)) if full else full
            dp_mesh = mesh["dp"]
        if fsdp:
            apply_fsdp(model, dp_mesh, mixed_precision=config.dtype == "bfloat16")
        model.to_empty(device=dist_info.device)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_tables()  # buffers are not in a state dict
    compiled = torch.compile(model) if config.compile else model
    wrapped, grad_sync = compiled, None
    if fsdp:
        grad_sync = GradientSync(model)
    elif dist_info.enabled and not sharded:
        device_ids = [dist_info.device.index] if dist_info.device.type == "cuda" else None
        wrapped = grad_sync = nn.parallel.DistributedDataParallel(compiled, device_ids=device_ids, **_NO_BUFFER_SYNC)
    return Parallelized(dp=dp, tp=tp, sharded=sharded, fsdp=fsdp, compiled=compiled, wrapped=wrapped,
                        grad_sync=grad_sync, autocast_dtype=torch.float32 if fsdp else config.torch_dtype)


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


class SplitQKV(nn.Module):
    """The fused ``qkv`` Linear as three Linears q, k, v: the output is the same [q | k | v] concatenation.

    Tensor parallelism splits a Linear's output rows into tp contiguous chunks. On the fused matrix
    rank 0 would get all of q and none of k; split one by one, q, k and v each give rank r its own
    n_heads/tp query heads and n_kv_heads/tp key/value heads, whole GQA groups (query head h reads
    kv head h // group, and both ranges start at r/tp of their heads). ``fused_qkv_state`` turns
    the three back into the ordinary ``qkv.weight`` (and bias) for export, ``split_qkv_state`` cuts
    it again. (Permuting the fused rows to [q_r | k_r | v_r] per rank instead would keep one matrix,
    but a checkpoint would then hold the permuted matrix under the ordinary name: wrong, silently,
    for any reader that does not undo the permutation.)
    """

    def __init__(self, qkv: nn.Linear, sizes: tuple[int, int, int]):
        super().__init__()
        bias = qkv.bias is not None
        for name, weight, b in zip("qkv", qkv.weight.detach().split(sizes),
                                   qkv.bias.detach().split(sizes) if bias else (None,) * 3):
            linear = nn.Linear(qkv.in_features, weight.size(0), bias=bias, device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                linear.weight.copy_(weight)
                if bias:
                    linear.bias.copy_(b)
            setattr(self, name, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)  # (B, T, local q + k + v rows)


def apply_tp(model: GPT, mesh: DeviceMesh) -> GPT:
    """Split each block's attention heads and MLP across the ranks of the 1-D ``mesh`` (Megatron-style).

    Column-wise (output rows split; the input is the whole residual stream): q, k, v, and the MLP's
    fc / gate / up. Row-wise (input columns split; the outputs are summed by an all-reduce): out_proj
    and proj / down, whose biases stay whole. Embeddings, norms and the output head stay whole on
    every rank (replicated DTensors, ``_replicate``): the residual stream is whole on every rank, so
    are their gradients. Each rank then computes n_heads/tp query heads and n_kv_heads/tp key/value heads, so
    the attention module is given its local head counts. The sizes must divide (``memory.check_mesh``).
    """
    if model.config.n_experts is not None:
        raise ValueError("tensor parallelism does not support a mixture of experts (n_experts) yet: its experts "
                         "would be split by expert across ranks (expert parallelism), not by rows")
    if model.config.qk_norm:  # its gains would see each rank's own heads: their gradients need a sum over ranks
        raise ValueError("tensor parallelism does not support qk_norm=True yet (each rank's QK-norm gains would "
                         "get the gradient of its own heads only); use --parallel ddp or fsdp, or no QK-norm")
    tp = mesh.size()
    mlp = {"fc": ColwiseParallel(), "proj": RowwiseParallel()} if model.config.mlp not in ("swiglu", "geglu") else \
        {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
    plan = {"attn.qkv.q": ColwiseParallel(), "attn.qkv.k": ColwiseParallel(), "attn.qkv.v": ColwiseParallel(),
            "attn.out_proj": RowwiseParallel(), **{f"mlp.{name}": style for name, style in mlp.items()}}
    for block in model.blocks:
        attn = block.attn
        attn.qkv = SplitQKV(attn.qkv, attn.qkv_sizes)
        parallelize_module(block, mesh, plan)
        attn.n_heads, attn.n_kv_heads, attn.d_out = attn.n_heads // tp, attn.n_kv_heads // tp, attn.d_out // tp
        attn.qkv_sizes = tuple(size // tp for size in attn.qkv_sizes)
        for norm in (block.attn_norm, block.mlp_norm):
            _replicate(norm, mesh)
    for module in (model.token_embedding, model.position_embedding, model.final_norm, model.lm_head):
        if module is not None:
            _replicate(module, mesh)
    if model.config.tie_embeddings:
        model.lm_head.weight = model.token_embedding.weight
    return model


def _replicate(module: nn.Module, mesh: DeviceMesh) -> None:
    """Make ``module``'s parameters DTensors replicated over ``mesh``, its inputs and outputs staying plain.

    Every parameter is then a DTensor, as gradient clipping and AdamW's foreach kernels need (they
    refuse a mix of DTensors and tensors); each rank keeps the whole tensor and computes the same
    gradient for it, so no communication is added.
    """
    def inputs(module, args, mesh):
        return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False) if isinstance(a, torch.Tensor)
                     else a for a in args)

    def output(module, out, mesh):
        return out.to_local() if isinstance(out, DTensor) else out

    distribute_module(module, mesh, input_fn=inputs, output_fn=output)


def fused_qkv_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict of an ``apply_tp`` model with each ``qkv.{q,k,v}.*`` trio fused into ``qkv.*``.

    Also for per-parameter optimizer tensors (AdamW's moments); a 0-dim one (AdamW's step count,
    the same for all three) is q's.
    """
    fused = {}
    for name, tensor in state.items():
        prefix, _, rest = name.rpartition(".qkv.")
        part, _, kind = rest.partition(".")  # q, k or v; weight or bias
        if not prefix or part not in ("q", "k", "v"):
            fused[name] = tensor
        elif part == "q":
            trio = [state[f"{prefix}.qkv.{p}.{kind}"] for p in "qkv"]
            fused[f"{prefix}.qkv.{kind}"] = torch.cat(trio) if tensor.dim() else tensor
    return fused


def qkv_sizes(config) -> tuple[int, int, int]:
    """Rows of q, k and v in a GPT's fused qkv matrix (whole, not per tensor-parallel rank)."""
    kv_rows = config.kv_heads * config.head_dim
    return config.n_heads * config.head_dim, kv_rows, kv_rows


def split_qkv_state(state: dict[str, torch.Tensor], sizes: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    """The inverse of ``fused_qkv_state``: each whole ``qkv.*`` cut into q, k, v of ``sizes`` rows."""
    split = {}
    for name, tensor in state.items():
        prefix, _, kind = name.rpartition(".qkv.")
        if prefix and kind in ("weight", "bias"):
            parts = tensor.split(sizes) if tensor.dim() else (tensor,) * 3
            split.update({f"{prefix}.qkv.{p}.{kind}": part for p, part in zip("qkv", parts)})
        else:
            split[name] = tensor
    return split


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
