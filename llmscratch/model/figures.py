"""Chapters 2 and 3's diagrams, drawn from the attention modules and models a notebook holds
(``llmscratch.drawing``): which key/value head each query reads, the model's blocks, a sliding window's mask,
a router's choices, and a mixture of experts' load over training."""

from collections.abc import Sequence

import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch import nn

from llmscratch.drawing import BLUE, GREEN, GREY, ORANGE, arrow, box, canvas
from llmscratch.model.attention import MultiHeadAttention, causal_mask, explicit_attention
from llmscratch.model.gpt import GPT
from llmscratch.model.moe import MoE, route


def kv_head_of_each_query(attention: MultiHeadAttention) -> list[int]:
    """The key/value head each query head reads, found by running the package's attention on values
    that name their head (one position: each query's weight on it is 1)."""
    q = torch.zeros(1, attention.n_heads, 1, 1)  # (B, nh, T, hs)
    k = torch.zeros(1, attention.n_kv_heads, 1, 1)  # (B, n_kv, T, hs)
    v = torch.arange(attention.n_kv_heads, dtype=torch.float32).view(1, -1, 1, 1)  # head g holds the value g
    context, _ = explicit_attention(q, k, v)  # (B, nh, T, hs)
    return context.flatten().long().tolist()


def draw_attention_flow(attention: MultiHeadAttention, seq_len: int) -> Figure:
    """Queries, keys and values from one projection, split into heads, attended head by head, merged back."""
    n_q, n_kv, hs, T = attention.n_heads, attention.n_kv_heads, attention.head_dim, seq_len
    d_in, d_out = attention.qkv.in_features, attention.d_out
    reads = kv_head_of_each_query(attention)
    # Column 3 stacks the heads: queries on top, then keys, then values, a gap between the groups.
    heads = [("q", h, 0) for h in range(n_q)] + [("k", g, 1) for g in range(n_kv)] + [("v", g, 2) for g in range(n_kv)]
    head_y = {(kind, i): -(row + 0.6 * group) for row, (kind, i, group) in enumerate(heads)}
    bottom = min(head_y.values())
    middle = bottom / 2
    fig, (ax,) = canvas(13, max(3.5, 0.8 + 0.36 * (len(heads) + 1.2)))
    ax.set(xlim=(-0.8, 13.4), ylim=(bottom - 0.7, 0.7))
    box(ax, 0, middle, 1.3, 1.1, f"x\n(B, {T}, {d_in})", GREY, "input")
    box(ax, 2, middle, 1.6, 1.1, f"qkv: Linear\n{d_in} → {sum(attention.qkv_sizes)}", GREEN, "qkv")
    arrow(ax, (0.65, middle), (1.2, middle))
    for (kind, name), size in zip((("q", "Q"), ("k", "K"), ("v", "V")), attention.qkv_sizes):
        members = [y for (k, _), y in head_y.items() if k == kind]
        y = sum(members) / len(members)
        box(ax, 4.3, y, 1.6, 0.55, f"{name} (B, {T}, {size})", BLUE, name)
        arrow(ax, (2.8, middle), (3.5, y))
        for member in members:
            arrow(ax, (5.1, y), (6.0, member))
    for (kind, i), y in head_y.items():
        box(ax, 6.7, y, 1.4, 0.3, f"{kind}{i} (B, {T}, {hs})", BLUE, f"{kind} head", fontsize=7.5)
    attend_y = [bottom * (h + 0.5) / n_q for h in range(n_q)]
    for h, y in enumerate(attend_y):  # each query head with the key/value head of its group
        box(ax, 9.1, y, 1.7, 0.3 if n_q > 6 else 0.5, f"softmax(q{h}·k{reads[h]}ᵀ/√{hs})·v{reads[h]}", ORANGE,
             "attention head", fontsize=7.5)
        for kind, i in (("q", h), ("k", reads[h]), ("v", reads[h])):
            arrow(ax, (7.4, head_y[kind, i]), (8.25, y))
        arrow(ax, (9.95, y), (10.8, middle))
    box(ax, 11.3, middle, 1.0, 1.6, f"merge\nheads\n(B, {T}, {n_q * hs})", BLUE, "merge", fontsize=8)
    box(ax, 12.7, middle, 1.2, 1.6, f"out_proj\n{d_out} → {d_out}\n(B, {T}, {d_out})", GREEN, "out_proj", fontsize=8)
    arrow(ax, (11.8, middle), (12.1, middle))
    notes = ((5.3, "split: (B, T, heads, hs)\n→ (B, heads, T, hs)"), (9.1, "one head at a time\n(a batched product)"),
             (11.3, "transpose, reshape"))
    for x, label in notes:
        ax.text(x, 0.55, label, ha="center", va="top", fontsize=7.5, color="0.35")
    ax.set_title(f"multi-head attention, d_in={d_in}, d_out={d_out}, n_heads={n_q}, n_kv_heads={n_kv}, "
                 f"head_dim={hs}, T={T}", fontsize=10)
    fig.tight_layout()
    return fig


