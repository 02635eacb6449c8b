"""Numbers the chapters' prose quotes are the numbers their outputs show.

A notebook's markdown that quotes a measured number (a loss, bits per byte, a speed-up, a difference) goes
stale when the cells are run again and print another. Every decimal number in a markdown cell (one decimal
or more: "0.533", "1.49x", "2.5") and every number in scientific form ("7.45e-5", "$7.45 \\times 10^{-5}$",
"about $10^{-5}$") must therefore appear in the same notebook's code cells (their outputs, or their code for
a setting the text names): a decimal rounded as written, a number in scientific form to its significant
digits, a bare power of ten as the nearest power of ten of some value shown. Section numbers ("section 4.2",
a heading's "4.2") are no quotes. Whole numbers are left out: most are settings (steps, sizes, seeds), and a
measurement worth quoting is written with its decimals. A number no cell shows is listed in
``QUOTED_ELSEWHERE`` with where it comes from: a file of this repository that holds it (another notebook's
outputs, benchmarks/RESULTS.md, a module), or why it is no measurement at all (a setting, a constant of the
method). This reads the committed notebooks: re-running one and committing new outputs that contradict its
text fails here.
"""

import json
import math
import re
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(ROOT.glob("ch0*/*.ipynb"))
# A number in scientific form: 7.45e-5, 7.45 \times 10^{-5} (or x, ×), and a bare power of ten, 10^{-5}.
SCIENTIFIC = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:[eE]([-+]?\d+)(?![\w.])|\s*(?:\\times|×|\*)\s*10\^\{?([-+−]?\d+)\}?)")
POWER_OF_TEN = re.compile(r"(?<![\w.^])10\^\{?([-+−]?\d+)\}?")
# A decimal number, not part of a version, a date or a longer dotted name.
DECIMAL = re.compile(r"(?<![\w.])(\d+\.\d+)(?![.\w]*\d)")
# A section's number: "section 4.2", "sections 1.2 and 1.3", a heading's "## 4.2 The accept/reject rule", "(7.1)".
SECTION = re.compile(r"(?:\b(?:[Ss]ections?|[Ee]xercises?|[Cc]hapters?|[Ff]igures?|[Pp]arts?|[Ss]teps?)\s+|§\s*)"
                     r"\"?\d+\.\d+(?:\s*(?:,|and|or|to|-|–)\s*\"?\d+\.\d+)*|^#+\s+\d+\.\d+|\(\d\.\d\)", re.MULTILINE)
