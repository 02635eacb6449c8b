"""ch06-alignment/finetune_preferences.py end to end in --test-mode, on a tiny model, checked against float64 sums."""

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import run as run_process

from llmscratch.alignment import tasks
from llmscratch.alignment.config import DPOConfig
from llmscratch.alignment.dpo import pair_batches, read_pairs, train_dpo
from llmscratch.alignment.preference import ReferenceModel
from llmscratch.assets import INSTRUCTIONS_PATH, read_instructions
from llmscratch.finetuning.finetune import load_base, set_trainable
from llmscratch.finetuning.instruct import format_prompt, normalize_answer
from llmscratch.finetuning.lora import adapters_disabled, lora_layers
from llmscratch.model.checkpoint import export_model, model_from_checkpoint
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.text.tokenizer import BPETokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "ch06-alignment" / "finetune_preferences.py"
D_MODEL, D_FF, N_LAYERS, N_HEADS, N_KV_HEADS = 32, 64, 2, 2, 1
pytestmark = pytest.mark.timeout(120)


def script(*argv, cwd: Path | None = None, timeout: float = 100) -> subprocess.CompletedProcess:
    """The script run as a user runs it, in a fresh interpreter."""
    return run_process([sys.executable, str(SCRIPT), *map(str, argv)], timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    """A tiny random Llama-style model with a BPE tokenizer learned from the instruction prompts, exported."""
    records = read_instructions()
    text = "\n".join(format_prompt(r) + r["output"] for r in records[::10])
    tokenizer = BPETokenizer.train(text, 400, special_tokens=["<|endoftext|>"])
    torch.manual_seed(0)
    config = GPTConfig.from_preset("llama-tiny", vocab_size=tokenizer.vocab_size, context_length=160, d_model=D_MODEL,
                                   n_layers=N_LAYERS, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, d_ff=D_FF)
    path = tmp_path_factory.mktemp("instruction_model") / "model.safetensors"
    export_model(GPT(config), path, tokenizer)
    return path


@pytest.fixture(scope="module")
def pairs_path(tmp_path_factory) -> Path:
    """Preference pairs from the instruction records: the right output is chosen, its reversed letters rejected."""
    pairs = [{"instruction": r["instruction"], "input": r["input"], "chosen": r["output"],
              "rejected": r["output"][::-1] + "!", "family": r["family"], "split": r["split"], "source": "test"}
             for r in read_instructions()]
    path = tmp_path_factory.mktemp("pairs") / "pairs.json"
    path.write_text(json.dumps(pairs))
    return path


def run_script(model_path: Path | None, pairs_path: Path, out: Path, *flags: str, cwd: Path | None = None) -> dict:
    """metrics.json of a --test-mode run from ``model_path`` (None: the default --model)."""
    model = [] if model_path is None else ["--model", model_path]
    result = script(*model, "--data", pairs_path, "--out-dir", out, "--test-mode", "--no-progress", "--lr", "1e-3",
                    *flags, cwd=cwd)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"saved {out}/: metrics.json, dpo.png, comparison.md, answers.jsonl, model.safetensors" in result.stdout
    return {**json.loads((out / "metrics.json").read_text()), "stdout": result.stdout}


def logprob64(model: GPT, tokenizer, record: dict, response: str) -> float:
    """log p(response + <|endoftext|> | prompt) of one unpadded row, summed in float64."""
    prompt = tokenizer.encode(format_prompt(record), disallowed_special=())
    answer = tokenizer.encode(response, disallowed_special=()) + [tokenizer.eot_token]
    ids = torch.tensor([prompt + answer])  # (1, T)
    model64 = model.double().eval()
    with torch.no_grad():
        logp = torch.log_softmax(model64(ids[:, :-1])[0], dim=-1)  # (T - 1, V)
    rows = torch.arange(len(prompt) - 1, ids.size(1) - 1)
    return logp[rows, ids[0, len(prompt):]].sum().item()


@pytest.mark.slow
def test_full_finetuning_in_test_mode_from_the_default_model(model_path, pairs_path, tmp_path):
    (tmp_path / "runs" / "instructions").mkdir(parents=True)  # the default --model, there: used, not trained again
    shutil.copy(model_path, tmp_path / "runs" / "instructions" / "model.safetensors")
    out = tmp_path / "run"
    metrics = run_script(None, pairs_path, out, cwd=tmp_path)
    assert metrics["starting_model"] == "runs/instructions/model.safetensors"
    assert "does not exist" not in metrics["stdout"] and not (out / "instructions").exists()
    for name in ("metrics.json", "comparison.md", "answers.jsonl", "model.safetensors"):
        assert (out / name).is_file()
    assert (out / "dpo.png").stat().st_size > 5000
    assert {"instruction_model", "dpo", "history", "steps", "config", "seconds"} <= set(metrics)
    assert metrics["config"]["trainable"] == "all" and metrics["config"]["beta"] == 0.1
    # Before training the policy is its reference: every margin is 0, the loss log 2, no pair won.
    start = metrics["instruction_model"]["pairs"]
    assert start["accuracy"] == 0.0 and start["margin"] == 0.0 and start["loss"] == pytest.approx(math.log(2))
    assert metrics["steps"][0]["loss"] == pytest.approx(math.log(2))
    assert [s["step"] for s in metrics["steps"]] == list(range(1, 5))  # 26 pairs in batches of 8
    assert [r["epoch"] for r in metrics["history"]] == [0, 1]

    # Exact match and well-formed shares, recounted from the answers written.
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 13
    for model, text in (("instruction_model", "instruction_model"), ("dpo", "dpo")):
        hits = [normalize_answer(a[text]) == normalize_answer(a["output"]) for a in answers]
        assert metrics[model]["exact_match"] == pytest.approx(sum(hits) / len(hits))
    assert metrics["dpo"]["well_formed"] == pytest.approx(sum(a["dpo_well_formed"] for a in answers) / 13)
    assert "| **all families** |" in (out / "comparison.md").read_text()

    # The held-out preference scores, recomputed pair by pair in float64 from the two saved models.
    start_model, tokenizer = load_base(model_path)
    tuned = model_from_checkpoint(out / "model.safetensors")
    test_pairs = read_pairs(pairs_path, test_mode=True)["test"]
    margins = []
    for record in test_pairs:
        rewards = [0.1 * (logprob64(tuned, tokenizer, record, record[k]) - logprob64(start_model, tokenizer, record,
                                                                                       record[k]))
                   for k in ("chosen", "rejected")]
        margins.append(rewards[0] - rewards[1])
    pairs = metrics["dpo"]["pairs"]
    assert pairs["margin"] == pytest.approx(sum(margins) / len(margins), rel=1e-3, abs=1e-5)
    assert pairs["loss"] == pytest.approx(sum(-math.log(1 / (1 + math.exp(-m))) for m in margins) / len(margins),
                                          rel=1e-4)
    assert pairs["accuracy"] == sum(m > 0 for m in margins) / len(margins)


@pytest.mark.slow
def test_lora_in_test_mode_trains_only_the_adapters(model_path, pairs_path, tmp_path):
    out = tmp_path / "run"
    metrics = run_script(model_path, pairs_path, out, "--lora", "--lora-rank", "2")
    assert metrics["config"]["trainable"] == "lora" and metrics["config"]["lora"]["rank"] == 2
    # Per block, rank 2 on qkv (32 -> 32 + 2 x 16), out_proj (32 -> 32) and three SwiGLU layers (32 <-> 64);
    # the head stays frozen, so that the model with its adapters off is the starting model.
    qkv, out_proj, mlp = 2 * (D_MODEL + 2 * D_MODEL), 2 * (D_MODEL + D_MODEL), 3 * 2 * (D_MODEL + D_FF)
    assert metrics["trainable_parameters"] == N_LAYERS * (qkv + out_proj + mlp)
    assert (out / "adapters.safetensors").is_file()
    tuned = model_from_checkpoint(out / "model.safetensors")  # merged: a plain GPT again
    assert not lora_layers(tuned)
    assert metrics["dpo"]["pairs"]["margin"] != 0.0


@pytest.mark.slow
def test_the_sft_term_adds_the_chosen_answers_loss(model_path, pairs_path, tmp_path):
    metrics = run_script(model_path, pairs_path, tmp_path / "run", "--sft-weight", "0.5")
    assert metrics["config"]["sft_weight"] == 0.5
    first = metrics["steps"][0]
    assert first["dpo_loss"] == pytest.approx(math.log(2))
    # A random model of vocabulary V starts near log V nats per token on any answer.
    assert first["sft_loss"] == pytest.approx(math.log(400), rel=0.1)
    for step in metrics["steps"]:
        assert step["loss"] == pytest.approx(step["dpo_loss"] + 0.5 * step["sft_loss"], rel=1e-6)


@pytest.mark.parametrize("trainable", ["all", "lora"])
@pytest.mark.slow
def test_training_leaves_the_reference_as_it_started(model_path, pairs_path, trainable):
    # The script's defaults with --test-mode --trainable {trainable} --lr 1e-2.
    config = DPOConfig(epochs=1, batch_size=8, lr=1e-2, beta=0.1, trainable=trainable)
    model, tokenizer = load_base(model_path)
    start = {name: p.detach().clone() for name, p in model.state_dict().items()}
    set_trainable(model, config, always=[] if trainable == "lora" else [model.lm_head])
    reference = ReferenceModel(model)
    batches = pair_batches(read_pairs(pairs_path, True), tokenizer, reference, config, 160)
    train_dpo(model, batches, config, torch.device("cpu"), progress=False, steps=[])
    if trainable == "lora":  # the reference is the policy with its adapters off: the base weights are untouched
        with adapters_disabled(model):
            base = {name.replace(".base.", "."): p for name, p in model.state_dict().items() if "lora_" not in name}
    else:
        assert reference.model is not model
        base = reference.model.state_dict()
        assert any(not torch.equal(p, start[name]) for name, p in model.state_dict().items())
    assert base.keys() == start.keys()
    assert all(torch.equal(base[name], start[name]) for name in start)


@pytest.mark.slow
def test_a_missing_default_model_is_trained_by_chapter_5_and_its_failure_named(tmp_path, pairs_path):
    # runs/instructions is a file here, so chapter 5's script, asked to train the default model into that
    # folder, refuses its --out-dir (status 2): what the flags it gets are, and what its failure is, is printed.
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "instructions").write_text("not a folder")
    shutil.copy(INSTRUCTIONS_PATH, tmp_path / "data.json")
    result = script("--data", pairs_path, "--instructions", "data.json", "--out-dir", tmp_path / "run",
                    "--no-progress", cwd=tmp_path)
    assert ("runs/instructions/model.safetensors does not exist: training it with "
            "ch05-finetuning/finetune_instructions.py --out-dir runs/instructions first") in result.stdout
    assert "--out-dir runs/instructions" in result.stderr  # chapter 5's own message
    assert result.returncode == 1
    assert ("error: finetune_instructions.py --out-dir runs/instructions --data data.json --no-progress failed (exit "
            "status 2), so there is no model to start from") in result.stderr


