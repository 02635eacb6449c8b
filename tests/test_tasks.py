"""The rule mistakes of llmscratch.alignment.tasks, and ch06-alignment/make_preference_data.py: the preference pairs,
the multiple-choice set and its chance level, --check, and answers made by a (tiny) model."""

import hashlib
import json
import math
import random
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from processes import run as run_process

from llmscratch.alignment import tasks
from llmscratch.assets import (INSTRUCTION_ANSWERS_PATH, INSTRUCTION_CHOICES_PATH, PREFERENCES_PATH, dumps_records,
                               read_instructions, read_moby_dick)
from llmscratch.finetuning.instruct import format_prompt, normalize_answer
from llmscratch.model.checkpoint import export_model
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.text.tokenizer import BPETokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "ch06-alignment" / "make_preference_data.py"
RECORDS = read_instructions()

# How the answers of each family are written, stated here apart from the script's own patterns.
FORMATS = {
    **dict.fromkeys(["reverse_letters", "sort_letters", "double_letters", "next_letter", "plural"], r"[a-z]( [a-z])*"),
    **dict.fromkeys(["count_letters", "count_words", "next_number"], r"[0-9]+"),
    **dict.fromkeys(["first_word", "last_word", "reverse_words", "repeat_word"], r"[a-z]+( [a-z]+)*"),
    "count_up": r"[0-9]+( [0-9]+)*",
}


def script(*argv, timeout: float = 120) -> subprocess.CompletedProcess:
    """The script run as a user runs it, in a fresh interpreter."""
    return run_process([sys.executable, str(SCRIPT), *map(str, argv)], timeout=timeout)


def key(record: dict) -> tuple[str, str]:
    return record["instruction"], record["input"]


def fake_answers(records: list[dict]) -> list[dict]:
    """Answers of every kind, in turn: right, wrong and well-formed, wrong but unfinished, blank."""
    answers = []
    for index, record in enumerate(records):
        kind = index % 4
        text = record["output"] if kind == 0 else (record["output"] + " " + record["output"].split()[0]
                                                   if kind in (1, 2) else "")
        answers.append({"instruction": record["instruction"], "input": record["input"], "split": record["split"],
                        "answer": text, "well_formed": kind != 2})
    return answers


def write_answers(path: Path, answers: list[dict]) -> None:
    path.write_text(json.dumps({"model": {"path": "fake"}, "answers": answers}), encoding="utf-8")


def paths(folder: Path) -> list[str]:
    return ["--answers", str(folder / "answers.json"), "--preferences", str(folder / "preferences.json"),
            "--choices", str(folder / "choices.json")]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """Both sets built from the bundled instructions and fake answers, in a temporary folder."""
    folder = tmp_path_factory.mktemp("built")
    answers = fake_answers(RECORDS)
    write_answers(folder / "answers.json", answers)
    result = script(*paths(folder))
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"wrote {len(RECORDS):,} pairs to {folder / 'preferences.json'}: train " in result.stdout
    assert f"wrote 312 multiple-choice items to {folder / 'choices.json'}" in result.stdout
    built = {"folder": folder, "answers": {key(a): a for a in answers},
             "pairs": json.loads((folder / "preferences.json").read_text()),
             "items": json.loads((folder / "choices.json").read_text())}
    assert (built["pairs"], built["items"]) == tasks.build_preference_data(RECORDS, answers, 0)  # what it writes
    return built


# --------------------------------------------------------------------------- the rule mistakes
@pytest.mark.parametrize("family", sorted(FORMATS))
def test_every_record_gets_three_distinct_well_formed_mistakes(family):
    records = [r for r in RECORDS if r["family"] == family]
    assert len(records) == 120  # no family left out: each has its records, and each record its mistakes
    for record in records:
        for rng in (random.Random(0), tasks.record_rng(1, "mistakes", record)):
            mistakes = tasks.plausible_mistakes(record, rng)
            normalized = [normalize_answer(m) for m in mistakes.values()]
            assert len(mistakes) >= 3 and len(set(normalized)) == len(normalized), mistakes
            assert normalize_answer(record["output"]) not in normalized
            assert all(re.fullmatch(FORMATS[family], m) for m in [record["output"], *mistakes.values()]), mistakes


def test_the_families_are_those_of_the_instructions():
    assert set(FORMATS) == {r["family"] for r in RECORDS} == set(tasks.FAMILIES)


