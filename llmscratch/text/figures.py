"""Chapter 1's diagrams, drawn from the tokenizer and dataset a notebook holds (``llmscratch.drawing``)."""

from matplotlib.figure import Figure

from llmscratch.drawing import BLUE, GREY, ORANGE, arrow, box, canvas, visible
from llmscratch.text.data import SlidingWindowDataset
from llmscratch.text.tokenizer import BPETokenizer


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
        box(ax, x, y, width, 0.6 + 0.25 * text.count("\n"), text, color, gid)

    fig, (ax,) = canvas(max(5.0, 0.75 * len(leaves) + 1.5), 1.2 + 0.42 * (top + 1))
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
    fig, (ax,) = canvas(max(6.0, 0.85 * len(stream) + 1.5), 0.9 + 0.42 * (1 + 2 * n_windows) + 0.2 * n_windows)
    for position, token_id in enumerate(stream):
        label = str(token_id) if tokenizer is None else f"{visible(tokenizer.decode_bytes([token_id]))}\n{token_id}"
        box(ax, position, 0, 0.9, 0.8, label, GREY, "stream", fontsize=7.5)
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
                box(ax, start + shift + j, row_y, 0.9, 0.42, str(token_id), color, f"{name} {window}", fontsize=7.5)
            ax.text(start + shift - 0.6, row_y, f"{name} {window}", ha="right", va="center", fontsize=8)
    if n_windows > 1:  # the stride: how far one window's start is from the next one's
        y = inputs_y(1) + 0.4
        arrow(ax, (-0.45, y), (dataset.stride - 0.45, y), style="<|-|>")
        ax.text(-0.6, y, f"stride {dataset.stride}", ha="right", va="center", fontsize=8)
    ax.set(xlim=(-2.2, len(stream) - 0.4), ylim=(inputs_y(n_windows - 1) - 0.85, 0.55))
    ax.set_title(f"windows of max_length={dataset.max_length} tokens every stride={dataset.stride}: "
                 f"the targets are the inputs shifted by one", fontsize=10)
    fig.tight_layout()
    return fig
