"""Pruning: zeroing the smallest weights of a GPT, or removing whole attention heads and MLP neurons.

Unstructured (``magnitude_prune``): the smallest |w| of the blocks' linear layers become 0. The
matrices keep their shapes and a dense kernel multiplies a zero like any other number, so this alone
saves neither time nor memory; it takes sparse kernels or hardware made for a pattern (2:4) to cash in.
Structured (``prune_structured``): whole key/value groups of attention and whole hidden neurons of
the MLP are taken out, chosen by a measured ``importance``; every matrix really shrinks, and the
result is an ordinary ``GPT`` whose (smaller) config describes it, so it saves, loads and generates
like any other. ``recover`` finetunes it for a few steps to win back some of what was lost. Fewer
weights buy time where the matrix products dominate (a batch, a long prompt, training); one-token
decoding of a model this small is bound by the work around them, and the output head is not pruned
(benchmarks/bench_prune.py measures both).
Embeddings, norms and the output head (tied to the embedding in the course's models) are left alone.
"""
import copy
import numbers
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import nn

from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT, evaluating
from llmscratch.text.tokenizer import BPETokenizer
from llmscratch.training.config import TrainConfig

SCOPES = ("layer", "global")


def block_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, layer) of every block's attention qkv and out_proj and MLP layers; ValueError if one is no nn.Linear."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError(f"expected a model with .blocks (a GPT), got {type(model).__name__}")
    if getattr(getattr(model, "config", None), "n_experts", None) is not None:
        raise ValueError("pruning a mixture of experts is not supported: its experts are stacked (E, ...) tensors, "
                         "not nn.Linear layers")
    linears = []
    for i, block in enumerate(blocks):
        for name in ("attn.qkv", "attn.out_proj", *(f"mlp.{child}" for child, _ in block.mlp.named_children())):
            layer = block.get_submodule(name)
            if type(layer) is not nn.Linear:  # QuantizedLinear, LoRALinear...: prune the float model first
                raise ValueError(f"blocks.{i}.{name} is a {type(layer).__name__}, not an nn.Linear: prune the "
                                 f"plain float model, then quantize it or add adapters")
            linears.append((f"blocks.{i}.{name}", layer))
    return linears


# --------------------------------------------------------------------------- unstructured
def magnitude_prune(model: nn.Module, sparsity: float, scope: str = "layer") -> nn.Module:
    """A copy of ``model`` with the fraction ``sparsity`` of its blocks' linear weights set to 0, the smallest |w|.

    scope "layer": each matrix loses round(sparsity * its size) weights; "global": one threshold for all
    of them together, so a layer of small weights loses more than its share. Biases and norms stay (they
    are few), and so do the embedding and the output head: in the course's models they are one tied
    matrix, whose zeros would also erase parts of every token's input vector.
    """
    if not 0 <= sparsity <= 1:
        raise ValueError(f"sparsity must be a fraction in [0, 1], got {sparsity}")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {list(SCOPES)}, got {scope!r}")
    names = [name for name, _ in block_linears(model)]  # checked before anything is copied
    pruned = copy.deepcopy(model)
    weights = [pruned.get_submodule(name).weight for name in names]
    groups = [[w] for w in weights] if scope == "layer" else [weights]
    with torch.no_grad():
        for group in groups:
            magnitudes = torch.cat([w.detach().abs().flatten() for w in group])  # (n,)
            count = round(sparsity * magnitudes.numel())
            drop = torch.zeros_like(magnitudes, dtype=torch.bool)
            drop[torch.argsort(magnitudes, stable=True)[:count]] = True  # exactly count, ties by position
            for w, mask in zip(group, drop.split([w.numel() for w in group])):
                w.masked_fill_(mask.view_as(w), 0.0)
    return pruned


def layer_sparsity(model: nn.Module) -> dict[str, float]:
    """The fraction of exact zeros in each of the blocks' linear weights, and under "all" in all of them."""
    linears = block_linears(model)
    zeros = {name: (layer.weight == 0).sum().item() for name, layer in linears}
    sizes = {name: layer.weight.numel() for name, layer in linears}
    return {**{name: zeros[name] / sizes[name] for name in zeros}, "all": sum(zeros.values()) / sum(sizes.values())}


def plot_sparsity_sweep(sparsities: Sequence[float], curves: dict[str, Sequence[float]],
                        dense: float | None = None) -> Figure:
    """Bits per byte (one curve per label) against the fraction of weights pruned; ``dense``: a reference line."""
    fig = Figure(figsize=(6, 3.6))
    ax = fig.subplots()
    for label, bits in curves.items():
        ax.plot([100 * s for s in sparsities], bits, "o-", label=label)
    if dense is not None:
        ax.axhline(dense, color="0.5", ls="--", lw=0.8, label="unpruned")
    ax.set(xlabel="weights of the blocks set to zero (%)", ylabel="held-out bits per byte",
           title="Magnitude pruning")
    ax.legend()
    return fig


