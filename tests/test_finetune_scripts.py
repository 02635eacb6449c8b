"""The chapter 5 scripts end to end in --test-mode, on a tiny checkpoint written by llmscratch.training.train."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from processes import run as run_process  # noqa: E402

from llmscratch.assets import INSTRUCTIONS_PATH, PRETRAINED_PATH, read_moby_dick  # noqa: E402
from llmscratch.finetuning.classify import Classifier  # noqa: E402
from llmscratch.finetuning.finetune import load_base  # noqa: E402
from llmscratch.finetuning.lora import load_adapters, lora_layers  # noqa: E402
from llmscratch.model.checkpoint import export_model, model_from_checkpoint  # noqa: E402
from llmscratch.model.config import GPTConfig  # noqa: E402
from llmscratch.model.gpt import GPT
from llmscratch.model.weights import save_hf  # noqa: E402
from llmscratch.text.tokenizer import BPETokenizer  # noqa: E402
from llmscratch.training.config import TrainConfig  # noqa: E402
from llmscratch.training.train import Trainer

CHAPTER = Path(__file__).resolve().parents[1] / "ch05-finetuning"


def script(name: str, *argv, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """The chapter script ``name`` run as a user runs it, in a fresh interpreter (``env``: more variables)."""
    return run_process([sys.executable, str(CHAPTER / f"{name}.py"), *map(str, argv)], timeout=timeout,
                       env={**os.environ, **env})


def succeeds(name: str, *argv) -> str:
    """The standard output of a run of ``name`` that must succeed."""
    result = script(name, *argv)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """checkpoint.pt of a two-step pretraining run of a tiny Llama-style model (and its export)."""
    folder = tmp_path_factory.mktemp("pretrain")
    text = read_moby_dick()[:30_000]
    tokenizer = BPETokenizer.train(text, 384, special_tokens=["<|endoftext|>"])
    tokens = np.array(tokenizer.encode(text), dtype=np.uint16)
    config = GPTConfig.from_preset("llama-tiny", vocab_size=tokenizer.vocab_size, context_length=256, d_model=32,
                                   n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64)
    train = TrainConfig(max_steps=2, batch_size=2, warmup_steps=1, eval_interval=2, checkpoint_interval=2,
                        sample_interval=2, sample_tokens=4, log_interval=1)
    trainer = Trainer(GPT(config), train, tokens[:-600], tokens[-600:], folder, tokenizer)
    trainer.fit(progress=False)
    export_model(trainer.model, folder / "model.safetensors", tokenizer)  # as ch04's pretrain.py does
    return folder / "checkpoint.pt"


@pytest.mark.slow
def test_classifier_script_in_test_mode(checkpoint, tmp_path):
    out = tmp_path / "run"
    succeeds("finetune_classifier", "--base", checkpoint, "--out-dir", out, "--test-mode", "--no-progress")
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("accuracy", "precision", "recall", "f1"):
        assert 0.0 <= metrics["test"][key] <= 1.0 and 0.0 <= metrics["test_before"][key] <= 1.0
    assert sum(map(sum, metrics["test"]["confusion"])) == 16
    assert [r["epoch"] for r in metrics["history"]] == [0, 1]
    assert (out / "training.png").stat().st_size > 1000
    classifier = Classifier.load(out / "classifier.pt")
    assert classifier.classify("Free entry! Text WIN to 80086 now") in ("ham", "spam")


@pytest.mark.slow
def test_classifier_script_with_lora(checkpoint, tmp_path):
    out = tmp_path / "run"
    succeeds("finetune_classifier", "--base", checkpoint, "--out-dir", out, "--test-mode", "--no-progress", "--lora",
             "--lora-rank", "2")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["trainable"] == "lora" and metrics["config"]["lora"]["rank"] == 2
    base, _ = load_base(checkpoint)
    assert load_adapters(base, out / "adapters.safetensors") == sorted(lora_layers(base))
    # Per block, rank 2 on qkv (32 -> 64), out_proj (32 -> 32) and three SwiGLU layers (32 <-> 64);
    # two blocks, plus the 2-class head.
    assert metrics["trainable_parameters"] == 2 * 2 * (96 + 64 + 3 * 96) + 2 * 32 + 2


@pytest.mark.slow
def test_classifier_script_from_a_gpt2_folder(tmp_path):
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=50257, context_length=64, d_model=8, n_layers=1, n_heads=2)), tmp_path / "hf")
    succeeds("finetune_classifier", "--base", tmp_path / "hf", "--out-dir", tmp_path / "run", "--test-mode",
             "--no-progress", "--trainable", "head")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["trainable_parameters"] == 2 * 8 + 2 and metrics["max_length"] == 32


@pytest.mark.slow
def test_instruction_script_in_test_mode(checkpoint, tmp_path):
    out = tmp_path / "run"
    export = checkpoint.with_name("model.safetensors")
    shown = succeeds("finetune_instructions", "--base", export, "--out-dir", out, "--test-mode", "--no-progress",
                     "--lora", "--replay-length", "300")
    assert "replaying windows of 256 tokens, the model's context length (--replay-length 300)" in shown
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["replay"] == {"windows": 2, "length": 256}  # the default: 2 windows in every batch
    for model in ("base", "finetuned"):
        assert 0.0 <= metrics[model]["exact_match"] <= 1.0 and metrics[model]["response_loss"] > 0
        assert len(metrics[model]["by_family"]) == 13
    assert metrics["mask_prompt"] is True
    assert "| held-out response loss |" in (out / "comparison.md").read_text()
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 13 and {"base", "finetuned", "output"} <= set(answers[0])
    finetuned = model_from_checkpoint(out / "model.safetensors")  # merged: a plain GPT again
    assert not lora_layers(finetuned)
    assert (out / "adapters.safetensors").is_file()


@pytest.mark.parametrize("name", ["finetune_classifier", "finetune_instructions"])
@pytest.mark.slow
def test_help_and_bad_input_are_clear(name, tmp_path):
    shown = script(name, "--help", COLUMNS="1000")  # one line per flag
    assert shown.returncode == 0
    help_text = shown.stdout
    assert "--lora-rank" in help_text and "--test-mode" in help_text and "--out-dir" in help_text
    assert f"(default: {PRETRAINED_PATH})" in next(line for line in help_text.splitlines() if "--base BASE " in line)
    nothing = script(name, "--base", tmp_path / "nothing.pt")
    assert nothing.returncode == 2 and "no such file or folder" in nothing.stderr
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    result = script(name, "--base", junk, "--out-dir", tmp_path / "run")  # a message, not a traceback
    assert result.returncode == 1 and re.match(r"error: .*junk.pt is not a readable llmscratch checkpoint",
                                               result.stderr)
    assert "Traceback" not in result.stderr


def test_instruction_script_names_a_malformed_record(checkpoint, tmp_path):
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"instruction": "a", "input": "", "output": "b", "split": "train"},
                                {"instruction": "a", "input": "", "split": "test"}]))
    result = script("finetune_instructions", "--base", checkpoint, "--data", data, "--out-dir", tmp_path / "run")
    assert result.returncode == 1 and "record 1: field 'output' is missing" in result.stderr


@pytest.mark.slow
def test_instruction_data_is_reproduced_by_its_script(tmp_path):
    assert "is up to date" in succeeds("make_instruction_data", "--check")  # the committed file is what it writes
    succeeds("make_instruction_data", "--out", tmp_path / "other.json", "--seed", "1")
    assert (tmp_path / "other.json").read_text() != INSTRUCTIONS_PATH.read_text()


@pytest.mark.slow
def test_the_default_base_is_the_bundled_pretrained_model(tmp_path):
    # (Both scripts show it as --base's default: test_help_and_bad_input_are_clear.)
    out = tmp_path / "run"
    succeeds("finetune_classifier", "--out-dir", out, "--test-mode", "--no-progress")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["base"] == str(PRETRAINED_PATH)
    assert Classifier.load(out / "classifier.pt").model.gpt.config == load_base(PRETRAINED_PATH)[0].config
