"""Chapters 3 and 4 show the model they say they show: the MLP classes are named for what they compute, ch03's
opening picture is the model ch04's script trains, and section 9's figures draw the package's masks and routes.
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.nn.functional as F
from matplotlib.patches import Rectangle

from benchmarks.pretrain_quality import pretrain_script
from llmscratch.model import figures as model_figures
from llmscratch.model.attention import causal_mask
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.model.mlp import GELUMLP, SquaredReLUMLP
from llmscratch.model.moe import MoE, route
from llmscratch.training.pretraining import model_config_for

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"norm": "rmsnorm", "position": "rope", "qkv_bias": False, "bias": False, "n_kv_heads": 2}


def code_cells(notebook: str) -> list[str]:
    cells = json.loads((ROOT / notebook).read_text())["cells"]
    return ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"]


# --------------------------------------------------------------------------- the MLP classes
@pytest.mark.parametrize("mlp, shape, expected_class, activation", [
    ("relu2", LLAMA, SquaredReLUMLP, lambda h: F.relu(h) ** 2),  # chapter 4's model
    ("relu2", {}, SquaredReLUMLP, lambda h: F.relu(h) ** 2),  # GPT-2's shape (pretrain.py --preset gpt2-small)
    ("gelu", {}, GELUMLP, lambda h: F.gelu(h, approximate="tanh")),
    ("gelu", LLAMA, GELUMLP, lambda h: F.gelu(h, approximate="tanh")),
])
def test_a_printed_model_names_the_activation_its_mlp_computes(mlp, shape, expected_class, activation):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, context_length=8, d_model=16, n_layers=2, n_heads=4, d_ff=40, mlp=mlp,
                          **shape)).double()
    block_mlp = model.blocks[1].mlp
    assert type(block_mlp) is expected_class
    other = "GELU" if expected_class is SquaredReLUMLP else "SquaredReLU"
    assert other not in repr(model) and f"(mlp): {expected_class.__name__}(" in repr(model)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(block_mlp(x), block_mlp.proj(activation(block_mlp.fc(x))), rtol=1e-12, atol=1e-12)
    assert sorted(block_mlp.state_dict()) == (["fc.bias", "fc.weight", "proj.bias", "proj.weight"] if not shape
                                              else ["fc.weight", "proj.weight"])  # checkpoints keep their names


# --------------------------------------------------------------------------- ch03's opening picture
def test_ch03_opening_picture_is_the_model_pretrain_py_trains():
    cell = next(source for source in code_cells("ch03-architecture/architecture.ipynb") if "draw_gpt(" in source)
    namespace = {"torch": torch}
    exec(cell, namespace)  # noqa: S102 (the notebook's own cell: builds `pictured` on the meta device)
    _, chapter4 = namespace["pictured"]
    trained = model_config_for(pretrain_script().build_parser().parse_args([]), chapter4.config.vocab_size)
    assert chapter4.config == trained
    assert chapter4.config.vocab_size == 4096  # pretrain.py's default tokenizer, bpe:4096
    fig = model_figures.draw_gpt(chapter4)
    mlp_labels = [t.get_text() for t in fig.axes[0].texts if t.get_gid() == "mlp"]
    assert mlp_labels == [f"mlp: SquaredReLUMLP\n256 → {trained.hidden_dim} → 256"]


# --------------------------------------------------------------------------- ch03 section 9's figures
@pytest.mark.parametrize("seq_len, window", [(8, 3), (11, 1), (6, 6), (5, 9)])
def test_window_figure_draws_the_full_mask_beside_the_band(seq_len, window):
    fig = model_figures.draw_window_masks(seq_len, window)
    full, sliding = fig.axes
    drawn = [torch.as_tensor(ax.images[0].get_array()).bool() for ax in (full, sliding)]
    assert torch.equal(drawn[0], causal_mask(seq_len, seq_len))
    assert torch.equal(drawn[1], causal_mask(seq_len, seq_len, window=window))
    assert torch.equal(drawn[1], causal_mask(seq_len, seq_len)) == (window >= seq_len)
    band_pairs = sum(min(p + 1, window) for p in range(seq_len))
    assert f"{band_pairs} of {seq_len * seq_len} pairs" in sliding.get_title()
    assert [ax.get_xlabel() for ax in fig.axes] == ["key position"] * 2
    assert [ax.get_ylabel() for ax in fig.axes] == ["query position"] * 2


@pytest.mark.parametrize("n_experts, k, norm_topk, n_tokens", [(6, 2, True, 10), (8, 1, False, 7), (4, 3, True, 5)])
def test_routing_figure_outlines_the_experts_route_chooses(n_experts, k, norm_topk, n_tokens):
    torch.manual_seed(n_experts)
    moe = MoE(12, 8, n_experts, k, norm_topk=norm_topk).eval()
    with torch.no_grad():
        moe.router.weight.normal_(0, 2.0)  # confident choices, so the outlined cells are the darkest
    tokens = torch.randn(n_tokens, 12)
    weights, experts, probs = route(moe.router(tokens).detach(), k, norm_topk)
    fig = model_figures.draw_routing(moe, tokens)
    grid, load = fig.axes[:2]  # (the third is the colour bar)
    torch.testing.assert_close(torch.as_tensor(grid.images[0].get_array().data), probs)
    outlined = sorted((int(p.get_x() + 0.5), int(p.get_y() + 0.5)) for p in grid.patches if isinstance(p, Rectangle))
    assert outlined == sorted((e, t) for t in range(n_tokens) for e in experts[t].tolist())
    written = {t.get_gid(): t.get_text() for t in grid.texts}
    assert written == {f"token {t} -> expert {e}": f"{w:.2f}" for t in range(n_tokens)
                       for e, w in zip(experts[t].tolist(), weights[t].tolist())}
    heights = [bar.get_height() for bar in load.patches if bar.get_gid() == "load"]
    assert heights == torch.bincount(experts.flatten(), minlength=n_experts).tolist()


# --------------------------------------------------------------------------- figures a reader can read
@pytest.mark.parametrize("notebook", ["ch03-architecture/architecture.ipynb", "ch04-pretraining/pretraining.ipynb",
                                      "ch04-pretraining/appendix.ipynb"])
def test_no_figure_is_a_wall_of_tiny_panels(notebook):
    cells = json.loads((ROOT / notebook).read_text())["cells"]
    shown = ["".join(output["data"]["text/plain"]) for cell in cells for output in cell.get("outputs", [])
             if "image/png" in output.get("data", {})]
    assert shown, f"{notebook} shows no figure: it was committed without outputs"
    panels = {text: int(text.split(" with ")[1].split()[0]) for text in shown}  # "<Figure size 1200x1200 with 5 Axes>"
    assert max(panels.values()) <= 12, [text for text, count in panels.items() if count > 12]
