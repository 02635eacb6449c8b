"""Chapter 5's forgetting figure shows every run's point whole, wherever the runs land."""

import matplotlib

matplotlib.use("Agg")

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from llmscratch.finetuning.figures import draw_forgetting

# The notebook's short runs (exact match, bits per byte): close together, the top one at the edge of an autoscale.
SHORT_RUNS = {"finetuned (4.1)": (0.431, 3.247), "replay, 2 windows": (0.444, 2.085), "LoRA, rank 8": (0.403, 2.206),
              "lr 3e-4": (0.444, 2.606)}
FULL_RUNS = {"no remedy": (0.212, 4.526), "--replay 2": (0.224, 2.076), "--lora": (0.096, 2.639), "--lr 3e-4": (0.135, 3.044)}


def markers_outside(fig):
    """The runs whose marker reaches past its panel's edges, in pixels on the rendered figure."""
    FigureCanvasAgg(fig).draw()
    outside = []
    for ax in fig.axes:
        box = ax.get_window_extent()
        for line in ax.lines:
            if line.get_marker() in (None, "None", ""):
                continue
            radius = line.get_markersize() / 2 * fig.dpi / 72  # points to pixels
            for x, y in ax.transData.transform(line.get_xydata()):
                if not (box.x0 <= x - radius and x + radius <= box.x1 and box.y0 <= y - radius and y + radius <= box.y1):
                    outside.append(line.get_gid())
    return outside


@pytest.mark.parametrize("runs", [SHORT_RUNS, FULL_RUNS, {"one run": (1.0, 2.0)}, {"a": (0.5, 2.0), "b": (0.5, 2.0001)},
                                  {"a": (0.02, 2.5), "b": (0.021, 2.6)}, {"none right": (0.0, 4.0)}])
def test_every_run_is_drawn_whole_inside_its_panel(runs):
    fig = draw_forgetting([("runs", runs, 3.6)], base_bits=1.965)
    assert markers_outside(fig) == []


def test_each_run_is_one_point_at_its_numbers_and_zero_exact_match_is_in_view():
    fig = draw_forgetting([("short", SHORT_RUNS, 3.627), ("full", FULL_RUNS, 3.558)], base_bits=1.965)
    for ax, runs in zip(fig.axes, (SHORT_RUNS, FULL_RUNS)):
        drawn = {line.get_gid(): tuple(line.get_xydata()[0]) for line in ax.lines if line.get_gid() in runs}
        assert drawn == {name: (bits, match) for name, (match, bits) in runs.items()}
        assert ax.get_ylim()[0] < 0 < max(match for match, _ in runs.values()) < ax.get_ylim()[1]
