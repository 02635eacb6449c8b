"""The chapters' diagrams, drawn from the package's own objects.

Each function takes what a notebook already holds (a tokenizer, a dataset, a module, a model) and
returns a matplotlib ``Figure`` whose labels are read off that object, so a picture cannot drift
from the code it shows. No pyplot: a notebook displays the returned figure, a test reads its texts
(each box's text carries a ``gid`` naming its role).
"""

import functools
from collections.abc import Sequence

import torch
from matplotlib import font_manager
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.ft2font import FT2Font
from matplotlib.patches import FancyBboxPatch, Rectangle
from torch import nn

from llmscratch.attention import MultiHeadAttention, explicit_attention
from llmscratch.data import SlidingWindowDataset
from llmscratch.lora import LoRALinear
from llmscratch.model import GPT
from llmscratch.preference import dpo_loss
from llmscratch.tokenizer import BPETokenizer

GREY, BLUE, ORANGE, GREEN = "#e6e6e6", "#cfe2f3", "#fbd9b0", "#d5ecd0"


# --------------------------------------------------------------------------- drawing helpers
def _canvas(width: float, height: float, n_rows: int = 1, n_cols: int = 1) -> tuple[Figure, list[Axes]]:
    """A figure of bare axes (no ticks, no frame) for diagrams drawn in data coordinates."""
    fig = Figure(figsize=(round(width, 1), round(height, 1)))  # whole pixels: "<Figure size 1300x560>"
    axes = fig.subplots(n_rows, n_cols, squeeze=False).ravel().tolist()
    for ax in axes:
        ax.set_axis_off()
    return fig, axes


def _box(ax: Axes, x: float, y: float, width: float, height: float, text: str, color: str,
         gid: str | None = None, fontsize: float = 9) -> None:
    """A box centred on (x, y) with ``text`` inside (taken literally: a '$' in a token is no math)."""
    ax.add_patch(FancyBboxPatch((x - width / 2, y - height / 2), width, height,
                                boxstyle="round,pad=0,rounding_size=0.05", facecolor=color, edgecolor="0.35", lw=0.8))
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, gid=gid, parse_math=False)


def _arrow(ax: Axes, start: tuple[float, float], end: tuple[float, float], style: str = "-|>") -> None:
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle=style, color="0.35", lw=0.8, shrinkA=0, shrinkB=0))


def visible(piece: bytes) -> str:
    """A token's bytes as a label: UTF-8 text with spaces as '␣', and escapes (\\xf0, \\U0001f433)
    for a byte of a split character or a character the font cannot draw."""
    text = piece.decode("utf-8", errors="backslashreplace").replace(" ", "␣").replace("\n", "⏎")
    return "".join(c if ord(c) in _drawable() else ascii(c)[1:-1] for c in text)


@functools.cache
def _drawable() -> frozenset[int]:
    """The characters matplotlib's default font has glyphs for."""
    return frozenset(FT2Font(font_manager.findfont(FontProperties())).get_charmap())


# --------------------------------------------------------------------------- chapter 1: tokens
def merge_tree(tokenizer: BPETokenizer, word: str) -> tuple[list[int], list[int], list[tuple[int, int, int, int]]]:
    """The tokens ``encode`` gives ``word``, their leaves (byte ids) and the merges that built them.

    Each merge is (new id, first leaf, last leaf of its left part, last leaf), sorted as ``encode``
    applies them within a pre-split chunk (chunks merge independently): a merge's id is its rank,
    lower ranks first, the leftmost first among equal ones.
    """
    made_from = {new_id: pair for pair, new_id in tokenizer.merges.items()}
    leaves, merges = [], []

    def unfold(token_id: int) -> None:
        first = len(leaves)
        if token_id not in made_from:
            leaves.append(token_id)
            return
        left, right = made_from[token_id]
        unfold(left)
        split = len(leaves) - 1
        unfold(right)
        merges.append((token_id, first, split, len(leaves) - 1))

    tokens = tokenizer.encode(word)
    for token_id in tokens:
        unfold(token_id)
    return tokens, leaves, sorted(merges, key=lambda merge: (merge[0], merge[1]))