def draw_grouped_query(*attentions: MultiHeadAttention) -> Figure:
    """For each module, its query heads above the key/value heads they read, one colour per group."""
    width = max(a.n_heads for a in attentions)
    fig, axes = canvas(max(6.0, 0.75 * width + 1.5), 1.55 * len(attentions), n_rows=len(attentions))
    for ax, attention in zip(axes, attentions):
        reads = kv_head_of_each_query(attention)
        groups = [[h for h, g in enumerate(reads) if g == kv] for kv in range(attention.n_kv_heads)]
        for kv, members in enumerate(groups):
            x_kv = sum(members) / len(members)  # under the middle of its group
            color = f"C{kv % 10}"
            for h in members:
                ax.plot([h, x_kv], [0.78, 0.22], color=color, lw=1.2)
                box(ax, h, 1, 0.8, 0.44, f"q{h}", BLUE, "query", fontsize=8)
            box(ax, x_kv, 0, max(0.8, 0.9 * len(members) - 0.1), 0.44, f"kv{kv}", ORANGE, "kv", fontsize=8)
        if attention.n_kv_heads == attention.n_heads:
            kind = "multi-head"
        elif attention.n_kv_heads == 1:
            kind = "multi-query"
        else:
            kind = f"grouped-query, groups of {len(groups[0])}"
        ax.set_title(f"{kind}: n_heads={attention.n_heads}, n_kv_heads={attention.n_kv_heads}", fontsize=9)
        ax.set(xlim=(-0.6, width - 0.4), ylim=(-0.35, 1.35))
    fig.tight_layout()
    return fig


def _hidden_width(mlp: nn.Module) -> int:
    """The width an MLP expands to: the outputs of its first linear layer (a plain MLP's fc, SwiGLU's gate)."""
    return next(m for m in mlp.modules() if isinstance(m, nn.Linear)).out_features