# --------------------------------------------------------------------------- importance
def _check_gpt(model: nn.Module) -> None:
    if not isinstance(model, GPT):
        raise ValueError(f"expected a GPT, got {type(model).__name__}")
    block_linears(model)  # plain nn.Linear layers only


def _mlp_out(block: nn.Module) -> nn.Linear:
    """The MLP's last layer (GELU's proj, SwiGLU's down): its input columns are the hidden neurons."""
    return block.mlp.down if hasattr(block.mlp, "down") else block.mlp.proj


def importance(model: GPT, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(heads (n_layers, n_kv_heads), neurons (n_layers, hidden)): each unit's first-order Taylor importance.

    Each unit's output is multiplied by a gate g = 1; dL/dg, the sum over a batch's tokens of the unit's
    output times the loss gradient there, is to first order the loss change removing the unit causes
    (Michel et al. 2019 for heads, Molchanov et al. 2019 for neurons). The score is |dL/dg| summed
    over the batches (inputs, targets), each (B, T). One backward pass per batch scores every unit at
    once, where ablating them one by one would take a forward pass per unit.
    A head unit is a key/value group: a key/value head with the query heads that read it (one head
    under multi-head attention). Removing it shrinks Q, K, V, the output projection and the KV cache
    alike; removing query heads inside groups would leave K, V and the cache as they are, and groups
    of unequal sizes, which attention's ``h // group_size`` cannot describe. The group's gate is shared
    by its query heads, so its score is the sum of their gradients.
    """
    _check_gpt(model)
    config, weight = model.config, model.token_embedding.weight
    head_gates = torch.ones(config.n_layers, config.kv_heads, dtype=weight.dtype, device=weight.device,
                            requires_grad=True)
    neuron_gates = torch.ones(config.n_layers, config.hidden_dim, dtype=weight.dtype, device=weight.device,
                              requires_grad=True)
    head_scores, neuron_scores = torch.zeros_like(head_gates), torch.zeros_like(neuron_gates)

    def gate_heads(layer):
        def hook(module, args):  # args[0]: the heads' outputs (B, T, nh*hs), the heads of group g side by side
            heads = args[0].unflatten(-1, (config.kv_heads, -1))  # (B, T, n_kv, group*hs)
            return ((heads * head_gates[layer, :, None]).flatten(-2),)  # (B, T, nh*hs)
        return hook

    def gate_neurons(layer):
        return lambda module, args: (args[0] * neuron_gates[layer],)  # (B, T, hidden)

    handles = [h for i, block in enumerate(model.blocks) for h in (
        block.attn.out_proj.register_forward_pre_hook(gate_heads(i)),
        _mlp_out(block).register_forward_pre_hook(gate_neurons(i)))]
    try:
        with evaluating(model):
            for inputs, targets in batches:
                loss = model(inputs.to(weight.device), targets=targets.to(weight.device))  # () mean over B*T
                head_grad, neuron_grad = torch.autograd.grad(loss, [head_gates, neuron_gates])
                head_scores += head_grad.abs()
                neuron_scores += neuron_grad.abs()
    finally:
        for handle in handles:
            handle.remove()
    return head_scores.detach(), neuron_scores.detach()


def least_important(scores: torch.Tensor, count: int) -> list[list[int]]:
    """Per layer (a row of ``scores``), the indices of its ``count`` lowest scores, in increasing index order."""
    if not 0 <= count < scores.size(1):
        raise ValueError(f"count must be in [0, {scores.size(1)}) (at least one unit stays), got {count}")
    return [sorted(row.argsort(stable=True)[:count].tolist()) for row in scores]


# --------------------------------------------------------------------------- structured
def _check_removal(removed: Sequence[Sequence[int]] | None, n_layers: int, n_units: int, what: str) -> int:
    """How many units each layer loses; ValueError unless each of n_layers lists removes as many distinct ones."""
    if removed is None:
        return 0
    removed = [list(layer) for layer in removed]
    if len(removed) != n_layers:
        raise ValueError(f"{what}: expected one list per layer ({n_layers}), got {len(removed)}")
    counts = {len(layer) for layer in removed}
    if len(counts) > 1:
        raise ValueError(f"{what}: every layer must lose as many (so that one config describes the model), "
                         f"got counts {[len(layer) for layer in removed]}")
    for i, layer in enumerate(removed):
        in_range = all(isinstance(u, numbers.Integral) and 0 <= u < n_units for u in layer)
        if not in_range or len(set(layer)) != len(layer):
            raise ValueError(f"{what}: layer {i} must list distinct indices in [0, {n_units}), got {layer}")
    count = counts.pop()
    if count >= n_units:
        raise ValueError(f"{what}: removing {count} of {n_units} leaves none; keep at least one")
    return count


def _kept(removed: Sequence[int], n_units: int) -> torch.Tensor:
    """The indices (n_units - len(removed),) that stay, in order."""
    removed = set(removed)
    return torch.tensor([u for u in range(n_units) if u not in removed], dtype=torch.long)


def prune_structured(model: GPT, heads: Sequence[Sequence[int]] | None = None,
                     neurons: Sequence[Sequence[int]] | None = None) -> GPT:
    """A smaller GPT without the listed key/value groups and MLP neurons; the original is untouched.

    heads[i]: the key/value heads to remove from block i (each with the query heads that read it);
    neurons[i]: the MLP hidden neurons to remove from block i. Every block must lose as many of each:
    the new config (fewer n_heads and n_kv_heads of the same ``head_size``; a smaller d_ff) then
    describes the model, and the checkpoint format and every ``--model PATH`` take it as it is.
    """
    _check_gpt(model)
    config = model.config
    group, hs, hidden = config.n_heads // config.kv_heads, config.head_dim, config.hidden_dim
    n_groups = _check_removal(heads, config.n_layers, config.kv_heads, "heads")
    n_neurons = _check_removal(neurons, config.n_layers, hidden, "neurons")
    changes = {"d_ff": hidden - n_neurons}
    if n_groups:
        n_kv = config.kv_heads - n_groups
        changes.update(n_heads=n_kv * group, n_kv_heads=None if config.n_kv_heads is None else n_kv, head_size=hs)
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    for i in range(config.n_layers):
        prefix = f"blocks.{i}."
        if n_groups:
            kv = _kept(heads[i], config.kv_heads)  # (n_kv',) kept key/value heads
            q = (kv[:, None] * group + torch.arange(group)).flatten()  # (nh',) the query heads that read them
            q_rows, kv_rows = _rows(q, hs), _rows(kv, hs)  # (nh'*hs,), (n_kv'*hs,)
            n_q = config.n_heads * hs
            qkv_rows = torch.cat([q_rows, n_q + kv_rows, n_q + config.kv_heads * hs + kv_rows])
            for name in ("attn.qkv.weight", "attn.qkv.bias"):
                if prefix + name in state:
                    state[prefix + name] = state[prefix + name][qkv_rows]
            state[prefix + "attn.out_proj.weight"] = state[prefix + "attn.out_proj.weight"][:, q_rows]
        if n_neurons:
            keep = _kept(neurons[i], hidden)  # (hidden',)
            for name in ("mlp.fc", "mlp.gate", "mlp.up"):  # rows: one per hidden neuron
                for part in (".weight", ".bias"):
                    if prefix + name + part in state:
                        state[prefix + name + part] = state[prefix + name + part][keep]
            out = prefix + ("mlp.down.weight" if config.mlp == "swiglu" else "mlp.proj.weight")
            state[out] = state[out][:, keep]
    weight = model.token_embedding.weight
    pruned = GPT(GPTConfig(**{**config.to_dict(), **changes})).to(device=weight.device, dtype=weight.dtype)
    pruned.load_state_dict(state)
    return pruned.train(model.training)


def _rows(heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The rows (or columns) of the given heads, head after head: (len(heads) * head_dim,)."""
    return (heads[:, None] * head_dim + torch.arange(head_dim)).flatten()


# --------------------------------------------------------------------------- recovery
def recover(model: GPT, tokenizer: BPETokenizer, train_tokens: np.ndarray, val_tokens: np.ndarray,
            steps: int = 200, out_dir: str | Path | None = None, **train_options) -> tuple[GPT, dict]:
    """(a finetuned copy of ``model``, the run's summary): ``steps`` steps of the package's ``Trainer``.

    A short recovery finetune on ``train_tokens``, evaluated at the end on ``val_tokens``; the
    defaults below (a lower peak learning rate than pretraining, a short warmup, no samples) can be
    overridden as TrainConfig fields. out_dir: the run folder (default: a temporary one, then removed).
    """
    from llmscratch.training.train import Trainer  # imported here: train.py pulls in the whole training stack

    if steps < 1:
        raise ValueError(f"steps must be a positive number of optimizer steps, got {steps}")
    options = dict(max_steps=steps, batch_size=8, lr=3e-4, min_lr=3e-5, warmup_steps=max(1, steps // 10),
                   eval_interval=steps, checkpoint_interval=steps, sample_interval=steps, sample_tokens=0,
                   log_interval=max(1, steps // 4))
    config = TrainConfig(**{**options, **train_options})
    tuned = copy.deepcopy(model)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = Trainer(tuned, config, train_tokens, val_tokens, out_dir or scratch, tokenizer)
        summary = trainer.fit(progress=False)
    return tuned.eval(), summary
