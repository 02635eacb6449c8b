"""The chapters' diagrams (``llmscratch.drawing``) show what the package computes for the objects given.

Each test reads the drawn texts and shapes back from the figure (a box's text carries a ``gid`` naming
its role) and holds them to the package: the tokenizer's ``encode``, the dataset's windows, the
attention module's heads, the model's layers, the LoRA layer's matrices, ``dpo_loss``.
"""

import io
import warnings

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.nn.functional as F
from matplotlib.patches import Rectangle

from llmscratch import drawing
from llmscratch.alignment import figures as alignment_figures
from llmscratch.alignment.preference import dpo_loss
from llmscratch.finetuning import figures as finetuning_figures
from llmscratch.finetuning.lora import LoRALinear
from llmscratch.model import figures as model_figures
from llmscratch.model.attention import MultiHeadAttention
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.text import figures as text_figures
from llmscratch.text.data import SlidingWindowDataset
from llmscratch.text.tokenizer import BPETokenizer

SMALL_TEXT = "the whale's whalebone; the whaler's boat. " * 20


@pytest.fixture(scope="module")
def gpt2():
    return BPETokenizer.gpt2()


@pytest.fixture(scope="module")
def small_tokenizer():
    return BPETokenizer.train(SMALL_TEXT, vocab_size=273)  # every merge this text allows


def texts(fig, gid, ax=None):
    """The texts of one role, left to right."""
    found = [t for a in ([ax] if ax else fig.axes) for t in a.texts if t.get_gid() == gid]
    return sorted(found, key=lambda t: t.get_position()[0])


def labels(fig, gid, ax=None):
    return [t.get_text() for t in texts(fig, gid, ax)]


# --------------------------------------------------------------------------- merge tree
@pytest.mark.parametrize("which, word", [("gpt2", " naïve"), ("gpt2", " unaccountable"), ("gpt2", " Ahab's 🐳"),
                                         ("small", " whalebone"), ("small", "whaler's 🐳")])
def test_merge_tree_leaves_are_the_bytes_and_roots_what_encode_returns(which, word, gpt2, small_tokenizer):
    tokenizer = gpt2 if which == "gpt2" else small_tokenizer
    fig = text_figures.draw_merge_tree(tokenizer, word)
    assert labels(fig, "leaf") == [drawing.visible(bytes([b])) for b in word.encode("utf-8")]
    tokens = tokenizer.encode(word)
    assert labels(fig, "token") == [f"{drawing.visible(tokenizer.decode_bytes([i]))}\n{i}" for i in tokens]
    assert len(texts(fig, "merge")) == len(word.encode("utf-8")) - len(tokens)  # each merge joins two pieces


@pytest.mark.parametrize("word", [" naïve", " unaccountable", " tattooing"])
def test_merge_tree_rows_replay_encode_merge_by_merge(word, gpt2):
    """Within one pre-split chunk, applying the rows' merges in order, each at its leftmost place, is encode."""
    fig = text_figures.draw_merge_tree(gpt2, word)
    ticks = [label.get_text() for label in fig.axes[0].get_yticklabels()]
    merged_ids = [int(tick.rsplit("id ", 1)[1]) for tick in ticks[1:-1]]
    pair_of = {new_id: pair for pair, new_id in gpt2.merges.items()}
    id_of_byte = {byte: i for i, byte in enumerate(gpt2.byte_order)}
    ids = [id_of_byte[b] for b in word.encode("utf-8")]
    for step, new_id in enumerate(merged_ids, start=1):
        at = [i for i in range(len(ids) - 1) if (ids[i], ids[i + 1]) == pair_of[new_id]][0]
        ids[at : at + 2] = [new_id]
        row = [t for t in fig.axes[0].texts if t.get_gid() == "merge" and t.get_position()[1] == step]
        assert [t.get_text() for t in row] == [drawing.visible(gpt2.vocab[new_id])]
    assert ids == gpt2.encode(word)