# Any number an output or a code cell shows, in scientific form or not ("1.45x" too).
SHOWN = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)(?!\.?\d)")
THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # 317,196.5 reads as 317196.5

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
    ("ch06-alignment/alignment.ipynb", "2e-5"): "ch06-alignment/finetune_preferences.py (the DPO script's --lr)",
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
    # Measurements the text cites from RESULTS.md, and published constants.
    ("ch04-pretraining/appendix.ipynb", "96.0"): "benchmarks/RESULTS.md",
    ("ch04-pretraining/appendix.ipynb", "98.7"): "benchmarks/RESULTS.md",
    ("ch04-pretraining/appendix.ipynb", "95.6"): "benchmarks/RESULTS.md",
    ("ch04-pretraining/appendix.ipynb", "97.8"): "benchmarks/RESULTS.md",
    ("ch04-pretraining/appendix.ipynb", "3.35"): "Qwen3-30B-A3B's active parameters, a published constant",
    ("ch04-pretraining/appendix.ipynb", "30.5"): "Qwen3-30B-A3B's parameters, a published constant",
    ("ch04-pretraining/appendix.ipynb", "6e-4"): "the learning rate of the command shown, a setting",
    ("ch05-finetuning/finetuning.ipynb", "96.0"): "benchmarks/RESULTS.md",
    ("ch05-finetuning/finetuning.ipynb", "97.3"): "benchmarks/RESULTS.md",
    ("ch05-finetuning/finetuning.ipynb", "98.7"): "benchmarks/RESULTS.md",
    ("ch06-alignment/appendix.ipynb", "22.4"): "benchmarks/RESULTS.md",
    ("ch06-alignment/appendix.ipynb", "20.8"): "benchmarks/RESULTS.md",
    ("ch06-alignment/appendix.ipynb", "23.1"): "benchmarks/RESULTS.md",
    ("ch06-alignment/appendix.ipynb", "25.3"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "47.6"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "41.0"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "57.1"): "benchmarks/RESULTS.md",
    ("ch07-deployment/deployment.ipynb", "64.5"): "benchmarks/RESULTS.md",
    # Settings and constants the prose names (one-decimal and scientific quotes are read too).
    ("ch01-tokenization/exercises.ipynb", "0.5"): "a test setting of the exercise (p)",
    ("ch01-tokenization/solutions.ipynb", "0.5"): "a test setting of the exercise (p)",
    ("ch01-tokenization/tokenization.ipynb", "38.6"): "GPT-2 small's embedding, 50,257 x 768, worked out in the text",
    ("ch03-architecture/architecture.ipynb", "38.6"): "GPT-2 small's embedding, 50,257 x 768, worked out in the text",
    ("ch03-architecture/exercises.ipynb", "1.1"): "TinyLlama's size, its name",
    ("ch03-architecture/exercises.ipynb", "30.0"): "Gemma 2's soft cap, a setting",
    ("ch03-architecture/solutions.ipynb", "1.1"): "TinyLlama's size, its name",
    ("ch03-architecture/solutions.ipynb", "30.0"): "Gemma 2's soft cap, a setting",
    ("ch04-pretraining/exercises.ipynb", "0.5"): "a test setting of the exercise (p)",
    ("ch04-pretraining/exercises.ipynb", "0.3"): "a test setting of the exercise (smoothing)",
    ("ch04-pretraining/exercises.ipynb", "0.7"): "a test setting of the exercise (temperature)",
    ("ch04-pretraining/exercises.ipynb", "1.5"): "a test setting of the exercise (temperature)",
    ("ch04-pretraining/solutions.ipynb", "0.5"): "a test setting of the exercise (p)",
    ("ch04-pretraining/solutions.ipynb", "0.7"): "a test setting of the exercise (temperature)",
    ("ch04-pretraining/solutions.ipynb", "1.5"): "a test setting of the exercise (temperature)",
    ("ch04-pretraining/solutions.ipynb", "3.2"): "worked out in the solution's text from the betas",
    ("ch05-finetuning/exercises.ipynb", "8.0"): "a test setting of the exercise (alpha)",
    ("ch05-finetuning/solutions.ipynb", "8.0"): "a test setting of the exercise (alpha)",
    ("ch05-finetuning/solutions.ipynb", "0.5"): "worked out in the solution's text (precision 1, recall 0)",
    ("ch06-alignment/exercises.ipynb", "1e-9"): "the check's tolerance, a setting",
    ("ch06-alignment/exercises.ipynb", "1e-4"): "GRPO's epsilon, a setting",
    ("ch06-alignment/exercises.ipynb", "10^-4"): "GRPO's epsilon, a setting",
    ("ch06-alignment/exercises.ipynb", "0.1"): "a test setting of the exercise",
    ("ch06-alignment/exercises.ipynb", "0.2"): "a test setting of the exercise (clip)",
    ("ch06-alignment/exercises.ipynb", "0.3"): "a test setting of the exercise (label_smoothing)",
    ("ch06-alignment/exercises.ipynb", "0.4"): "a test setting of the exercise (clip)",
    ("ch06-alignment/exercises.ipynb", "0.5"): "a test setting of the exercise",
    ("ch06-alignment/exercises.ipynb", "1.5"): "a test setting of the exercise",
    ("ch06-alignment/exercises.ipynb", "2.5"): "a test setting of the exercise (beta)",
    ("ch06-alignment/solutions.ipynb", "1e-9"): "the check's tolerance, a setting",
    ("ch06-alignment/solutions.ipynb", "1e-17"): "a float64 rounding error, worked out in the text",
    ("ch06-alignment/solutions.ipynb", "0.1"): "a test setting of the exercise",
    ("ch06-alignment/solutions.ipynb", "0.2"): "a test setting of the exercise (clip)",
    ("ch06-alignment/solutions.ipynb", "0.3"): "a test setting of the exercise (label_smoothing)",
    ("ch06-alignment/solutions.ipynb", "0.4"): "a test setting of the exercise (clip)",
    ("ch06-alignment/solutions.ipynb", "0.5"): "a test setting of the exercise",
    ("ch06-alignment/solutions.ipynb", "1.5"): "a test setting of the exercise",
    ("ch06-alignment/solutions.ipynb", "2.5"): "a test setting of the exercise (beta)",
    ("ch06-alignment/solutions.ipynb", "0.9"): "worked out in the solution's text (1 - 1/10)",
    ("ch07-deployment/appendix.ipynb", "10^-16"): "float64's rounding, a constant",
    ("ch07-deployment/appendix.ipynb", "10^-7"): "float32's rounding, a constant",
    ("ch07-deployment/exercises.ipynb", "1e-30"): "a test case of the exercise",
    ("ch07-deployment/exercises.ipynb", "0.5"): "a test setting of the exercise (T)",
    ("ch07-deployment/exercises.ipynb", "0.1"): "a test setting of the exercise",
    ("ch07-deployment/solutions.ipynb", "1e-30"): "a test case of the exercise",
    ("ch07-deployment/solutions.ipynb", "0.5"): "a test setting of the exercise (T)",
    ("ch07-deployment/solutions.ipynb", "0.1"): "a test setting of the exercise",
    ("ch07-deployment/solutions.ipynb", "1e-8"): "the round floor the solution warns against, a setting",
}