def draw_merge_tree(tokenizer: BPETokenizer, word: str) -> Figure:
    """``word``'s bytes at the bottom, one row per merge in the order applied, its tokens (with ids) on top."""
    tokens, leaves, merges = merge_tree(tokenizer, word)
    top = len(merges) + 1

    def node(x: float, y: float, token_id: int, color: str, gid: str, text: str | None = None) -> None:
        text = visible(tokenizer.vocab[token_id]) if text is None else text
        width = max(0.8, 0.16 * len(text.split("\n")[0]) + 0.3)
        _box(ax, x, y, width, 0.6 + 0.25 * text.count("\n"), text, color, gid)

    fig, (ax,) = _canvas(max(5.0, 0.75 * len(leaves) + 1.5), 1.2 + 0.42 * (top + 1))
    place = {}  # (first leaf, last leaf) of a piece -> (x, y) of its box
    for i, leaf in enumerate(leaves):
        place[i, i] = (i, 0)
        node(i, 0, leaf, GREY, "leaf")
    for step, (token_id, first, split, last) in enumerate(merges, start=1):
        (x_left, y_left), (x_right, y_right) = place[first, split], place[split + 1, last]
        x = (x_left + x_right) / 2
        place[first, last] = (x, step)
        ax.plot([x_left, x, x_right], [y_left + 0.3, step - 0.3, y_right + 0.3], color="0.5", lw=0.8)
        node(x, step, token_id, BLUE, "merge")
    first = 0
    for token_id in tokens:  # one box per token, above the piece that is that token
        last = first + len(tokenizer.vocab[token_id]) - 1  # one leaf per byte
        x, y = place[first, last]
        ax.plot([x, x], [y + 0.3, top - 0.43], color="0.5", lw=0.8, ls=":")
        node(x, top, token_id, ORANGE, "token", f"{visible(tokenizer.vocab[token_id])}\n{token_id}")
        first = last + 1
    ax.set_axis_on()  # for the row labels on the left; no frame
    ax.set_yticks(range(top + 1), ["bytes"] + [f"merge {step}: id {merge[0]}" for step, merge in enumerate(merges, 1)]
                  + ["tokens"], fontsize=8)
    ax.set_xticks([])
    ax.spines[:].set_visible(False)
    ax.set(xlim=(-0.7, len(leaves) - 0.3), ylim=(-0.6, top + 0.65))
    plural = "s" * (len(tokens) != 1)
    ax.set_title(f"'{visible(word.encode('utf-8'))}': {len(leaves)} bytes, {len(merges)} merges, "
                 f"{len(tokens)} token{plural}", fontsize=10)
    fig.tight_layout()
    return fig