def test_merge_tree_of_a_word_with_one_token(small_tokenizer):
    word = " whalebone"
    assert len(small_tokenizer.encode(word)) == 1
    fig = text_figures.draw_merge_tree(small_tokenizer, word)
    assert len(texts(fig, "merge")) == len(word) - 1


# --------------------------------------------------------------------------- sliding windows
@pytest.mark.parametrize("max_length, stride", [(5, 3), (4, 4), (3, 1)])
def test_sliding_windows_show_each_window_where_it_starts(max_length, stride):
    dataset = SlidingWindowDataset(list(range(100, 117)), max_length=max_length, stride=stride)
    fig = text_figures.draw_sliding_windows(dataset)
    for window in range(len(dataset)):
        inputs, targets = dataset[window]
        for name, ids, first in (("inputs", inputs, window * stride), ("targets", targets, window * stride + 1)):
            drawn = texts(fig, f"{name} {window}")
            assert [t.get_text() for t in drawn] == [str(i) for i in ids.tolist()]
            assert [t.get_position()[0] for t in drawn] == list(range(first, first + max_length))
    assert not texts(fig, f"inputs {len(dataset)}")
    assert len(texts(fig, "stream")) == (len(dataset) - 1) * stride + max_length + 1


def test_sliding_windows_label_the_stream_with_the_tokens(gpt2):
    ids = gpt2.encode("Call me Ishmael. Some years ago")
    fig = text_figures.draw_sliding_windows(SlidingWindowDataset(ids, max_length=3, stride=2), gpt2, n_windows=2)
    assert labels(fig, "stream") == [f"{drawing.visible(gpt2.decode_bytes([i]))}\n{i}" for i in ids[:6]]
    assert texts(fig, "inputs 1") and not texts(fig, "inputs 2")


# --------------------------------------------------------------------------- attention
SHAPES = [(8, 2), (6, 3), (4, 1), (4, 4)]


