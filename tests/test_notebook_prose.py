"""Numbers the chapters' prose quotes are the numbers their outputs show.

A notebook's markdown that quotes a measured number (a loss, bits per byte, a score) goes stale when the
cells are run again and print another. Every number written with two or more decimals in a markdown cell
must therefore appear, rounded as written, in the same notebook's code cells (their outputs, or their code
for a setting the text names), or be
listed in ``QUOTED_ELSEWHERE`` with where it comes from: a file of this repository that holds it (another
notebook's outputs, benchmarks/RESULTS.md, a module), or why it is no measurement at all (a setting, a
constant of the method). This reads the committed notebooks: re-running one and committing new outputs
that contradict its text fails here.
"""

import json
import re
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(ROOT.glob("ch0*/*.ipynb"))
# A decimal number with at least two decimals, not part of a version, a date or a longer dotted name.
NUMBER = re.compile(r"(?<![\w.])(\d+\.\d{2,})(?![.\w]*\d)")

# (notebook, number as written) -> a file holding it, or why it is not a measurement of the notebook's own.
QUOTED_ELSEWHERE = {
    ("ch03-architecture/architecture.ipynb", "2.75"): "TinyLlama's MLP width over its model width, 5,632 / 2,048",
    ("ch04-pretraining/exercises.ipynb", "0.01"): "a test setting of the exercise (p = 0.01)",
    ("ch04-pretraining/solutions.ipynb", "0.01"): "a test setting of the exercise (p = 0.01)",
    ("ch04-pretraining/solutions.ipynb", "0.45"): "worked out in the solution's text from the betas",
    ("ch04-pretraining/solutions.ipynb", "0.999"): "AdamW's usual beta2, a setting",
    # Differences of the losses printed under section 8 (5.598 - 5.200, 4.641 - 4.596, 5.726 - 5.598, 4.598 - 4.014).
    ("ch04-pretraining/pretraining.ipynb", "0.40"): "a difference of two printed losses",
    ("ch04-pretraining/pretraining.ipynb", "0.13"): "a difference of two printed losses",
    ("ch04-pretraining/pretraining.ipynb", "0.58"): "a difference of two printed losses",
    ("ch04-pretraining/pretraining.ipynb", "0.04"): "a difference of two printed losses",
    ("ch04-pretraining/appendix.ipynb", "0.006"): "a threshold under the printed 0.007",
    ("ch04-pretraining/appendix.ipynb", "4.014"): "ch04-pretraining/pretraining.ipynb",
    ("ch04-pretraining/appendix.ipynb", "4.598"): "ch04-pretraining/pretraining.ipynb",
    ("ch04-pretraining/appendix.ipynb", "2.137"): "benchmarks/RESULTS.md",
    ("ch04-pretraining/appendix.ipynb", "1.986"): "benchmarks/RESULTS.md",
    ("ch04-pretraining/appendix.ipynb", "2.38"): "benchmarks/RESULTS.md",
    ("ch04-pretraining/appendix.ipynb", "2.47"): "benchmarks/RESULTS.md",
    ("ch04-pretraining/appendix.ipynb", "2.023"): "benchmarks/RESULTS.md",
    ("ch04-pretraining/appendix.ipynb", "1.988"): "benchmarks/RESULTS.md",
    ("ch04-pretraining/appendix.ipynb", "1.965"): "benchmarks/RESULTS.md",
    ("ch04-pretraining/appendix.ipynb", "0.002"): "benchmarks/RESULTS.md",
    ("ch04-pretraining/appendix.ipynb", "2.07"): "ch04-pretraining/pretraining.ipynb",
    ("ch04-pretraining/appendix.ipynb", "3.4445"): "llmscratch/training/optim.py",
    ("ch04-pretraining/appendix.ipynb", "4.7750"): "llmscratch/training/optim.py",
    ("ch04-pretraining/appendix.ipynb", "2.0315"): "llmscratch/training/optim.py",
    ("ch05-finetuning/finetuning.ipynb", "1.967"): "ch04-pretraining/pretraining.ipynb",
    ("ch05-finetuning/finetuning.ipynb", "12.81"): "ch04-pretraining/appendix.ipynb",
    ("ch05-finetuning/finetuning.ipynb", "12.71"): "ch04-pretraining/appendix.ipynb",
    ("ch05-finetuning/finetuning.ipynb", "11.433"): "benchmarks/RESULTS.md",
    ("ch05-finetuning/finetuning.ipynb", "1.683"): "benchmarks/RESULTS.md",
    ("ch06-alignment/alignment.ipynb", "0.01"): "the low end of the usual range of beta, a setting",
    ("ch06-alignment/exercises.ipynb", "2.576"): "z of a 99% interval, a constant",
    ("ch06-alignment/exercises.ipynb", "0.01"): "a test setting of the exercise (beta)",
    ("ch06-alignment/solutions.ipynb", "2.576"): "z of a 99% interval, a constant",
    ("ch06-alignment/solutions.ipynb", "0.01"): "a test setting of the exercise (beta)",
    # Measurements of the whole held-out tenth, the timed runs and the three-seed distillation, quoted from
    # RESULTS.md's sections of issue 31; the settings comparison is the one distill.py's docstring records.
    ("ch07-deployment/deployment.ipynb", "1.967"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "1.9604"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "1.9615"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "1.9623"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "0.004"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "0.135"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "0.076"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "0.95"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "1.04"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "0.042"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "0.075"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "0.128"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "0.277"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "0.025"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "1.16"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "1.64"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "1.03"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "1.06"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "2.3594"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "2.4952"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "0.136"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "0.012"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "3.39"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "2.1754"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "2.112"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "2.38"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "2.44"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "1.81"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "2.536"): "llmscratch/deployment/distill.py",
    ("ch07-deployment/deployment.ipynb", "2.590"): "llmscratch/deployment/distill.py",
    ("ch07-deployment/deployment.ipynb", "2.602"): "llmscratch/deployment/distill.py",
    ("ch07-deployment/deployment.ipynb", "2.674"): "llmscratch/deployment/distill.py",
}