def test_help_names_the_flags():
    result = script("--help")
    assert result.returncode == 0
    help_text = result.stdout
    for name in ("--beta", "--label-smoothing", "--sft-weight", "--lora-rank", "--test-mode", "--out-dir", "--model",
                 "--data"):
        assert name in help_text


@pytest.mark.parametrize("flags, message", [
    (("--data", "none.json"), "--data .*none.json: no such file"),
    (("--model", "none.safetensors"), "--model .*none.safetensors: no such file"),
    (("--beta", "0"), "--beta must be positive, got 0.0"),
    (("--label-smoothing", "0.5"), r"--label-smoothing must be in \[0, 0.5\), got 0.5"),
    (("--sft-weight", "-1"), r"--sft-weight must be >= 0, got -1.0"),
    (("--lr", "nan"), "argument --lr: 'nan' is not a finite number"),
])
def test_bad_flags_are_clear(model_path, pairs_path, tmp_path, flags, message):
    common = ["--model", str(model_path), "--data", str(pairs_path), "--out-dir", str(tmp_path / "run")]
    result = script(*common, *flags, cwd=tmp_path)  # (a relative path: in tmp_path)
    assert result.returncode == 2
    assert re.search(message, result.stderr)
    assert not (tmp_path / "run").exists()


def test_a_malformed_pair_is_named(model_path, tmp_path):
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps([{"instruction": "a", "input": "", "chosen": "b", "rejected": "c", "split": "train"},
                                {"instruction": "a", "input": "", "chosen": "b", "split": "test"}]))
    result = script("--model", model_path, "--data", data, "--out-dir", tmp_path / "run")
    assert result.returncode == 1 and "record 1: field 'rejected' is missing" in result.stderr


def test_style_pairs_prefer_the_right_answer_in_the_style_and_dpo_learns_them(model_path, tmp_path):
    records = read_instructions()
    pairs = tasks.style_pairs(records, "full-stop")
    assert len(pairs) == len(records)
    for pair, record in zip(pairs, records):
        assert (pair["chosen"], pair["rejected"], pair["split"]) == (record["output"] + ".", record["output"],
                                                                     record["split"])
        assert normalize_answer(pair["chosen"]) == normalize_answer(record["output"])  # exact match ignores it
    with pytest.raises(ValueError, match="unknown style 'shouting'; expected one of \\['full-stop'\\]"):
        tasks.style_pairs(records, "shouting")
    out = tmp_path / "style"
    result = script("--model", model_path, "--style", "full-stop", "--out-dir", out, "--test-mode", "--no-progress",
                    "--lr", "1e-3")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["data"] == "style:full-stop"
    assert metrics["pairs_per_split"]["train"] == 26  # the instruction records' test-mode train split
