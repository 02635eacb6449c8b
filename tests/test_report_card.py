"""ch06-alignment/evaluate.py end to end in --test-mode: the bundled base model beside a tiny spam classifier."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from llmscratch.assets import (
    MOBY_CLOZE_PATH,
    PRETRAINED_PATH,
    read_instructions,
    read_moby_dick,
)
from llmscratch.checkpoint import model_from_checkpoint, tokenizer_from_checkpoint
from llmscratch.classify import SPAM_LABELS, Classifier, GPTClassifier, spam_splits
from llmscratch.evaluation import evaluate, multiple_choice_accuracy, token_byte_lengths
from llmscratch.instruct import format_prompt
from llmscratch.model import GPT, GPTConfig
from llmscratch.tokenizer import BPETokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "ch06-alignment" / "evaluate.py"
TESTS = [r for r in read_instructions() if r["split"] == "test"]
# The instruction multiple-choice format (context = the prompt, up to "### Response:\n"), on made-up wrong answers.
FAKE_CHOICES = [{"context": format_prompt(r), "choices": [r["output"] + " x", "a b", r["output"], "7"], "answer": 2,
                 "family": r["family"]} for r in TESTS[::100]]


def load_script():
    spec = importlib.util.spec_from_file_location("evaluate_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


evaluate_script = load_script()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One --test-mode report card: the bundled base model and a tiny untrained spam classifier."""
    folder = tmp_path_factory.mktemp("report")
    tokenizer = BPETokenizer.train(read_moby_dick()[:8_000], 300, special_tokens=["<|endoftext|>"])
    config = GPTConfig.from_preset("llama-tiny", vocab_size=tokenizer.vocab_size, context_length=64, d_model=32,
                                   n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    torch.manual_seed(0)
    classifier = Classifier(GPTClassifier(GPT(config), len(SPAM_LABELS)), tokenizer, SPAM_LABELS,
                            tokenizer.eot_token, max_length=32)
    (folder / "spam").mkdir()
    classifier.save(folder / "spam" / "classifier.pt")
    choices = folder / "choices.json"
    choices.write_text(json.dumps(FAKE_CHOICES), encoding="utf-8")
    evaluate_script.main(["--test-mode", "--no-progress", "--out-dir", str(folder / "out"), "--choices", str(choices),
                          "--model", "base", "--model", str(folder / "spam")])
    return folder


def test_files_written_and_numbers_in_range(run):
    out = run / "out"
    assert (out / "report.md").is_file() and (out / "report.png").stat().st_size > 10_000
    report = json.loads((out / "report.json").read_text())
    assert list(report["models"]) == ["base", "spam"]
    base = report["models"]["base"]["scores"]
    assert 0.5 < base["bits_per_byte"]["value"] < 8  # a trained model: far below 8 bits, above the text's entropy
    for key, score in base.items():
        if score is not None and key != "bits_per_byte":
            assert 0.0 <= score["value"] <= 1.0, key
            if score["interval"] is not None:
                low, high = score["interval"]
                assert low <= score["value"] <= high, key
    assert base["cloze_accuracy"]["n"] == evaluate_script.TEST_MODE_ITEMS
    assert base["choices_accuracy"]["n"] == len(FAKE_CHOICES)
    assert base["exact_match"]["n"] == evaluate_script.TEST_MODE_ITEMS


def test_a_benchmark_that_does_not_apply_shows_a_dash(run):
    lines = (run / "out" / "report.md").read_text().splitlines()

    def cells(label: str) -> list[str]:
        row = next(line for line in lines if line.startswith(f"| {label} |"))
        return [cell.strip() for cell in row.strip("|").split("|")][1:]

    base_spam, spam_spam = cells("spam accuracy")
    assert base_spam == "-" and spam_spam.endswith("]") and "%" in spam_spam
    assert cells("Moby-Dick cloze")[1] == "-" and cells("Moby-Dick cloze")[0] != "-"
    scores = json.loads((run / "out" / "report.json").read_text())["models"]
    assert scores["base"]["scores"]["spam_f1"] is None and scores["spam"]["scores"]["bits_per_byte"] is None


def test_numbers_equal_direct_calls_of_the_metrics(run):
    scores = json.loads((run / "out" / "report.json").read_text())["models"]
    model, tokenizer = model_from_checkpoint(PRETRAINED_PATH), tokenizer_from_checkpoint(PRETRAINED_PATH)
    text = read_moby_dick()
    held_out = text[int(len(text) * 0.9):]  # pretrain.py's split, written out here
    tokens = np.array(tokenizer.encode(held_out), dtype=np.int64)
    direct = evaluate(model, tokens, token_byte_lengths(tokenizer, model.config.vocab_size), 16,
                      torch.device("cpu"), max_tokens=2 * model.config.context_length + 1)
    assert scores["base"]["scores"]["bits_per_byte"]["value"] == pytest.approx(direct["bits_per_byte"], rel=1e-9)
    cloze = json.loads(MOBY_CLOZE_PATH.read_text(encoding="utf-8"))[: evaluate_script.TEST_MODE_ITEMS]
    direct = multiple_choice_accuracy(model, tokenizer, cloze)
    assert scores["base"]["scores"]["cloze_accuracy"]["value"] == pytest.approx(direct["accuracy"], abs=1e-12)
    assert scores["base"]["scores"]["cloze_accuracy_norm"]["value"] == pytest.approx(direct["accuracy_norm"], abs=1e-12)
    direct = multiple_choice_accuracy(model, tokenizer, FAKE_CHOICES, delimiter="")  # the answer follows "\n"
    assert scores["base"]["scores"]["choices_accuracy"]["value"] == pytest.approx(direct["accuracy"], abs=1e-12)
    # The spam accuracy by classifying each test message alone, counted here.
    classifier = Classifier.load(run / "spam" / "classifier.pt")
    messages = spam_splits(seed=123)["test"][: evaluate_script.TEST_MODE_ITEMS]
    hits = sum(classifier.classify(text) == SPAM_LABELS[label] for text, label in messages)
    assert scores["spam"]["scores"]["spam_accuracy"]["value"] == pytest.approx(hits / len(messages), abs=1e-12)


def test_instruction_rows_cover_the_test_records(run):
    report = json.loads((run / "out" / "report.json").read_text())
    families = {key.split("/", 1)[1] for key in report["models"]["base"]["scores"] if key.startswith("exact_match/")}
    assert families <= {r["family"] for r in TESTS} and len(families) >= 4


def test_a_bad_model_path_exits_2_naming_it(tmp_path, capsys):
    missing = tmp_path / "no-such-model.safetensors"
    with pytest.raises(SystemExit) as exit_info:
        evaluate_script.parse_args(["--model", str(missing)])
    assert exit_info.value.code == 2 and str(missing) in capsys.readouterr().err


def test_a_missing_default_model_names_the_command_that_makes_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no runs/ here
    with pytest.raises(SystemExit) as exit_info:
        evaluate_script.parse_args(["--model", "dpo"])
    assert exit_info.value.code == 2 and "finetune_preferences.py" in capsys.readouterr().err


def test_bad_flags_exit_2(tmp_path, capsys):
    for argv, words in ((["--limit", "0"], "--limit"), (["--cloze", str(tmp_path / "none.json")], "--cloze"),
                        (["--model", "base", "--model", f"base={PRETRAINED_PATH}"], "share a name"),
                        (["--device", "toaster"], "--device: device 'toaster' is not a device name")):
        with pytest.raises(SystemExit) as exit_info:
            evaluate_script.parse_args(argv)
        assert exit_info.value.code == 2 and words in capsys.readouterr().err
