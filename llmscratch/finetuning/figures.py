"""Chapter 5's figures: a LoRA layer drawn to its shapes (``llmscratch.drawing``), and what finetuning forgot."""

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import PercentFormatter

from llmscratch.drawing import GREEN, GREY, ORANGE, arrow, box, canvas
from llmscratch.finetuning.lora import LoRALinear


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
    fig, (ax,) = canvas(9.5, 6.2)
    ax.set(xlim=(-0.4, 9.2), ylim=(-3.3, 3.2), aspect="equal")  # equal: each matrix keeps its shape
    box(ax, 0.4, 0, 0.9, 0.6, f"x\n(…, {d_in})", GREY, "input")
    box(ax, 8.6, 0, 0.9, 0.6, f"y\n(…, {d_out})", GREY, "output")
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
    box(ax, 6.2, bottom, 1.3, 0.55, f"× α/r = {layer.alpha:g}/{rank}\n= {layer.scaling:g}", GREEN, "scaling",
         fontsize=8.5)
    for start, end in (((0.85, 0.1), (w_left, top)), ((0.85, -0.1), (a_left, bottom)),
                       ((a_right, bottom), (b_left, bottom)), ((b_right, bottom), (5.55, bottom)),
                       ((w_right, top), (plus[0] - 0.15, 0.2)), ((6.85, bottom), (plus[0] - 0.15, -0.2)),
                       ((plus[0] + 0.2, 0), (8.15, 0))):
        arrow(ax, start, end)
    ax.text(*plus, "⊕", ha="center", va="center", fontsize=18)
    trained = layer.lora_a.numel() + layer.lora_b.numel()
    ax.set_title(f"LoRA, rank r={rank}, α={layer.alpha:g}: y = x Wᵀ + (α/r) x Aᵀ Bᵀ; "
                 f"{trained:,} trained numbers beside W's {layer.base.weight.numel():,} "
                 f"({trained / layer.base.weight.numel():.1%})", fontsize=10)
    fig.tight_layout()
    return fig


def draw_forgetting(panels: list[tuple[str, dict[str, tuple[float, float]], float]], base_bits: float) -> Figure:
    """Exact match against bits per byte on the held-out novel, one point per run, one panel per
    (title, {run: (exact match, bits per byte)}, a uniform guess's bits per byte); ``base_bits`` is the base model's."""
    fig = Figure(figsize=(11, 4))
    for ax, (title, points, uniform_bits) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        for i, (name, (match, bits)) in enumerate(points.items()):
            ax.plot(bits, match, "o", color=f"C{i}", label=name, gid=name)
        ax.axvline(base_bits, color="C7", ls="--", lw=1, label="base model")
        ax.axvline(uniform_bits, color="k", ls=":", lw=1, label="a uniform guess")
        ax.set(xlabel="bits per byte on the held-out novel (lower: less forgotten)", ylabel="exact match", title=title)
        # Room for a whole marker above the top point and below 0: autoscaled to the points, or cut at 0, the
        # panel's edge would cut a marker in half.
        top = 1.1 * max(match for match, _ in points.values()) or 1.0
        ax.set_ylim(-0.05 * top, top)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
