"""How much memory one GPU needs to train a GPT under DDP, FSDP, tensor parallelism or both: a planner on paper.

``python -m llmscratch.training.memory --preset tinyllama-1.1b --gpus 8`` prints, per GPU, the bytes of parameters,
gradients, AdamW state, working buffers and activations for each strategy, and whether they fit.
Mixed precision as the course does it: parameters, gradients and AdamW's two moments stay float32 masters
(4 + 4 + 8 bytes per parameter); ``dtype`` is the precision of the compute and of the activations.

What each GPU holds (N GPUs, a mesh of dp x tp = N):
- ddp: everything replicated. Buffers: DDP's gradient buckets (a second float32 copy of the gradients) and,
  in bfloat16, the copies of the weights that autocast makes and keeps for backward.
- fsdp: each parameter split along dim 0 into dp chunks, as ``torch.chunk`` does (ceil(rows / dp) rows, the
  last ranks fewer or none); its gradient and AdamW state follow it. Buffers: the units FSDP gathers in the
  compute dtype: the root unit (embeddings, final norm, head; FSDP keeps the root gathered from forward
  through backward), plus the larger of its gradients or two blocks' parameters (the one computing, the one
  prefetched) and one block's gradients before the reduce-scatter.
- tp: each block's attention and MLP matrices split across tp ranks (qkv, fc/gate/up by rows, out_proj and
  proj/down by columns, Megatron-style), embeddings, norms and the row-split layers' biases replicated;
  activations inside attention and the MLP split, the residual stream not. Replicated over dp = N / tp.
- fsdp+tp: the tp shards, each split again over dp by FSDP.
A mixture of experts holds every expert (parameters, gradients and AdamW state count them all) while its
activations follow the k experts each token goes through; tensor parallelism does not split experts.
Parameter, gradient and optimizer numbers are checked against the local tensors of real runs: ddp and fsdp in
tests/test_memory.py, tp and fsdp+tp in tests/test_tensor_parallel.py (parameters). The tp activations and the
activation-checkpointing formula are checked on paper only.
"""

import argparse
import functools
import math
from dataclasses import dataclass, replace

import torch

from llmscratch.model.config import PRESETS, GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.model.losses import default_chunk_rows

__all__ = ["STRATEGIES", "MemoryPlan", "activation_bytes", "check_mesh", "loss_workspace_bytes", "plan",
           "shard_rows"]

STRATEGIES = ("ddp", "fsdp", "tp", "fsdp+tp")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
GIB = 2**30
MASTER = 4  # float32 parameters, gradients and each AdamW moment
# Parameters that tensor parallelism splits, by the end of their names: by rows (dim 0) or by columns (dim 1).
SPLIT_ROWS = ("attn.qkv.weight", "attn.qkv.bias", "mlp.fc.weight", "mlp.fc.bias", "mlp.gate.weight",
              "mlp.gate.bias", "mlp.up.weight", "mlp.up.bias")
SPLIT_COLUMNS = ("attn.out_proj.weight", "mlp.proj.weight", "mlp.down.weight")