@pytest.mark.parametrize("family, given, right, instruction, expected", [
    ("reverse_letters", "w h a l e", "e l a h w", "", {"unreversed": "w h a l e", "rotated": "l a h w e"}),
    ("sort_letters", "s h i p", "h i p s", "", {"unsorted": "s h i p", "reverse_order": "s p i h"}),
    ("count_letters", "w h a l e", "5", "", {"one_less": "4", "one_more": "6", "two_more": "7", "two_less": "3"}),
    ("count_words", "sails since", "2", "", {"one_less": "1", "one_more": "3", "two_more": "4"}),
    ("double_letters", "a b c", "a a b b c c", "", {"undoubled": "a b c", "word_twice": "a b c a b c"}),
    ("next_letter", "a b y", "b c z", "", {"unchanged": "a b y", "previous_letter": "z a x", "two_ahead": "c d a"}),
    ("plural", "c i t y", "c i t i e s", "", {"always_s": "c i t y s", "always_es": "c i t y e s",
                                              "singular": "c i t y"}),
    ("plural", "d a y", "d a y s", "", {"always_es": "d a y e s", "singular": "d a y", "ies_misused": "d a i e s"}),
    ("plural", "b o x", "b o x e s", "", {"always_s": "b o x s", "singular": "b o x", "doubled_final": "b o x x e s"}),
    ("first_word", "one two three", "one", "", {"last_word": "three", "second_word": "two",
                                                "first_two_words": "one two"}),
    ("last_word", "one two three", "three", "", {"first_word": "one", "second_to_last": "two",
                                                 "last_two_words": "two three"}),
    ("reverse_words", "sea ship", "ship sea", "", {"unreversed": "sea ship"}),
    ("repeat_word", "oar", "oar oar", "", {"one_less_time": "oar", "one_more_time": "oar oar oar",
                                           "two_more_time": "oar oar oar oar"}),
    ("next_number", "0", "1", "", {"unchanged": "0", "added_two": "2", "added_ten": "10"}),
    ("count_up", "", "3 4 5", "Count from 3 to 5.", {"one_too_far": "3 4 5 6", "stopped_early": "3 4",
                                                     "started_late": "4 5", "started_early": "2 3 4 5",
                                                     "counted_down": "5 4 3", "skipped_one": "3 5"}),
])
def test_rule_mistakes_by_hand(family, given, right, instruction, expected):
    record = {"instruction": instruction or "an instruction", "input": given, "output": right, "family": family}
    mistakes = tasks.plausible_mistakes(record, random.Random(0))
    assert {name: mistakes.get(name) for name in expected} == expected


def test_no_mistake_that_is_the_right_answer():
    # A palindrome: "unreversed" would be the right answer, so it must not be offered.
    mistakes = tasks.plausible_mistakes({"instruction": "i", "input": "d i d", "output": "d i d",
                                          "family": "reverse_letters"}, random.Random(0))
    assert "unreversed" not in mistakes and "d i d" not in mistakes.values()


def test_a_family_without_mistakes_is_a_clear_error():
    with pytest.raises(ValueError, match="only 1 distinct mistakes"):  # sorted "a a a": only "a a" is wrong
        tasks.plausible_mistakes({"instruction": "i", "input": "a a a", "output": "a a a",
                                   "family": "sort_letters"}, random.Random(0))
    with pytest.raises(ValueError, match="family 'haiku' has no mistake rules"):
        tasks.plausible_mistakes({"instruction": "i", "input": "x", "output": "y", "family": "haiku"},
                                  random.Random(0))


# --------------------------------------------------------------------------- the preference pairs
def test_pairs_follow_the_records(built):
    by_prompt = {key(r): r for r in RECORDS}
    assert len(built["pairs"]) == len(RECORDS) and len({key(p) for p in built["pairs"]}) == len(RECORDS)
    for pair in built["pairs"]:
        record = by_prompt[key(pair)]
        assert pair["chosen"] == record["output"]
        assert (pair["split"], pair["family"]) == (record["split"], record["family"])
        assert normalize_answer(pair["rejected"]) != normalize_answer(pair["chosen"]) and pair["rejected"].strip()
    splits = Counter(p["split"] for p in built["pairs"])
    assert splits == Counter(r["split"] for r in RECORDS) and splits["train"] >= 1000


def test_no_test_prompt_in_training(built):
    trained = {key(p) for p in built["pairs"] if p["split"] == "train"}
    assert not trained & {key(p) for p in built["pairs"] if p["split"] in ("test", "validation")}