def draw_sliding_windows(dataset: SlidingWindowDataset, tokenizer: BPETokenizer | None = None,
                         n_windows: int | None = None) -> Figure:
    """The token stream, then each window's inputs and targets (its inputs moved one token on),
    at the positions they start from: every ``stride`` tokens."""
    n_windows = len(dataset) if n_windows is None else min(n_windows, len(dataset))
    stream = dataset.token_ids[: (n_windows - 1) * dataset.stride + dataset.max_length + 1].tolist()
    fig, (ax,) = _canvas(max(6.0, 0.85 * len(stream) + 1.5), 0.9 + 0.42 * (1 + 2 * n_windows) + 0.2 * n_windows)
    for position, token_id in enumerate(stream):
        label = str(token_id) if tokenizer is None else f"{visible(tokenizer.decode_bytes([token_id]))}\n{token_id}"
        _box(ax, position, 0, 0.9, 0.8, label, GREY, "stream", fontsize=7.5)
    ax.text(-0.6, 0, "tokens", ha="right", va="center", fontsize=9)

    def inputs_y(window: int) -> float:  # each window: a row of inputs, its targets half a row below
        return -1.0 - 1.3 * window

    for window in range(n_windows):
        start = window * dataset.stride
        inputs, targets = dataset[window]  # (max_length,) each
        y = inputs_y(window)
        for name, ids, shift, color, row_y in (("inputs", inputs, 0, BLUE, y),
                                                ("targets", targets, 1, ORANGE, y - 0.5)):
            for j, token_id in enumerate(ids.tolist()):
                _box(ax, start + shift + j, row_y, 0.9, 0.42, str(token_id), color, f"{name} {window}", fontsize=7.5)
            ax.text(start + shift - 0.6, row_y, f"{name} {window}", ha="right", va="center", fontsize=8)
    if n_windows > 1:  # the stride: how far one window's start is from the next one's
        y = inputs_y(1) + 0.4
        _arrow(ax, (-0.45, y), (dataset.stride - 0.45, y), style="<|-|>")
        ax.text(-0.6, y, f"stride {dataset.stride}", ha="right", va="center", fontsize=8)
    ax.set(xlim=(-2.2, len(stream) - 0.4), ylim=(inputs_y(n_windows - 1) - 0.85, 0.55))
    ax.set_title(f"windows of max_length={dataset.max_length} tokens every stride={dataset.stride}: "
                 f"the targets are the inputs shifted by one", fontsize=10)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- chapter 2: attention
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
    fig, (ax,) = _canvas(13, max(3.5, 0.8 + 0.36 * (len(heads) + 1.2)))
    ax.set(xlim=(-0.8, 13.4), ylim=(bottom - 0.7, 0.7))
    _box(ax, 0, middle, 1.3, 1.1, f"x\n(B, {T}, {d_in})", GREY, "input")
    _box(ax, 2, middle, 1.6, 1.1, f"qkv: Linear\n{d_in} → {sum(attention.qkv_sizes)}", GREEN, "qkv")
    _arrow(ax, (0.65, middle), (1.2, middle))
    for (kind, name), size in zip((("q", "Q"), ("k", "K"), ("v", "V")), attention.qkv_sizes):
        members = [y for (k, _), y in head_y.items() if k == kind]
        y = sum(members) / len(members)
        _box(ax, 4.3, y, 1.6, 0.55, f"{name} (B, {T}, {size})", BLUE, name)
        _arrow(ax, (2.8, middle), (3.5, y))
        for member in members:
            _arrow(ax, (5.1, y), (6.0, member))
    for (kind, i), y in head_y.items():
        _box(ax, 6.7, y, 1.4, 0.3, f"{kind}{i} (B, {T}, {hs})", BLUE, f"{kind} head", fontsize=7.5)
    attend_y = [bottom * (h + 0.5) / n_q for h in range(n_q)]
    for h, y in enumerate(attend_y):  # each query head with the key/value head of its group
        _box(ax, 9.1, y, 1.7, 0.3 if n_q > 6 else 0.5, f"softmax(q{h}·k{reads[h]}ᵀ/√{hs})·v{reads[h]}", ORANGE,
             "attention head", fontsize=7.5)
        for kind, i in (("q", h), ("k", reads[h]), ("v", reads[h])):
            _arrow(ax, (7.4, head_y[kind, i]), (8.25, y))
        _arrow(ax, (9.95, y), (10.8, middle))
    _box(ax, 11.3, middle, 1.0, 1.6, f"merge\nheads\n(B, {T}, {n_q * hs})", BLUE, "merge", fontsize=8)
    _box(ax, 12.7, middle, 1.2, 1.6, f"out_proj\n{d_out} → {d_out}\n(B, {T}, {d_out})", GREEN, "out_proj", fontsize=8)
    _arrow(ax, (11.8, middle), (12.1, middle))
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
    fig, axes = _canvas(max(6.0, 0.75 * width + 1.5), 1.55 * len(attentions), n_rows=len(attentions))
    for ax, attention in zip(axes, attentions):
        reads = kv_head_of_each_query(attention)
        groups = [[h for h, g in enumerate(reads) if g == kv] for kv in range(attention.n_kv_heads)]
        for kv, members in enumerate(groups):
            x_kv = sum(members) / len(members)  # under the middle of its group
            color = f"C{kv % 10}"
            for h in members:
                ax.plot([h, x_kv], [0.78, 0.22], color=color, lw=1.2)
                _box(ax, h, 1, 0.8, 0.44, f"q{h}", BLUE, "query", fontsize=8)
            _box(ax, x_kv, 0, max(0.8, 0.9 * len(members) - 0.1), 0.44, f"kv{kv}", ORANGE, "kv", fontsize=8)
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