def check_mesh(config: GPTConfig, strategy: str, world_size: int, tp: int) -> tuple[int, int]:
    """The mesh (dp, tp) of ``world_size`` processes; ValueError naming what does not divide."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown parallel strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size (the number of GPUs) must be a positive integer, got {world_size!r}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp (the tensor-parallel size) must be a positive integer, got {tp!r}")
    if strategy in ("ddp", "fsdp") and tp != 1:
        raise ValueError(f"{strategy} has no tensor parallelism: tp must be 1, got tp={tp}")
    if world_size % tp:
        raise ValueError(f"tp={tp} does not divide world_size={world_size}: the mesh is dp x tp processes")
    if tp > 1 and config.n_experts is not None:
        raise ValueError(f"tp={tp}: tensor parallelism does not support a mixture of experts (n_experts) yet")
    for name, size in (("n_heads", config.n_heads), ("n_kv_heads", config.kv_heads), ("d_ff", config.hidden_dim)):
        if size % tp:  # each rank computes whole heads and an equal slice of the MLP
            raise ValueError(f"tp={tp} does not divide {name}={size}: each tensor-parallel rank takes "
                             f"{name}/tp of them")
    return world_size // tp, tp


def shard_rows(rows: int, shards: int, rank: int) -> int:
    """Rows of a ``rows``-row tensor that ``rank`` holds when split in ``shards`` as ``torch.chunk`` does."""
    chunk = -(-rows // shards)  # ceil: FSDP pads to a multiple of shards, the padding is nobody's
    return max(0, min(chunk, rows - rank * chunk))


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes on one GPU (the rank with the largest shards, FSDP's rank 0, unless another was asked for)."""

    strategy: str
    dp: int
    tp: int
    parameters: int  # float32 masters of this rank's shards
    gradients: int  # float32, as the parameters
    optimizer: int  # AdamW: two float32 moments, plus a float32 step counter per parameter tensor
    buffers: int  # what the strategy adds for a step: gathered FSDP units, DDP buckets, autocast copies
    activations_saved: int  # tensors autograd keeps for backward over one micro-batch (see activation_bytes)
    loss_workspace: int  # the chunked loss's buffers, alive while every activation is (see loss_workspace_bytes)
    gpu_memory: int

    @property
    def activations(self) -> int:
        return self.activations_saved + self.loss_workspace

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.buffers + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_memory


