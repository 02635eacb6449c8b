"""The Moby-Dick cloze set (llmscratch.alignment.cloze, written by ch06-alignment/make_cloze_data.py): built from the
held-out tenth only, true sentences in place, chance at 25%."""

import json
import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from processes import run as run_process

from llmscratch.alignment import cloze
from llmscratch.assets import MOBY_CLOZE_PATH, read_moby_dick
from llmscratch.text.data import held_out_moby_dick

SCRIPT = Path(__file__).resolve().parents[1] / "ch06-alignment" / "make_cloze_data.py"
TEXT = read_moby_dick()
SPLIT = int(len(TEXT) * 0.9)  # ch04-pretraining/pretrain.py's default: the last 10% by characters
HELD_OUT, TRAINING = " ".join(TEXT[SPLIT:].split()), " ".join(TEXT[:SPLIT].split())


@pytest.fixture(scope="module")
def items() -> list[dict]:
    return json.loads(MOBY_CLOZE_PATH.read_text(encoding="utf-8"))


def binomial_range(n: int, p: float = 0.25, outside: float = 1e-3) -> tuple[int, int]:
    """The smallest and largest count each with a tail probability of at least outside / 2, by exact sums."""
    pmf = [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]
    low = next(k for k in range(n + 1) if sum(pmf[: k + 1]) > outside / 2)
    high = next(k for k in range(n, -1, -1) if sum(pmf[k:]) > outside / 2)
    return low, high


def test_held_out_is_pretrainings_split():
    assert held_out_moby_dick() == TEXT[SPLIT:]
    assert held_out_moby_dick("abcdefghij", 0.3) == "hij"


def test_sentence_rule():
    paragraph = ("“Go aloft!” cried he. Then Mr. Starbuck came. “Where is it?” “There, sir!” said Stubb. "
                 "And so it was (as ever.) The end")
    assert cloze.split_sentences(paragraph) == [
        "“Go aloft!” cried he.", "Then Mr. Starbuck came.", "“Where is it?”", "“There, sir!” said Stubb.",
        "And so it was (as ever.)", "The end"]


def test_set_size_and_shape(items):
    assert 300 <= len(items) <= 500
    for item in items:
        assert len(item["choices"]) == 4 and 0 <= item["answer"] < 4
        assert len(set(item["choices"])) == 4  # four different sentences
        assert 30 <= len(item["choices"][item["answer"]]) <= 300 and len(item["context"]) <= 500


def test_true_sentence_follows_its_context_in_the_held_out_text(items):
    for item in items:
        assert f"{item['context']} {item['choices'][item['answer']]}" in HELD_OUT


def test_every_choice_comes_from_the_held_out_tenth_only(items):
    for item in items:
        for choice in item["choices"]:
            assert choice in HELD_OUT and choice not in TRAINING
            if choice != item["choices"][item["answer"]]:
                assert choice not in item["context"]


def test_answer_positions_are_uniform(items):
    counts = Counter(item["answer"] for item in items)
    expected = len(items) / 4
    chi_square = sum((counts[k] - expected) ** 2 / expected for k in range(4))
    assert chi_square < 16.27  # the 99.9% point of chi-square with 3 degrees of freedom
    assert all(0.15 <= counts[k] / len(items) <= 0.35 for k in range(4))


def test_position_and_length_baselines_score_chance(items):
    """Picking the first choice, or the choice of any length rank (shortest .. longest), hits about 25%.

    The bound: the central 99.9% of Binomial(n, 1/4), summed exactly. Distractors drawn from a
    window around the true length would put it at the shortest or longest only 1 time in 8 and
    in the middle 3 times in 4: far outside it.
    """
    low, high = binomial_range(len(items))
    first = sum(item["answer"] == 0 for item in items)
    assert low <= first <= high
    for rank in range(4):  # 0: the shortest choice ... 3: the longest
        hits = sum(sorted(range(4), key=lambda j, c=item["choices"]: (len(c[j]), j))[rank] == item["answer"]
                   for item in items)
        assert low <= hits <= high, f"length rank {rank}: {hits} of {len(items)}"


def test_binomial_range_against_the_normal_approximation():
    low, high = binomial_range(400)
    assert abs(low - (100 - 3.29 * math.sqrt(75))) <= 2 and abs(high - (100 + 3.29 * math.sqrt(75))) <= 2


def test_sentences_found_in_training_are_not_used(items):
    used = items[0]["choices"][items[0]["answer"]]
    rebuilt = cloze.make_items(TEXT[SPLIT:], training=f"Some text. {used} More text.", seed=0)
    assert all(used not in item["choices"] for item in rebuilt)
    assert len(rebuilt) < len(items)


def test_the_bundled_file_is_what_the_rules_build(items):
    assert items == cloze.make_items(TEXT[SPLIT:], training=TEXT[:SPLIT], seed=0)


@pytest.mark.slow
def test_check_passes_on_the_bundled_file_and_fails_on_a_changed_copy(tmp_path):
    def check(*argv) -> subprocess.CompletedProcess:
        return run_process([sys.executable, str(SCRIPT), "--check", *map(str, argv)], timeout=120)

    bundled = check()
    assert bundled.returncode == 0 and "up to date" in bundled.stdout
    changed = tmp_path / "cloze.json"
    changed.write_text(MOBY_CLOZE_PATH.read_text(encoding="utf-8").replace('"answer": 0', '"answer": 1', 1),
                       encoding="utf-8")
    differs = check("--out", changed)
    assert differs.returncode == 1 and re.search(r"record \d+ differs", differs.stderr)