def test_on_policy_where_the_model_was_wrong_and_well_formed(built):
    outputs = {key(r): r for r in RECORDS}
    for pair in built["pairs"]:
        answer = built["answers"][key(pair)]
        usable = (answer["well_formed"] and answer["answer"].strip()
                  and normalize_answer(answer["answer"]) != normalize_answer(pair["chosen"]))
        if usable:
            assert pair["source"] == "on-policy" and pair["rejected"] == answer["answer"]
        else:  # a rule mistake, reproducible from the record alone
            rule = pair["source"].removeprefix("rule:")
            mistakes = tasks.plausible_mistakes(outputs[key(pair)], tasks.record_rng(0, "mistakes", pair))
            assert pair["source"].startswith("rule:") and pair["rejected"] == mistakes[rule]
    assert Counter(p["source"] == "on-policy" for p in built["pairs"]) == {True: len(RECORDS) // 4,
                                                                           False: len(RECORDS) - len(RECORDS) // 4}


@pytest.mark.slow
def test_missing_answer_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no answer to 1 of the 1560 prompts"):
        tasks.build_preference_data(RECORDS, fake_answers(RECORDS)[1:], 0)
    with pytest.raises(ValueError, match="answer 0 of the answers file: expected"):
        tasks.build_preference_data(RECORDS, [{"instruction": "x", "input": "y", "answer": 5, "well_formed": True}], 0)
    write_answers(tmp_path / "answers.json", fake_answers(RECORDS)[1:])  # the script's message, from the same check
    missing = script(*paths(tmp_path))
    assert missing.returncode == 1
    assert "error: the answers file has no answer to 1 of the 1560 prompts" in missing.stderr
    absent = script("--answers", tmp_path / "absent.json", *paths(tmp_path)[2:])
    assert absent.returncode == 1 and "absent.json: no such file" in absent.stderr
    no_run = script("--answers-from", tmp_path / "no-run")
    assert no_run.returncode == 2 and "--answers-from" in no_run.stderr
    assert not (tmp_path / "preferences.json").exists() and "Traceback" not in missing.stderr + absent.stderr


# --------------------------------------------------------------------------- --check
@pytest.mark.slow
def test_check_passes_on_a_fresh_build_and_names_the_first_difference(built, tmp_path):
    for name in ("answers.json", "preferences.json", "choices.json"):
        shutil.copy(built["folder"] / name, tmp_path / name)
    fresh = script(*paths(tmp_path), "--check")
    assert fresh.returncode == 0 and "up to date" in fresh.stdout
    pairs = json.loads((tmp_path / "preferences.json").read_text())
    pairs[5]["rejected"] = "something else"
    (tmp_path / "preferences.json").write_text(json.dumps(pairs))
    changed = script(*paths(tmp_path), "--check")
    assert changed.returncode == 1 and "record 5 differs" in changed.stderr


def test_check_passes_on_the_committed_files():
    result = script("--check")  # reads the bundled files, writes nothing
    assert result.returncode == 0 and "up to date" in result.stdout
    model = json.loads(INSTRUCTION_ANSWERS_PATH.read_text())["model"]
    assert re.fullmatch(r"[0-9a-f]{64}", model["sha256"]) and "--answers-from" in model["command"]


def test_committed_choices_do_not_depend_on_the_model(built):
    # The multiple-choice set uses rule mistakes only: fake answers give the committed file, byte for byte.
    assert (built["folder"] / "choices.json").read_text() == INSTRUCTION_CHOICES_PATH.read_text()
    assert dumps_records(built["items"]) == INSTRUCTION_CHOICES_PATH.read_text()
    assert len(json.loads(PREFERENCES_PATH.read_text())) == len(RECORDS)


# --------------------------------------------------------------------------- the multiple-choice set
def test_choice_items_hold_the_right_answer_once(built):
    tests = [r for r in RECORDS if r["split"] == "test"]
    assert len(built["items"]) == len(tests) == 312
    for item, record in zip(built["items"], tests):
        assert item["context"] == format_prompt(record) and item["family"] == record["family"]
        normalized = [normalize_answer(c) for c in item["choices"]]
        assert len(item["choices"]) == 4 and len(set(normalized)) == 4
        assert normalized.index(normalize_answer(record["output"])) == item["answer"]
        assert all(re.fullmatch(FORMATS[record["family"]], c) for c in item["choices"])


def chi_square_3_dof_tail(x: float) -> float:
    """P(X >= x) for a chi-square variable with 3 degrees of freedom (closed form)."""
    return math.erfc(math.sqrt(x / 2)) + math.sqrt(2 * x / math.pi) * math.exp(-x / 2)


def test_answer_position_is_uniform(built):
    positions = Counter(item["answer"] for item in built["items"])
    observed = np.array([positions[i] for i in range(4)])
    expected = len(built["items"]) / 4
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    # A fair draw has a p-value under 0.001 once in a thousand seeds; "always pick the first choice" then
    # scores the share of answers at position 0: 25% within 5 points (2 standard errors of 2.45 points).
    assert chi_square_3_dof_tail(chi_square) > 0.001
    assert 0.20 <= positions[0] / len(built["items"]) <= 0.30


def test_chi_square_tail():  # the closed form against two points of the table: 7.815 (5%) and 16.266 (0.1%)
    assert chi_square_3_dof_tail(7.815) == pytest.approx(0.05, abs=1e-4)
    assert chi_square_3_dof_tail(16.266) == pytest.approx(0.001, abs=1e-5)


def length_baseline(items: list[dict], rank: int) -> float:
    """Expected accuracy of picking the choice at ``rank`` when sorted by length (0: the shortest), ties
    broken at random."""
    total = 0.0
    for item in items:
        lengths = [len(c) for c in item["choices"]]
        best = [i for i, n in enumerate(lengths) if n == sorted(lengths)[rank]]
        total += (item["answer"] in best) / len(best)
    return total / len(items)


def test_length_gives_the_answer_away_to_no_simple_rule(built):
    # Off-by-one mistakes lie on both sides of the right answer (a letter more, a letter less), so picking
    # the longest or the shortest choice scores below chance (about 15% with seed 0), and a middle one above
    # it (about 35%). The bound that matters is the upper one: 40% for any rank is 6 standard errors (2.5
    # points at n=312) above chance, while choices whose right answer were the longest or the shortest would
    # score near 100%. 10% below keeps the opposite cue ("never the longest") at 30% or less.
    for rank in (0, 3):
        assert 0.10 <= length_baseline(built["items"], rank) <= 0.35
    for rank in (1, 2):
        assert length_baseline(built["items"], rank) <= 0.40


def test_random_guessing_scores_a_quarter(built):
    answers = np.array([item["answer"] for item in built["items"]])
    guesses = np.random.default_rng(0).integers(0, 4, size=(400, len(answers)))  # 400 guessers
    # The mean of 400 x 312 fair guesses has a standard error of 0.0012: 0.24-0.26 is 8 of them.
    assert 0.24 <= (guesses == answers).mean() <= 0.26


# --------------------------------------------------------------------------- answers made by a model
@pytest.mark.timeout(120)
@pytest.mark.slow
def test_answers_from_a_model(tmp_path):
    text = read_moby_dick()[:8_000]
    tokenizer = BPETokenizer.train(text, 300, special_tokens=["<|endoftext|>"])
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, context_length=512, d_model=16, n_layers=1, n_heads=2))
    run = tmp_path / "run"
    run.mkdir()
    export_model(model, run / "model.safetensors", tokenizer)
    per_family = {}
    for record in RECORDS:  # one record per family and split: 39 prompts
        per_family.setdefault((record["family"], record["split"]), record)
    records = list(per_family.values())
    (tmp_path / "instructions.json").write_text(json.dumps(records))
    made = script("--answers-from", run, "--instructions", tmp_path / "instructions.json", *paths(tmp_path),
                  "--no-progress")
    assert made.returncode == 0, made.stderr[-4000:]
    assert f"wrote 39 answers to {tmp_path / 'answers.json'}: " in made.stdout
    answers = json.loads((tmp_path / "answers.json").read_text())
    assert answers["model"]["sha256"] == hashlib.sha256((run / "model.safetensors").read_bytes()).hexdigest()
    assert [key(a) for a in answers["answers"]] == [key(r) for r in records]
    pairs = json.loads((tmp_path / "preferences.json").read_text())
    assert [p["chosen"] for p in pairs] == [r["output"] for r in records]
    checked = script("--instructions", tmp_path / "instructions.json", *paths(tmp_path), "--check")
    assert checked.returncode == 0 and "up to date" in checked.stdout