def _draw_one_gpt(ax: Axes, model: GPT) -> None:
    """One model's diagram, top to bottom, the residual stream down the middle at x = 0."""
    config, block = model.config, model.blocks[0]
    d, vocab = config.d_model, config.vocab_size
    ax.set(xlim=(-2.3, 3.3), ylim=(-0.4, 11.2))
    box(ax, 0, 10.7, 2.2, 0.5, "token ids (B, T)", GREY, "input")
    box(ax, 0, 9.8, 2.6, 0.7, f"token_embedding\nEmbedding({vocab}, {d})", GREEN, "embedding", fontsize=8.5)
    if model.position_embedding is not None:
        box(ax, 2.2, 9.0, 1.9, 0.7, f"position_embedding\nEmbedding({config.context_length}, {d})", GREEN,
             "positions", fontsize=7.5)
        arrow(ax, (1.25, 9.0), (0.17, 9.0))
        ax.text(0, 9.0, "⊕", ha="center", va="center", fontsize=14)
    else:
        ax.text(0.25, 9.0, f"positions: RoPE inside attention (theta={config.rope_theta:g})", fontsize=7.5,
                va="center", gid="positions")
    # The repeated block: two branches leave the stream, pass a norm and a sublayer, and are added back.
    ax.add_patch(Rectangle((-1.9, 3.65), 4.95, 4.95, fill=False, ls="--", lw=0.8, edgecolor="0.4"))
    ax.text(-1.8, 3.8, f"× {len(model.blocks)} blocks", fontsize=9, va="bottom", gid="repeat")
    sublayers = (("attn_norm", block.attn_norm, "attn", block.attn,
                  f"n_heads={block.attn.n_heads}, n_kv_heads={block.attn.n_kv_heads}"),
                 ("mlp_norm", block.mlp_norm, "mlp", block.mlp,
                  f"{d} → {_hidden_width(block.mlp)} → {d}"))
    for top, (norm_name, norm, name, sublayer, detail) in zip((8.3, 6.0), sublayers):
        ax.plot([0, 1.8], [top, top], color="0.35", lw=0.8)  # the branch leaves the stream
        arrow(ax, (1.8, top), (1.8, top - 0.2))
        box(ax, 1.8, top - 0.45, 2.0, 0.5, f"{norm_name}: {type(norm).__name__}", BLUE, "norm", fontsize=8.5)
        arrow(ax, (1.8, top - 0.7), (1.8, top - 0.92))
        box(ax, 1.8, top - 1.3, 2.3, 0.75, f"{name}: {type(sublayer).__name__}\n{detail}", ORANGE, name, fontsize=8)
        ax.plot([1.8, 1.8], [top - 1.68, top - 2.0], color="0.35", lw=0.8)
        arrow(ax, (1.8, top - 2.0), (0.17, top - 2.0))  # and is added back into it
        ax.text(0, top - 2.0, "⊕", ha="center", va="center", fontsize=14)
    ax.plot([0, 0], [9.43, 2.45], color="0.35", lw=1.6, zorder=0)  # the residual stream
    ax.text(-0.12, 7.0, f"residual stream (B, T, {d})", rotation=90, ha="right", va="center", fontsize=8)
    box(ax, 0, 2.1, 2.4, 0.55, f"final_norm: {type(model.final_norm).__name__}", BLUE, "final_norm", fontsize=8.5)
    tied = "\ntied to token_embedding" if model.lm_head.weight is model.token_embedding.weight else ""
    box(ax, 0, 1.1, 2.6, 0.7, f"lm_head: Linear({d}, {vocab}){tied}", GREEN, "lm_head", fontsize=8)
    box(ax, 0, 0.1, 2.4, 0.5, f"logits (B, T, {vocab})", GREY, "output")
    for y_from, y_to in ((10.45, 10.15), (1.82, 1.45), (0.75, 0.35)):
        arrow(ax, (0, y_from), (0, y_to))
    ax.set_title(f"d_model={d}, {len(model.blocks)} blocks: {model.num_params():,} parameters", fontsize=10)


def draw_gpt(*models: GPT) -> Figure:
    """Each model's block diagram, side by side: embedding, pre-norm blocks on the residual stream, head."""
    fig, axes = canvas(5.6 * len(models), 6.2, n_cols=len(models))
    for ax, model in zip(axes, models):
        _draw_one_gpt(ax, model)
    fig.tight_layout()
    return fig


