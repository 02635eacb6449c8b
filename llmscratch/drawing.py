"""The drawing kit of the chapters' diagrams: bare canvases, labelled boxes, arrows, token labels.

Each stage draws its own diagrams from the package's objects with these (``llmscratch.text.figures``,
``llmscratch.model.figures``, ``llmscratch.finetuning.figures``, ``llmscratch.alignment.figures``): a
function takes what a notebook already holds (a tokenizer, a dataset, a module, a model) and returns a
matplotlib ``Figure`` whose labels are read off that object, so a picture cannot drift from the code it
shows. No pyplot: a notebook displays the returned figure, a test reads its texts (each box's text carries a
``gid`` naming its role).
"""

import functools

from matplotlib import font_manager
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.ft2font import FT2Font
from matplotlib.patches import FancyBboxPatch

GREY, BLUE, ORANGE, GREEN = "#e6e6e6", "#cfe2f3", "#fbd9b0", "#d5ecd0"


def canvas(width: float, height: float, n_rows: int = 1, n_cols: int = 1) -> tuple[Figure, list[Axes]]:
    """A figure of bare axes (no ticks, no frame) for diagrams drawn in data coordinates."""
    fig = Figure(figsize=(round(width, 1), round(height, 1)))  # whole pixels: "<Figure size 1300x560>"
    axes = fig.subplots(n_rows, n_cols, squeeze=False).ravel().tolist()
    for ax in axes:
        ax.set_axis_off()
    return fig, axes


def box(ax: Axes, x: float, y: float, width: float, height: float, text: str, color: str,
        gid: str | None = None, fontsize: float = 9) -> None:
    """A box centred on (x, y) with ``text`` inside (taken literally: a '$' in a token is no math)."""
    ax.add_patch(FancyBboxPatch((x - width / 2, y - height / 2), width, height,
                                boxstyle="round,pad=0,rounding_size=0.05", facecolor=color, edgecolor="0.35", lw=0.8))
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, gid=gid, parse_math=False)


def arrow(ax: Axes, start: tuple[float, float], end: tuple[float, float], style: str = "-|>") -> None:
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