# --------------------------------------------------------------------------- chapter 3: the model
def _hidden_width(mlp: nn.Module) -> int:
    """The width an MLP expands to: the outputs of its first linear layer (GELUMLP's fc, SwiGLU's gate)."""
    return next(m for m in mlp.modules() if isinstance(m, nn.Linear)).out_features


def _draw_one_gpt(ax: Axes, model: GPT) -> None:
    """One model's diagram, top to bottom, the residual stream down the middle at x = 0."""
    config, block = model.config, model.blocks[0]
    d, vocab = config.d_model, config.vocab_size
    ax.set(xlim=(-2.3, 3.3), ylim=(-0.4, 11.2))
    _box(ax, 0, 10.7, 2.2, 0.5, "token ids (B, T)", GREY, "input")
    _box(ax, 0, 9.8, 2.6, 0.7, f"token_embedding\nEmbedding({vocab}, {d})", GREEN, "embedding", fontsize=8.5)
    if model.position_embedding is not None:
        _box(ax, 2.2, 9.0, 1.9, 0.7, f"position_embedding\nEmbedding({config.context_length}, {d})", GREEN,
             "positions", fontsize=7.5)
        _arrow(ax, (1.25, 9.0), (0.17, 9.0))
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
        _arrow(ax, (1.8, top), (1.8, top - 0.2))
        _box(ax, 1.8, top - 0.45, 2.0, 0.5, f"{norm_name}: {type(norm).__name__}", BLUE, "norm", fontsize=8.5)
        _arrow(ax, (1.8, top - 0.7), (1.8, top - 0.92))
        _box(ax, 1.8, top - 1.3, 2.3, 0.75, f"{name}: {type(sublayer).__name__}\n{detail}", ORANGE, name, fontsize=8)
        ax.plot([1.8, 1.8], [top - 1.68, top - 2.0], color="0.35", lw=0.8)
        _arrow(ax, (1.8, top - 2.0), (0.17, top - 2.0))  # and is added back into it
        ax.text(0, top - 2.0, "⊕", ha="center", va="center", fontsize=14)
    ax.plot([0, 0], [9.43, 2.45], color="0.35", lw=1.6, zorder=0)  # the residual stream
    ax.text(-0.12, 7.0, f"residual stream (B, T, {d})", rotation=90, ha="right", va="center", fontsize=8)
    _box(ax, 0, 2.1, 2.4, 0.55, f"final_norm: {type(model.final_norm).__name__}", BLUE, "final_norm", fontsize=8.5)
    tied = "\ntied to token_embedding" if model.lm_head.weight is model.token_embedding.weight else ""
    _box(ax, 0, 1.1, 2.6, 0.7, f"lm_head: Linear({d}, {vocab}){tied}", GREEN, "lm_head", fontsize=8)
    _box(ax, 0, 0.1, 2.4, 0.5, f"logits (B, T, {vocab})", GREY, "output")
    for y_from, y_to in ((10.45, 10.15), (1.82, 1.45), (0.75, 0.35)):
        _arrow(ax, (0, y_from), (0, y_to))
    ax.set_title(f"d_model={d}, {len(model.blocks)} blocks: {model.num_params():,} parameters", fontsize=10)


def draw_gpt(*models: GPT) -> Figure:
    """Each model's block diagram, side by side: embedding, pre-norm blocks on the residual stream, head."""
    fig, axes = _canvas(5.6 * len(models), 6.2, n_cols=len(models))
    for ax, model in zip(axes, models):
        _draw_one_gpt(ax, model)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- chapter 5: LoRA
def _matrix(ax: Axes, x: float, y: float, rows: int, cols: int, unit: float, color: str,
            gid: str) -> tuple[float, float]:
    """A rows x cols matrix drawn as a rectangle of that shape centred on (x, y) (a side of a few rows
    still a little thick); returns its left and right edges."""
    width, height = max(cols * unit, 0.12), max(rows * unit, 0.12)
    ax.add_patch(Rectangle((x - width / 2, y - height / 2), width, height, facecolor=color, edgecolor="0.3", gid=gid))
    return x - width / 2, x + width / 2