def draw_window_masks(seq_len: int, window: int) -> Figure:
    """The full causal mask beside a sliding window's band (``causal_mask``): which keys each query may read."""
    masks = {"full (causal)": causal_mask(seq_len, seq_len),
             f"sliding, window={window}": causal_mask(seq_len, seq_len, window=window)}
    fig = Figure(figsize=(8.4, 4.0))
    for ax, (name, mask) in zip(fig.subplots(1, 2), masks.items()):
        ax.imshow(mask.numpy(), cmap="Blues", vmin=0, vmax=1.3, gid=name)  # (T, T): rows are queries, columns keys
        ax.set(xticks=range(seq_len), yticks=range(seq_len), xlabel="key position", ylabel="query position",
               title=f"{name}: {int(mask.sum())} of {seq_len * seq_len} pairs")
        ax.set_xticks([p - 0.5 for p in range(1, seq_len)], minor=True)
        ax.set_yticks([p - 0.5 for p in range(1, seq_len)], minor=True)
        ax.grid(which="minor", color="white", lw=1)
        ax.tick_params(which="minor", length=0)
    fig.tight_layout()
    return fig


def draw_routing(moe: MoE, tokens: torch.Tensor) -> Figure:
    """Where a mixture of experts sends each of ``tokens`` (N, d): every expert's router probability, the k chosen
    outlined with their weight in the mix, and the tokens each expert receives."""
    with torch.no_grad():
        weights, experts, probs = route(moe.router(tokens), moe.k, moe.norm_topk)  # (N, k), (N, k), (N, E)
    n_tokens, n_experts = probs.shape
    fig = Figure(figsize=(9.0, 0.36 * n_tokens + 1.6))
    ax, ax_load = fig.subplots(1, 2, width_ratios=[2, 1])
    image = ax.imshow(probs.numpy(), cmap="Blues", aspect="auto", gid="probabilities")  # from the lowest to the highest
    for token, (row_weights, row_experts) in enumerate(zip(weights.tolist(), experts.tolist())):
        for weight, expert in zip(row_weights, row_experts):
            ax.add_patch(Rectangle((expert - 0.5, token - 0.5), 1, 1, fill=False, edgecolor="tab:orange", lw=2.5))
            ax.text(expert, token, f"{weight:.2f}", ha="center", va="center", fontsize=8, color="tab:red",
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1},
                    gid=f"token {token} -> expert {expert}")
    ax.set(xticks=range(n_experts), yticks=range(n_tokens), xlabel="expert", ylabel="token",
           title=f"router probabilities; the {moe.k} chosen outlined, with their weight")
    fig.colorbar(image, ax=ax, shrink=0.8)
    load = torch.bincount(experts.flatten(), minlength=n_experts)  # (E,) tokens per expert
    ax_load.bar(range(n_experts), load.tolist(), color=BLUE, edgecolor="0.35", gid="load")
    ax_load.axhline(experts.numel() / n_experts, color="0.35", ls=":", lw=1, label="an even load")
    ax_load.set(xticks=range(n_experts), xlabel="expert", ylabel="tokens routed to it", title="each expert's load")
    ax_load.legend(fontsize=8)
    fig.tight_layout()
    return fig


def draw_expert_load(steps: Sequence[int], loads: Sequence[Sequence[Sequence[float]]], title: str = "") -> Figure:
    """Each mixture-of-experts layer's load over training: the share of routed tokens per expert, stacked.

    ``loads[i][layer][expert]``: what ``pretrain.py --experts`` logs as ``expert_load`` at ``steps[i]`` (the
    shares since the evaluation before). An even load is bands of equal height (the dotted lines).
    """
    n_layers, n_experts = len(loads[0]), len(loads[0][0])
    fig = Figure(figsize=(2.2 * n_layers, 2.6))
    axes = fig.subplots(1, n_layers, sharey=True, squeeze=False)[0]
    for layer, ax in enumerate(axes):
        shares = [[load[layer][expert] for load in loads] for expert in range(n_experts)]  # (E, steps)
        ax.stackplot(list(steps), shares, gid=f"layer {layer}")
        for level in range(1, n_experts):
            ax.axhline(level / n_experts, color="white", ls=":", lw=0.8)
        ax.set(title=f"layer {layer}", xlabel="step", ylim=(0, 1), xlim=(steps[0], steps[-1]))
    axes[0].set_ylabel(f"share of routed tokens\n({n_experts} experts, stacked)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