@pytest.mark.parametrize("n_heads, n_kv_heads", SHAPES)
def test_grouped_query_links_each_query_head_to_its_kv_head(n_heads, n_kv_heads):
    attention = MultiHeadAttention(4 * n_heads, 4 * n_heads, n_heads, n_kv_heads)
    group = n_heads // n_kv_heads
    assert model_figures.kv_head_of_each_query(attention) == [h // group for h in range(n_heads)]
    fig = model_figures.draw_grouped_query(attention)
    queries, kvs = texts(fig, "query"), texts(fig, "kv")
    assert [t.get_text() for t in queries] == [f"q{h}" for h in range(n_heads)]
    assert [t.get_text() for t in kvs] == [f"kv{g}" for g in range(n_kv_heads)]

    def nearest(drawn, x):
        return min(range(len(drawn)), key=lambda i: abs(drawn[i].get_position()[0] - x))

    links = {}
    for line in fig.axes[0].lines:  # from a query box (top) down to a key/value box
        (x_query, x_kv), (y_query, y_kv) = line.get_xdata(), line.get_ydata()
        assert y_query > y_kv
        links[nearest(queries, x_query)] = nearest(kvs, x_kv)
    assert links == {h: h // group for h in range(n_heads)}


def test_grouped_query_draws_one_panel_per_module():
    modules = [MultiHeadAttention(32, 32, 8, n) for n in (8, 2, 1)]
    fig = model_figures.draw_grouped_query(*modules)
    assert [len(texts(fig, "kv", ax)) for ax in fig.axes] == [8, 2, 1]
    assert [len(ax.lines) for ax in fig.axes] == [8, 8, 8]


@pytest.mark.parametrize("d_model, n_heads, n_kv_heads, seq_len", [(24, 6, 2, 7), (16, 4, 4, 14)])
def test_attention_flow_is_labelled_with_the_module_shapes(d_model, n_heads, n_kv_heads, seq_len):
    attention = MultiHeadAttention(d_model, d_model, n_heads, n_kv_heads)
    head_dim, group = d_model // n_heads, n_heads // n_kv_heads
    fig = model_figures.draw_attention_flow(attention, seq_len)
    assert sorted(labels(fig, "q head")) == sorted(f"q{h} (B, {seq_len}, {head_dim})" for h in range(n_heads))
    assert len(texts(fig, "k head")) == len(texts(fig, "v head")) == n_kv_heads
    assert labels(fig, "Q") == [f"Q (B, {seq_len}, {d_model})"]
    assert labels(fig, "K") == [f"K (B, {seq_len}, {n_kv_heads * head_dim})"]
    assert labels(fig, "qkv") == [f"qkv: Linear\n{d_model} → {d_model + 2 * n_kv_heads * head_dim}"]
    heads = sorted(texts(fig, "attention head"), key=lambda t: -t.get_position()[1])  # top to bottom
    assert [t.get_text() for t in heads] == [f"softmax(q{h}·k{h // group}ᵀ/√{head_dim})·v{h // group}"
                                             for h in range(n_heads)]
    assert f"n_heads={n_heads}, n_kv_heads={n_kv_heads}, head_dim={head_dim}, T={seq_len}" in fig.axes[0].get_title()


# --------------------------------------------------------------------------- the model
def test_gpt_diagram_reads_its_labels_off_each_model():
    gpt2_like = GPTConfig(vocab_size=100, context_length=16, d_model=32, n_layers=3, n_heads=4)
    llama_like = GPTConfig(vocab_size=120, context_length=16, d_model=32, n_layers=5, n_heads=4, n_kv_heads=2,
                           d_ff=48, norm="rmsnorm", mlp="swiglu", position="rope", tie_embeddings=False)
    models = [GPT(gpt2_like), GPT(llama_like)]
    fig = model_figures.draw_gpt(*models)
    first, second = fig.axes
    assert labels(fig, "repeat", first) == ["× 3 blocks"] and labels(fig, "repeat", second) == ["× 5 blocks"]
    assert labels(fig, "norm", first) == ["attn_norm: LayerNorm", "mlp_norm: LayerNorm"]
    assert labels(fig, "norm", second) == ["attn_norm: RMSNorm", "mlp_norm: RMSNorm"]
    assert labels(fig, "mlp", first) == ["mlp: GELUMLP\n32 → 128 → 32"]
    assert labels(fig, "mlp", second) == ["mlp: SwiGLU\n32 → 48 → 32"]
    assert labels(fig, "attn", second) == ["attn: MultiHeadAttention\nn_heads=4, n_kv_heads=2"]
    assert labels(fig, "positions", first) == ["position_embedding\nEmbedding(16, 32)"]
    assert "RoPE" in labels(fig, "positions", second)[0]
    assert labels(fig, "lm_head", first) == ["lm_head: Linear(32, 100)\ntied to token_embedding"]
    assert labels(fig, "lm_head", second) == ["lm_head: Linear(32, 120)"]
    assert f"{models[1].num_params():,} parameters" in second.get_title()


# --------------------------------------------------------------------------- LoRA
@pytest.mark.parametrize("d_in, d_out, rank, alpha", [(256, 768, 8, 16), (10, 6, 2, 3), (64, 64, 4, 4)])
def test_lora_diagram_carries_the_layer_shapes_and_counts(d_in, d_out, rank, alpha):
    layer = LoRALinear(torch.nn.Linear(d_in, d_out, bias=False), rank=rank, alpha=alpha)
    fig = finetuning_figures.draw_lora(layer)
    assert labels(fig, "W") == [f"W: {d_out} × {d_in}\nfrozen: {d_out * d_in:,}"]
    assert labels(fig, "A") == [f"A: {rank} × {d_in}\ntrained: {rank * d_in:,}"]
    assert labels(fig, "B") == [f"B: {d_out} × {rank}\ntrained: {d_out * rank:,}"]
    assert labels(fig, "scaling") == [f"× α/r = {alpha:g}/{rank}\n= {alpha / rank:g}"]
    w = next(p for p in fig.axes[0].patches if isinstance(p, Rectangle) and p.get_gid() == "W")
    assert w.get_height() / w.get_width() == pytest.approx(d_out / d_in)  # drawn to its shape
    assert f"{rank * (d_in + d_out):,} trained numbers" in fig.axes[0].get_title()


# --------------------------------------------------------------------------- DPO
def test_dpo_curves_are_the_package_loss_at_each_margin():
    betas, margins = (0.05, 0.3, 2.0), torch.linspace(-6, 6, 13)
    fig = alignment_figures.draw_dpo_loss(betas, margins)
    curves = {line.get_gid(): line for line in fig.axes[0].lines if line.get_gid()}
    assert sorted(curves) == sorted(f"beta {beta:g}" for beta in betas)
    zero = torch.zeros(1)
    for beta in betas:
        line = curves[f"beta {beta:g}"]
        assert list(line.get_xdata()) == margins.tolist()
        expected = [dpo_loss(torch.tensor([m]), zero, zero, zero, beta)[0].item() for m in margins.tolist()]
        assert list(line.get_ydata()) == expected
        closed_form = (-F.logsigmoid(beta * margins)).tolist()  # and it is -log sigmoid(beta * margin)
        assert list(line.get_ydata()) == pytest.approx(closed_form, rel=1e-5)


def test_expert_load_bands_are_the_logged_shares():
    steps = [100, 200, 300]
    loads = [[[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]], [[0.4, 0.3, 0.3], [0.3, 0.3, 0.4]],
             [[1 / 3, 1 / 3, 1 / 3], [0.1, 0.1, 0.8]]]  # 3 evaluations x 2 layers x 3 experts
    fig = model_figures.draw_expert_load(steps, loads, "a run")
    assert [ax.get_title() for ax in fig.axes] == ["layer 0", "layer 1"]
    for layer, ax in enumerate(fig.axes):
        bands = [c for c in ax.collections if c.get_gid() == f"layer {layer}"]
        assert len(bands) == 3  # one band per expert
        tops = [max(v[1] for v in band.get_paths()[0].vertices) for band in bands]  # each band's top edge
        assert tops[-1] == pytest.approx(1.0)  # the shares of a layer add up to 1
        first_band = bands[0].get_paths()[0].vertices
        assert max(first_band[:, 1]) == pytest.approx(max(load[layer][0] for load in loads))


# --------------------------------------------------------------------------- every figure renders
def test_every_figure_renders_with_no_missing_glyph(gpt2, small_tokenizer):
    attention = MultiHeadAttention(16, 16, 4, 2)
    model = GPT(GPTConfig.from_preset("llama-tiny", vocab_size=64, n_layers=1))
    layer = LoRALinear(torch.nn.Linear(8, 12), rank=2, alpha=4)
    drawn = [text_figures.draw_merge_tree(gpt2, " déjà vu 🐳\n"), text_figures.draw_merge_tree(small_tokenizer, "$x$ whale"),
             text_figures.draw_sliding_windows(SlidingWindowDataset(gpt2.encode("a b c d e f g"), 3, 2), gpt2),
             model_figures.draw_attention_flow(attention, 5), model_figures.draw_grouped_query(attention),
             model_figures.draw_gpt(model), finetuning_figures.draw_lora(layer), alignment_figures.draw_dpo_loss((0.1, 0.5)),
             model_figures.draw_expert_load([1, 2], [[[0.5, 0.5]], [[0.3, 0.7]]], "2 experts")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Glyph ... missing from font" is a warning
        for fig in drawn:
            fig.savefig(io.BytesIO(), format="png", dpi=30)  # every glyph is looked up at any resolution