def draw_lora(layer: LoRALinear) -> Figure:
    """The frozen W beside the trained low-rank path, B after A, scaled by alpha/rank and added:
    each matrix drawn to its shape, with its count of numbers."""
    (d_out, d_in), rank = layer.base.weight.shape, layer.rank
    unit = 2.6 / max(d_in, d_out)  # the longest side is 2.6 units
    top, bottom, plus = 1.7, -1.7, (7.45, 0.0)
    fig, (ax,) = _canvas(9.5, 6.2)
    ax.set(xlim=(-0.4, 9.2), ylim=(-3.3, 3.2), aspect="equal")  # equal: each matrix keeps its shape
    _box(ax, 0.4, 0, 0.9, 0.6, f"x\n(…, {d_in})", GREY, "input")
    _box(ax, 8.6, 0, 0.9, 0.6, f"y\n(…, {d_out})", GREY, "output")
    w_left, w_right = _matrix(ax, 2.6, top, d_out, d_in, unit, "#c9c9c9", "W")
    ax.text(w_right + 0.15, top + 0.5, f"W: {d_out} × {d_in}\nfrozen: {layer.base.weight.numel():,}", ha="left",
            va="bottom", fontsize=8.5, gid="W")
    a_left, a_right = _matrix(ax, 2.6, bottom, rank, d_in, unit, ORANGE, "A")
    ax.text(2.6, bottom + 0.15, f"A: {rank} × {d_in}\ntrained: {layer.lora_a.numel():,}", ha="center", va="bottom",
            fontsize=8.5, gid="A")  # A is too flat, and B too narrow, to hold their labels
    b_left, b_right = _matrix(ax, 4.6, bottom, d_out, rank, unit, ORANGE, "B")
    ax.text(b_right + 0.15, bottom + 0.5, f"B: {d_out} × {rank}\ntrained: {layer.lora_b.numel():,}", ha="left",
            va="bottom", fontsize=8.5, gid="B")
    ax.text((a_right + b_left) / 2, bottom - 0.2, f"(…, {rank})", ha="center", va="top", fontsize=8)
    _box(ax, 6.2, bottom, 1.3, 0.55, f"× α/r = {layer.alpha:g}/{rank}\n= {layer.scaling:g}", GREEN, "scaling",
         fontsize=8.5)
    for start, end in (((0.85, 0.1), (w_left, top)), ((0.85, -0.1), (a_left, bottom)),
                       ((a_right, bottom), (b_left, bottom)), ((b_right, bottom), (5.55, bottom)),
                       ((w_right, top), (plus[0] - 0.15, 0.2)), ((6.85, bottom), (plus[0] - 0.15, -0.2)),
                       ((plus[0] + 0.2, 0), (8.15, 0))):
        _arrow(ax, start, end)
    ax.text(*plus, "⊕", ha="center", va="center", fontsize=18)
    trained = layer.lora_a.numel() + layer.lora_b.numel()
    ax.set_title(f"LoRA, rank r={rank}, α={layer.alpha:g}: y = x Wᵀ + (α/r) x Aᵀ Bᵀ; "
                 f"{trained:,} trained numbers beside W's {layer.base.weight.numel():,} "
                 f"({trained / layer.base.weight.numel():.1%})", fontsize=10)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- chapter 6: DPO
def draw_dpo_loss(betas: Sequence[float], margins: torch.Tensor | None = None) -> Figure:
    """The DPO loss of one pair against its log-ratio margin, one curve per beta, each point from ``dpo_loss``."""
    margins = torch.linspace(-10, 10, 201) if margins is None else margins
    no_change = torch.zeros(1)  # the margin sits in the policy's chosen log-probability; the rest is 0
    fig = Figure(figsize=(6.5, 3.6))
    ax = fig.subplots()
    for beta in betas:
        losses = [dpo_loss(margin.view(1), no_change, no_change, no_change, beta)[0].item() for margin in margins]
        ax.plot(margins.tolist(), losses, label=f"β = {beta:g}", gid=f"beta {beta:g}")
    ax.axhline(dpo_loss(no_change, no_change, no_change, no_change, 1.0)[0].item(), color="gray", ls="--", lw=1,
               label="log 2 (margin 0)")
    ax.set(xlabel="log-ratio margin: (log π − log π_ref)(chosen) − (log π − log π_ref)(rejected)",
           ylabel="DPO loss", title="DPO loss = −log σ(β · margin)")
    ax.grid(alpha=0.3)
    ax.legend()
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