def prose_numbers(text: str) -> list[str]:
    """The quotes of a markdown text, each as a key of QUOTED_ELSEWHERE: "0.533", "7.45e-5", "10^-5"."""
    text = THOUSANDS.sub("", SECTION.sub(" ", text))
    found = [f"{m[1]}e{int((m[2] or m[3]).replace('−', '-'))}" for m in SCIENTIFIC.finditer(text)]
    text = SCIENTIFIC.sub(" ", text)
    found += [f"10^{int(m[1].replace('−', '-'))}" for m in POWER_OF_TEN.finditer(text)]
    return found + DECIMAL.findall(POWER_OF_TEN.sub(" ", text))


def shown_numbers(text: str) -> list[str]:
    """Every number a code cell or an output shows (or a file holds), its sign left out."""
    return SHOWN.findall(THOUSANDS.sub("", text))


def shown_as(written: str, value: str) -> bool:
    """Whether ``value`` (from an output or a file) reads ``written``: a decimal rounded to as many decimals,

    a number in scientific form to as many significant digits, a bare power of ten the nearest one.
    """
    if written.startswith("10^"):
        number = float(value)
        return number != 0 and abs(math.log10(number) - int(written[3:])) <= 0.5
    digits = Decimal(value).as_tuple().digits
    if "e" in written:
        mantissa = written.split("e")[0]
        significant = len(Decimal(mantissa).as_tuple().digits)
        if Decimal(value) == 0 or len(digits) < significant:
            return False  # a value with fewer digits than the prose cannot be its source
        step = Decimal(1).scaleb(Decimal(value).adjusted() - significant + 1)
        return any(Decimal(value).quantize(step, rounding) == Decimal(written) for rounding in (ROUND_HALF_UP,
                                                                                                 ROUND_HALF_EVEN))
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
    return any(shown_as(written, value) for value in shown_numbers(text))


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
        for written in prose_numbers("".join(cell["source"])):
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
                quoted.update((name, written) for written in prose_numbers("".join(cell["source"])))
    assert not set(QUOTED_ELSEWHERE) - quoted, sorted(set(QUOTED_ELSEWHERE) - quoted)


@pytest.mark.parametrize("written, value, expected", [
    ("4.60", "4.598", True), ("4.598", "4.598", True), ("4.2", "4.014", False), ("4.64", "4.598", False),
    ("1.967", "1.9670", True), ("1.967", "1.97", False), ("0.58", "0.584", True), ("2.50", "2.505", True),
    ("1.49", "1.45", False), ("0.533", "0.508", False), ("2.5", "2.47", True), ("7.45e-5", "7.4506e-05", True),
    ("7.45e-5", "0.0000745", True), ("7.45e-5", "7.5e-05", False), ("1e-8", "1e-08", True),
    ("10^-5", "7.45e-05", False), ("10^-4", "7.45e-05", True), ("10^-5", "1.2e-05", True),
])
def test_a_quote_matches_a_value_rounded_as_written(written, value, expected):
    assert shown_as(written, value) is expected


@pytest.mark.parametrize("text, expected", [
    ("the difference over epsilon is about $10^{-5}$", ["10^-5"]),
    ("it gives $-7.45 \\times 10^{-5}$, and 1e-8 is the floor", ["7.45e-5", "1e-8"]),
    ("1.49x at this draft's a = 0.533 for k = 2", ["1.49", "0.533"]),
    ("section 4.2's sum, sections 1.2 and 1.3, Python 3.11.2, 317,196.5 tokens", ["317196.5"]),
    ("## 4.2 The accept/reject rule\nof 2.47", ["2.47"]),
])
def test_the_prose_quotes_are_read_as_written(text, expected):
    assert prose_numbers(text) == expected
