"""The learning rates chapter 6's prose gives its scripts are the scripts' defaults.

The notebooks run short versions of ``finetune_preferences.py`` (DPO) and ``finetune_rl.py`` (GRPO) at
higher learning rates and say so, "three times the script's $10^{-4}$": that rate, and the multiple, must
be the script's own default (its ``--lr``), not one it had before.
"""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ("ch06-alignment/alignment.ipynb", "ch06-alignment/appendix.ipynb")
MULTIPLES = {"twice": 2, "two": 2, "three": 3, "four": 4, "five": 5, "ten": 10, "twenty": 20, "thirty": 30,
             "a hundred": 100}
RATE = r"\$([^$]*10\^\{?-?\d+\}?[^$]*)\$"
# "the script's 10^{-4}", "the script's default (2 x 10^{-5}", "the script's learning rate, 10^{-4}"
SCRIPT_RATE = re.compile(r"the script's (?:default |learning rate,? )?\(?" + RATE)
# "3 x 10^{-4}: three times the script's 10^{-4}", "2 x 10^{-4}, is ten times the script's default (2 x 10^{-5}"
MULTIPLE = re.compile(RATE + r"[:,]\s*(?:is\s+)?(" + "|".join(MULTIPLES) + r") times the script's (?:default )?\(?"
                      + RATE)
EVERY_WEIGHT = re.compile(r"every weight at " + RATE)  # the script's run, in a cell that names the script


def script_lr(name: str) -> float:
    spec = importlib.util.spec_from_file_location(name, ROOT / "ch06-alignment" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args([]).lr


def value(latex: str) -> float:
    """``2 \\times 10^{-5}`` or ``10^{-4}`` as a number."""
    match = re.fullmatch(r"\s*(?:([\d.]+)\s*\\times\s*)?10\^\{?(-?\d+)\}?\s*", latex)
    assert match, f"not a rate written as a x 10^k: {latex!r}"
    return float(match[1] or 1) * 10 ** int(match[2])


def script_sections(path: str) -> list[tuple[str, str]]:
    """Each markdown cell with the script its section runs at full size: GRPO's from section 7 on, and in the
    appendix; DPO's before it."""
    cells, script = [], "finetune_rl" if path.endswith("appendix.ipynb") else "finetune_preferences"
    for cell in json.loads((ROOT / path).read_text(encoding="utf-8"))["cells"]:
        text = " ".join("".join(cell["source"]).split())  # a phrase broken over two lines reads as one
        if cell["cell_type"] != "markdown":
            continue
        if text.startswith("## 7."):
            script = "finetune_rl"
        if text.startswith("## Summary"):
            script = None  # the summary speaks of both
        cells.append((text, script))
    return cells


@pytest.fixture(scope="module")
def defaults():
    return {name: script_lr(name) for name in ("finetune_preferences", "finetune_rl")}


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_the_scripts_rate_is_its_default(path, defaults):
    quoted = []
    for text, script in script_sections(path):
        rates = [value(latex) for latex in SCRIPT_RATE.findall(text)]
        if "finetune_rl.py" in text:
            rates += [value(latex) for latex in EVERY_WEIGHT.findall(text)]
        for rate in rates:
            expected = [defaults[script]] if script else list(defaults.values())
            assert any(abs(rate - lr) < 1e-12 for lr in expected), (
                f"{path}: the script's rate is given as {rate:g}; its --lr defaults to {expected}: {text[:200]!r}")
            quoted.append(rate)
    assert path.endswith("appendix.ipynb") or len(quoted) >= 3  # DPO's, GRPO's and the summary's are all read


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_a_multiple_of_the_scripts_rate_is_that_multiple(path):
    for text, _ in script_sections(path):
        for notebook_rate, multiple, script_rate in MULTIPLE.findall(text):
            assert abs(value(notebook_rate) - MULTIPLES[multiple] * value(script_rate)) < 1e-12, (
                f"{path}: {notebook_rate} is not {multiple} times {script_rate}")


def test_the_rates_are_read_from_the_prose():
    """The patterns find what the chapter writes (a pattern that matches nothing would pass any text)."""
    text = ("at a learning rate of $3 \\times 10^{-4}$: three times the script's $10^{-4}$, and every weight at "
            "$10^{-4}$ in `finetune_rl.py`; $2 \\times 10^{-4}$, is ten times the script's default ($2 \\times 10^{-5}$")
    assert [value(r) for r in SCRIPT_RATE.findall(text)] == [1e-4, 2e-5]
    assert [value(r) for r in EVERY_WEIGHT.findall(text)] == [1e-4]
    assert [(value(a), m, value(b)) for a, m, b in MULTIPLE.findall(text)] == [
        (pytest.approx(3e-4), "three", pytest.approx(1e-4)), (pytest.approx(2e-4), "ten", pytest.approx(2e-5))]