def numbers(text: str) -> list[str]:
    return NUMBER.findall(text.replace(",", ""))  # 317,196.5 reads as 317196.5


def shown_as(written: str, value: str) -> bool:
    """Whether ``value`` (from an output or a file), rounded to as many decimals as ``written``, reads ``written``."""
    places = Decimal(1).scaleb(Decimal(written).as_tuple().exponent)
    if -Decimal(value).as_tuple().exponent < -places.as_tuple().exponent:
        return False  # a value with fewer decimals than the prose cannot be its source
    return any(Decimal(value).quantize(places, rounding) == Decimal(written) for rounding in (ROUND_HALF_UP,
                                                                                               ROUND_HALF_EVEN))


def output_text(notebook: dict) -> str:
    """What the code cells show: their outputs, and their code (a setting the prose names, 0.95 or 2.07)."""
    parts = []
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            parts.append("".join(cell["source"]))
        for output in cell.get("outputs", []):
            parts.append("".join(output.get("text", "")))
            parts.extend("".join(value) for kind, value in output.get("data", {}).items() if kind.startswith("text"))
    return "\n".join(parts)


def read_notebook(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def appears_in(written: str, text: str) -> bool:
    return any(shown_as(written, value) for value in numbers(text))


def source_text(source: str) -> str | None:
    """The text of a file named as a source, its outputs for a notebook; None for a reason, not a file."""
    path = ROOT / source
    if not path.is_file():
        return None
    return output_text(read_notebook(path)) if path.suffix == ".ipynb" else path.read_text(encoding="utf-8")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_numbers_in_the_prose_are_the_outputs_numbers(path):
    name = str(path.relative_to(ROOT))
    notebook = read_notebook(path)
    outputs = output_text(notebook)
    unsourced, stale = [], []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        for written in numbers("".join(cell["source"])):
            if appears_in(written, outputs):
                continue
            source = QUOTED_ELSEWHERE.get((name, written))
            if source is None:
                unsourced.append(f"cell {index}: {written}")
            elif (text := source_text(source)) is not None and not appears_in(written, text):
                stale.append(f"cell {index}: {written} (not in {source})")
    assert not unsourced, (f"{name}: numbers in the prose that no output of the notebook shows (fix the text, "
                           f"print them, or list their source in QUOTED_ELSEWHERE): {unsourced}")
    assert not stale, f"{name}: numbers whose listed source no longer holds them: {stale}"


def test_every_listed_source_is_still_quoted():
    """An entry whose number left the prose is removed, so the list stays the list of real quotes."""
    quoted = set()
    for path in NOTEBOOKS:
        name = str(path.relative_to(ROOT))
        for cell in read_notebook(path)["cells"]:
            if cell["cell_type"] == "markdown":
                quoted.update((name, written) for written in numbers("".join(cell["source"])))
    assert not set(QUOTED_ELSEWHERE) - quoted, sorted(set(QUOTED_ELSEWHERE) - quoted)


@pytest.mark.parametrize("written, value, expected", [
    ("4.60", "4.598", True), ("4.598", "4.598", True), ("4.2", "4.014", False), ("4.64", "4.598", False),
    ("1.967", "1.9670", True), ("1.967", "1.97", False), ("0.58", "0.584", True), ("2.50", "2.505", True),
])
def test_a_quote_matches_a_value_rounded_as_written(written, value, expected):
    assert shown_as(written, value) is expected