@functools.cache
def _parameters(config: GPTConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter, a tied one once: the real module, built on the meta device (no memory).

    One block of each kind (a dense MLP or a mixture of experts) is built and its shapes repeated for the
    others of its kind: a model of many blocks is planned in the time of one or two.
    """
    kinds = {}  # is_moe -> (shapes around the blocks, the block's (name, shape)s)
    for moe in sorted({config.is_moe(i) for i in range(config.n_layers)}):
        with torch.device("meta"):
            model = GPT(replace(config, n_layers=1, layer_types=None, dense_layers=() if moe else (0,)))
        shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
        first = next(i for i, (name, _) in enumerate(shapes) if name.startswith("blocks.0."))
        block = [(name.removeprefix("blocks.0."), shape) for name, shape in shapes if name.startswith("blocks.0.")]
        kinds[moe] = (shapes[:first], block, shapes[first + len(block):])
    before, _, after = next(iter(kinds.values()))
    blocks = [(f"blocks.{i}.{name}", shape) for i in range(config.n_layers) for name, shape in
              kinds[config.is_moe(i)][1]]
    return tuple(before + blocks + after)


def _tp_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    if name.endswith(SPLIT_ROWS):
        return (shape[0] // tp, *shape[1:])
    if name.endswith(SPLIT_COLUMNS):
        return (shape[0], shape[1] // tp)
    return shape


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _unit(name: str) -> str:
    """The FSDP unit a parameter belongs to: its block (blocks.3), or the root."""
    return ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"


def plan(config: GPTConfig, strategy: str, gpus: int, tp: int = 1, batch_size: int = 1,
         context_length: int | None = None, dtype: str = "float32", activation_checkpointing: bool = False,
         gpu_memory_gib: float = 80.0, rank: int = 0, device_type: str = "cuda") -> MemoryPlan:
    """Per-GPU bytes of a training step of ``config`` under ``strategy`` on ``gpus`` GPUs.

    batch_size: sequences per GPU per micro-batch; context_length: tokens per sequence (default the
    model's); dtype: of compute and activations; rank: which FSDP shard (0 has the most rows); device_type:
    where the step runs ("cpu" for the runs on gloo: the loss's chunks are smaller there).
    """
    dp, tp = check_mesh(config, strategy, gpus, tp)
    context_length = config.context_length if context_length is None else context_length
    if not 1 <= context_length <= config.context_length:
        raise ValueError(f"context_length must be in 1..{config.context_length} (the model's), got {context_length}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if not 0 <= rank < dp:
        raise ValueError(f"rank must be in 0..{dp - 1} (the data-parallel ranks), got {rank}")
    compute = DTYPE_BYTES[dtype]
    shards = dp if strategy in ("fsdp", "fsdp+tp") else 1
    local = 0  # elements of this rank's shards
    tensors = 0
    unit_elements: dict[str, int] = {}  # what FSDP gathers: each unit's tp-local elements
    for name, shape in _parameters(config):
        shape = _tp_shape(name, shape, tp)
        rows = shard_rows(shape[0], shards, rank if shards > 1 else 0)
        local += rows * _numel(shape[1:])
        tensors += 1
        unit_elements[_unit(name)] = unit_elements.get(_unit(name), 0) + _numel(shape)
    if shards > 1:
        root = unit_elements.pop("root")
        block = max(unit_elements.values(), default=0)
        buffers = compute * (root + max(root, 3 * block))  # root gathered + (root grads, or 2 blocks + 1 block's grads)
    else:
        buffers = MASTER * local if dp > 1 else 0  # DDP's gradient buckets
        if compute != MASTER:  # autocast's cast copies of the matrices (and of the head, in the loss)
            buffers += compute * sum(e for e in unit_elements.values())
    return MemoryPlan(
        strategy=strategy, dp=dp, tp=tp, parameters=MASTER * local, gradients=MASTER * local,
        optimizer=2 * MASTER * local + 4 * tensors, buffers=buffers,
        activations_saved=activation_bytes(config, batch_size, context_length, compute, tp,
                                           activation_checkpointing),
        loss_workspace=loss_workspace_bytes(config, batch_size * context_length, compute, device_type),
        gpu_memory=round(gpu_memory_gib * GIB))


def _norm_bytes(config: GPTConfig, act: int, output_saved: bool = True) -> int:
    """Bytes per token a norm saves: RMSNorm its float32 input and 1/rms, the normed x (and the output the next
    layer saves); LayerNorm its input, mean and 1/std (and the output)."""
    d = config.d_model
    if config.norm == "rmsnorm":
        return 4 * d + 4 + act * d + (act * d if output_saved else 0)
    return act * d + 8 + (act * d if output_saved else 0)


def _block_bytes(config: GPTConfig, batch_size: int, seq_len: int, act: int, tp: int, moe: bool = False) -> int:
    """Bytes one block saves for backward (the attention and MLP inside split across tp ranks).

    moe: a mixture of experts, whose every token saves, for each of its k experts, what a gated MLP saves, its
    own copy (the rows gathered for the expert), the expert's output, its weight and their product (mixed in
    with index_add), and three int64 indices (the expert, the sorted slot, the row); and the router's float32
    probabilities, top-k weights and their sum.
    """
    ff, hs = config.hidden_dim, config.head_dim
    nh, nkv = config.n_heads // tp, config.kv_heads // tp  # this rank's heads
    if config.fused_attention:
        # SDPA saves q, k, v (v a view of the qkv output, which it keeps whole), its output, and logsumexp.
        attention = act * (nh + 2 * nkv) * hs + 4 * nh
        if config.position == "rope":
            attention += act * (nh + nkv) * hs  # the rotated q and k are new tensors
        per_sequence = 0
    else:
        # The explicit path saves q, k and v repeated to every head, and the (T, T) weights of each head.
        attention = act * 3 * nh * hs + act * nh * seq_len
        per_sequence = seq_len * seq_len  # the boolean causal mask, once per block
    attention += act * nh * hs  # the heads' output, out_proj's input
    if config.qk_norm:  # the normed queries and keys, 1/rms per head, and in mixed precision their float32 copy
        width = (nh + nkv) * hs
        attention += act * width + 4 * (nh + nkv) + (4 * width if act != 4 else 0)
    gated = config.mlp in ("swiglu", "geglu")
    mlp = act * (4 if gated else 2) * (ff // tp)  # gate, silu, up, product / fc, gelu
    if moe:
        k = config.experts_per_token
        mlp = act * k * (4 * config.expert_dim + 3 * config.d_model + 1) + 3 * 8 * k + 4 * (config.n_experts + k + 1)
        mlp += act * 4 * config.shared_experts * config.expert_dim
    norms = 2 * _norm_bytes(config, act)
    if config.post_norms:  # their outputs go into the residual sum, which saves nothing
        norms += 2 * _norm_bytes(config, act, output_saved=False)
    return batch_size * seq_len * (norms + attention + mlp) + per_sequence


def activation_bytes(config: GPTConfig, batch_size: int, seq_len: int, act: int, tp: int = 1,
                     checkpointing: bool = False) -> int:
    """Bytes of the tensors autograd saves for backward in a forward pass of one micro-batch.

    act: bytes per activation element (4 float32, 2 bfloat16: every activation in that dtype, as under FSDP's
    mixed-precision policy; RMSNorm's float32 copy and the loss's float32 weight gradient stay 4 bytes).
    Counted: per block what the norms, attention and MLP save (``_block_bytes``); the token ids (int64) and
    positions; the final norm; the chunked loss's saved gradients: the hidden states' (N, d) and the head's
    float32 (V, d) (losses.py finishes them in forward). With checkpointing, each block keeps only its input,
    and one block's activations come back during its recomputation. Dropout masks are not counted (the
    presets use dropout 0).
    """
    tokens = batch_size * seq_len
    each = [_block_bytes(config, batch_size, seq_len, act, tp, config.is_moe(i)) for i in range(config.n_layers)]
    blocks = config.n_layers * act * tokens * config.d_model + max(each) if checkpointing else sum(each)
    outside = 8 * tokens + (8 * seq_len if config.position == "learned" else 0)  # ids, positions (int64)
    outside += tokens * _norm_bytes(config, act, output_saved=False)  # the loss saves no input, only gradients
    outside += act * tokens * config.d_model + 8 + 4 * config.vocab_size * config.d_model  # grad_hidden, count, grad_weight
    return blocks + outside


def loss_workspace_bytes(config: GPTConfig, tokens: int, act: int, device_type: str = "cuda") -> int:
    """The chunked loss's reused buffers (losses.py): a chunk's logits, their float32 log-softmax (and float32
    copy), and in mixed precision a compute-dtype and a float32 (V, d) buffer for the head's gradient. Chunks
    are larger on a GPU than on a CPU (``losses.CHUNK_BYTES``)."""
    vocab = config.vocab_size
    chunks = -(-tokens // default_chunk_rows(vocab, device_type))
    rows = -(-tokens // chunks)  # equal chunks, as losses.py makes them
    workspace = rows * vocab * (act + 4)
    if act != 4:
        workspace += rows * vocab * 4 + vocab * config.d_model * (act + 4)
    return workspace


# --------------------------------------------------------------------------- the command line
def format_bytes(n: int) -> str:
    """GiB with two decimals from 1 GiB up, MiB with one below."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


COLUMNS = ("parameters", "gradients", "optimizer", "buffers", "activations", "total")


def table(plans: list[MemoryPlan]) -> str:
    """One row per strategy: the mesh, each kind of memory, the total and whether it fits."""
    header = ["strategy", "dp x tp", *COLUMNS, "fits"]
    rows = [[p.strategy, f"{p.dp} x {p.tp}", *(format_bytes(getattr(p, c)) for c in COLUMNS),
             "yes" if p.fits else "NO"] for p in plans]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in [header, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def default_tp(config: GPTConfig, gpus: int) -> int:
    """The largest tensor-parallel size up to 8 (one node) that divides the GPUs, heads, kv heads and d_ff
    (1 for a mixture of experts, which tensor parallelism does not split)."""
    if config.n_experts is not None:
        return 1
    return max(t for t in range(1, 9) if not (gpus % t or config.n_heads % t or config.kv_heads % t
                                               or config.hidden_dim % t))


MAX_LAYERS = 10_000  # each block is a row of the plan: more would take minutes and gigabytes to list
OVERRIDES = {"vocab_size": "vocabulary size", "d_model": "width of the residual stream",
             "n_layers": "number of blocks", "n_heads": "query heads", "n_kv_heads": "key/value heads",
             "d_ff": "MLP hidden size"}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m llmscratch.training.memory", description=__doc__.split("\n\n")[0],
        epilog="Parameters, gradients and AdamW state are float32 masters whatever --dtype says; --dtype is the "
               "precision of compute and activations. Sizes in GiB (2^30 bytes).")
    parser.add_argument("--preset", default="gpt2-small", choices=sorted(PRESETS), help="model shape (default: %(default)s)")
    for name, what in OVERRIDES.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, help=f"{what}, overriding the preset's")
    parser.add_argument("--parallel", default="all", choices=[*STRATEGIES, "all"],
                        help="strategy to plan; all: a row for each (default)")
    parser.add_argument("--gpus", type=int, default=1, help="number of GPUs, all nodes together (default: 1)")
    parser.add_argument("--tp", type=int, help="tensor-parallel size of the tp and fsdp+tp rows (default: the "
                                               "largest up to 8 that divides --gpus, the heads and d_ff)")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per GPU per micro-batch (default: 1)")
    parser.add_argument("--context-length", type=int, help="tokens per sequence (default: the preset's context "
                                                           "length; a longer one sets the model's too)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES),
                        help="compute and activation precision (default: %(default)s)")
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (default: 80)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block in backward: keep only the blocks' inputs")
    return parser, parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    parser, args = parse_args(argv)
    for name in ("gpus", "batch_size", "context_length", "tp", *OVERRIDES):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.n_layers is not None and args.n_layers > MAX_LAYERS:
        parser.error(f"--n-layers {args.n_layers:,}: at most {MAX_LAYERS:,} (the largest models have a few hundred)")
    if not 0 < args.gpu_memory < math.inf:
        parser.error(f"--gpu-memory must be a positive number of GiB, got {args.gpu_memory}")
    overrides = {name: getattr(args, name) for name in OVERRIDES if getattr(args, name) is not None}
    base = GPTConfig.from_preset(args.preset)
    if args.context_length is not None and args.context_length > base.context_length:
        overrides["context_length"] = args.context_length
    try:
        config = GPTConfig.from_preset(args.preset, **overrides)
    except ValueError as err:
        parser.error(f"the model does not fit together: {err}")
    rows = max(config.vocab_size, config.hidden_dim, (config.n_heads + 2 * config.kv_heads) * config.head_dim)
    if rows * config.d_model * 4 >= 2**63:  # float32 bytes of the largest weight: PyTorch counts them in int64
        parser.error(f"the model's largest weight would be {rows:,} x {config.d_model:,}, more bytes than PyTorch "
                     f"can address (2^63); check --d-model, --d-ff, --vocab-size and the head counts")
    tp = default_tp(config, args.gpus) if args.tp is None else args.tp
    strategies = STRATEGIES if args.parallel == "all" else (args.parallel,)
    if args.parallel == "all" and config.n_experts is not None:  # no tensor parallelism of experts (yet)
        strategies = ("ddp", "fsdp")
    if any(s in ("tp", "fsdp+tp") for s in strategies):
        try:
            check_mesh(config, "tp", args.gpus, tp)
        except ValueError as err:
            parser.error(f"--tp {tp}: {err}")
    plans = [plan(config, s, args.gpus, tp if "tp" in s else 1, args.batch_size, args.context_length, args.dtype,
                  args.activation_checkpointing, args.gpu_memory) for s in strategies]
    n_params = sum(_numel(shape) for _, shape in _parameters(config))
    active = ""
    if config.n_experts is not None:  # each (E, ...) expert tensor: k of its E experts per token
        idle = sum(_numel(shape) // config.n_experts * (config.n_experts - config.experts_per_token)
                   for _, shape in _parameters(config) if len(shape) == 3)
        active = f" ({(n_params - idle) / 1e6:,.1f}M active per token; all of them are held)"
    context = args.context_length or config.context_length
    print(f"{args.preset}{' (overridden: ' + ', '.join(f'{k}={v}' for k, v in overrides.items()) + ')' if overrides else ''}: "
          f"{n_params / 1e6:,.1f}M parameters{active}; {args.gpus} GPU(s) of {args.gpu_memory:g} GiB; micro-batch "
          f"{args.batch_size} x {context} tokens per GPU; {args.dtype} compute, float32 masters and AdamW state"
          f"{'; activation checkpointing' if args.activation_checkpointing else ''}")
    print(table(plans))
    print("per GPU (FSDP: rank 0, the largest shard). buffers: ddp/tp = DDP gradient buckets"
          f"{' + autocast weight copies' if args.dtype != 'float32' else ''}; fsdp = gathered units (root + "
          "2 blocks + 1 block's gradients). activations: saved for backward + the loss's chunk buffers; "
          "not counted: CUDA context, allocator fragmentation, communication buffers.")


if __name__ == "__main__":
    main()
