"""ch04-pretraining/pretrain.py: a tiny run end to end, SIGKILL then --resume, and its bad-input errors."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import start_until_lines
from scripts import run_script
from tiny_training import PRETRAIN, PRETRAIN_FLAGS, TEXT, pretrain_with_hook

from llmscratch.model.checkpoint import load_checkpoint, model_from_checkpoint, tokenizer_from_checkpoint
from llmscratch.text.corpus import prepare_token_files
from llmscratch.text.tokenizer import BPETokenizer


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.mark.slow
def test_a_tiny_run_leaves_a_complete_run_folder_and_resumes(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert run_script("pretrain", ["--data", str(text_file), "--out-dir", str(out), "--max-steps", "4",
                                   *PRETRAIN_FLAGS]) == 0
    printed = capsys.readouterr().out
    assert "done in" in printed and "bits per byte" in printed
    for name in ("checkpoint.pt", "model.safetensors", "tokenizer.llmscratch.json", "run.json", "metrics.jsonl",
                 "loss.png", "summary.json", "sample.txt"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and 0 < summary["val_bits_per_byte"] < 10
    assert (out / "sample.txt").read_text().startswith("Call me")
    # The export is what finetuning starts from: the weights, their config and the tokenizer.
    exported = model_from_checkpoint(out / "model.safetensors")
    trained = model_from_checkpoint(out / "checkpoint.pt")
    for a, b in zip(exported.parameters(), trained.parameters()):
        assert torch.equal(a, b)
    assert tokenizer_from_checkpoint(out / "model.safetensors").to_json() == BPETokenizer.load(
        out / "tokenizer.llmscratch.json").to_json()
    # --resume needs no other flags: the run's own are read back; a larger --max-steps extends it.
    assert run_script("pretrain", ["--out-dir", str(out), "--resume", "--max-steps", "6"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 6
    assert json.loads((out / "run.json").read_text())["max_steps"] == 6
    # A finished run is not silently overwritten.
    assert run_script("pretrain", ["--data", str(text_file), "--out-dir", str(out), *PRETRAIN_FLAGS]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert run_script("pretrain", ["--data", str(text_file), "--out-dir", str(out), "--max-steps", "2", "--overwrite",
                                   *PRETRAIN_FLAGS]) == 0
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 2


@pytest.mark.slow
def test_a_run_from_before_the_mlp_flag_resumes_with_its_presets_mlp(tmp_path, text_file):
    out = tmp_path / "run"
    assert run_script("pretrain", ["--data", str(text_file), "--out-dir", str(out), "--max-steps", "2", "--mlp",
                                   "preset", *PRETRAIN_FLAGS]) == 0
    flags = json.loads((out / "run.json").read_text())
    del flags["mlp"]  # run.json as the script wrote it before issue 18 added --mlp (default relu2)
    (out / "run.json").write_text(json.dumps(flags))
    assert run_script("pretrain", ["--out-dir", str(out), "--resume", "--max-steps", "3"]) == 0
    resumed = model_from_checkpoint(out / "checkpoint.pt")
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 3 and resumed.config.mlp == "swiglu"


@pytest.mark.slow
def test_a_run_killed_with_sigkill_resumes_to_the_same_losses(tmp_path, text_file):
    """Bitwise on CPU in float32: the same per-step losses as a run that was never interrupted."""
    def command(out_dir, *extra):
        return [sys.executable, str(PRETRAIN), "--data", str(text_file), "--out-dir", str(out_dir), "--max-steps",
                "300", "--checkpoint-interval", "5", "--eval-interval", "1000", "--sample-interval", "1000",
                *PRETRAIN_FLAGS, *extra]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same threads in every run: the same float sums
    metrics = tmp_path / "killed" / "metrics.jsonl"
    run = start_until_lines(command(tmp_path / "killed"), metrics, lines=7, timeout=300, env=env)
    assert run.poll() is None, f"the run ended before it could be killed: {run.stderr.read()}"
    run.send_signal(signal.SIGKILL)
    run.wait(timeout=60)
    killed_at = metrics.read_text().count("\n")
    assert 7 <= killed_at < 300 and load_checkpoint(tmp_path / "killed" / "checkpoint.pt")["step"] >= 5

    resumed = subprocess.run(command(tmp_path / "killed", "--resume"), env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    uninterrupted = subprocess.run(command(tmp_path / "straight"), env=env, capture_output=True, text=True,
                                   timeout=600)
    assert uninterrupted.returncode == 0, uninterrupted.stderr

    def losses(folder):
        return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]

    assert len(losses(tmp_path / "straight")) == 300
    assert losses(tmp_path / "killed") == losses(tmp_path / "straight")  # exact float equality
    assert (json.loads((tmp_path / "killed" / "summary.json").read_text())["val_loss"]
            == json.loads((tmp_path / "straight" / "summary.json").read_text())["val_loss"])


# The error line names the flag and the value given (and the bound it broke, where the rule has one).
@pytest.mark.parametrize(("flags", "bound"), [
    (["--data", "no/such/file.txt"], None),
    (["--max-steps", "0"], None),
    (["--batch-size", "-2"], None),
    (["--lr", "-1"], None),
    (["--lr", "0"], None),
    (["--val-fraction", "1.5"], None),
    (["--dtype", "float8"], None),
    (["--preset", "gpt5"], None),
    (["--max-steps", "ten"], None),
    (["--device", "cuda:99"], None),
    (["--device", "toaster"], None),
    (["--tokenizer", "bpe:10"], "257"),
    (["--tokenizer", "missing.json"], None),
    (["--context-length", "1"], "2"),
    (["--time-budget", "0"], None),
    (["--peak-tflops", "0"], None),
    (["--min-lr", "0.1"], "lr=0.002"),
    (["--final-eval-tokens", "0"], None),
])
def test_bad_flags_stop_before_training_with_a_clear_message(tmp_path, text_file, capsys, flags, bound):
    assert run_script("pretrain", ["--data", str(text_file), "--out-dir", str(tmp_path / "run"), *PRETRAIN_FLAGS,
                                   *flags]) == 2
    error = capsys.readouterr().err.splitlines()[-1]  # (after argparse's usage, which names every flag)
    assert "error: " in error and all(part in error for part in flags), error
    assert bound is None or bound in error, error
    assert not (tmp_path / "run").exists()  # nothing was written


def test_bad_paths_and_data_stop_before_training(tmp_path, text_file, capsys):
    def fails(flags, message, code=2):
        assert run_script("pretrain", flags) == code
        assert message in capsys.readouterr().err
        assert not (tmp_path / "run" / "checkpoint.pt").exists()

    run = ["--out-dir", str(tmp_path / "run"), *PRETRAIN_FLAGS]
    fails(["--resume", *run], "holds no checkpoint to resume from")
    (tmp_path / "file").write_text("x")
    fails(["--data", str(text_file), "--out-dir", str(tmp_path / "file")], "is a file, not a folder")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1") * 100)
    fails(["--data", str(tmp_path / "latin1.txt"), *run], "is not UTF-8 text")
    (tmp_path / "short.txt").write_text("Call me Ishmael. " * 20)
    fails(["--data", str(tmp_path / "short.txt"), *run, "--context-length", "64"],
          "the validation split has")
    fails(["--data", str(text_file), *run, "--dropout", "1.0"], "dropout must be in [0, 1)")
    # A folder of token files: its tokenizer must be named when it is not GPT-2's, and must match.
    tokenizer = BPETokenizer.train(TEXT, 300, special_tokens=["<|endoftext|>"])
    prepare_token_files(text_file, tmp_path / "tokens", tokenizer)
    fails(["--data", str(tmp_path / "tokens"), *run[:2]], "pass its JSON file with --tokenizer")
    BPETokenizer.train(TEXT, 400).save(tmp_path / "other.json")
    fails(["--data", str(tmp_path / "tokens"), *run[:2], "--tokenizer", str(tmp_path / "other.json")],
          "--tokenizer has 400 tokens, but")
    fails(["--data", str(tmp_path / "tokens"), str(text_file), *run], "one token folder alone")


def test_a_token_folder_trains(tmp_path, capsys):
    tokenizer = BPETokenizer.train(TEXT, 300, special_tokens=["<|endoftext|>"])
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    prepare_token_files(tmp_path / "text.txt", tmp_path / "tokens", tokenizer)
    tokenizer.save(tmp_path / "tok.json")
    flags = [f for f in PRETRAIN_FLAGS if f not in ("--tokenizer", "bpe:300")]
    assert run_script("pretrain", ["--data", str(tmp_path / "tokens"), "--tokenizer", str(tmp_path / "tok.json"),
                                   "--out-dir", str(tmp_path / "run"), "--max-steps", "2", *flags]) == 0
    assert "train and" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2


def test_help_explains_every_flag(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # "  --flag VALUE   what it does", or what it does on the next line
    assert run_script("pretrain", ["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    flags = [i for i, line in enumerate(lines) if line.startswith("  -")]
    assert len(flags) > 40 and any(lines[i].startswith("  --out-dir") for i in flags)
    for i in flags:
        same_line = "  " in lines[i].strip()
        next_line = i + 1 < len(lines) and lines[i + 1].startswith("    ") and not lines[i + 1].startswith("  -")
        assert same_line or next_line, f"no help for {lines[i].strip()}"


@pytest.mark.slow
def test_the_bundled_pretrained_model_is_the_default_runs(tmp_path):
    """llmscratch/assets' model (ch05's base) has the default run's tokenizer, shape and quality.

    It is the default run on a CPU with AMX, where the default trains in bfloat16: its NOTICE
    command pins --dtype bfloat16 (the dtype changes the run, not the model's config).
    """
    from llmscratch.assets import PRETRAINED_PATH, read_pretraining_metrics
    from llmscratch.model.config import GPTConfig
    from llmscratch.training.config import TrainConfig
    from llmscratch.training.evaluation import evaluate, token_byte_lengths
    from llmscratch.training.optim import learning_rate

    # The default run as the script starts it, stopped after its first step with what it trains and holds out.
    seen = tmp_path / "default_run.pt"
    hooked = pretrain_with_hook(tmp_path / "hooked.py", f"""
        if self.step == 1:
            import dataclasses, torch
            torch.save({{"model_config": self.model.config.to_dict(), "train_config": dataclasses.asdict(self.config),
                        "val": torch.as_tensor(self.val_tokens), "tokenizer": self.tokenizer.to_json()}}, {str(seen)!r})
            os._exit(0)
        """)
    started = subprocess.run([sys.executable, str(hooked), "--out-dir", str(tmp_path / "run"), "--dtype", "bfloat16",
                              "--no-progress"], capture_output=True, text=True, timeout=600)
    assert started.returncode == 0 and seen.is_file(), started.stderr[-4000:]
    run = torch.load(seen, weights_only=True)
    model_config, train_config = GPTConfig(**run["model_config"]), TrainConfig(**run["train_config"])
    tokenizer, val = BPETokenizer.from_json(run["tokenizer"]), run["val"].numpy()
    model = model_from_checkpoint(PRETRAINED_PATH)
    assert model.config == model_config
    assert tokenizer_from_checkpoint(PRETRAINED_PATH).to_json() == tokenizer.to_json()  # trained afresh here
    metrics = evaluate(model, val, token_byte_lengths(tokenizer, model_config.vocab_size), batch_size=16,
                       device=torch.device("cpu"))
    assert metrics["bits_per_byte"] < 2.07  # issue 5's target; the default run reached 1.967

    # Its shipped metrics (ch04's loss curve) are that same run's: every step of the default
    # schedule, evaluations where the default config puts them, and a last validation that the
    # model reproduces (to 0.01: the shipped weights are rounded to bfloat16, and the run
    # evaluated its float32 weights under bfloat16 autocast).
    records = read_pretraining_metrics()
    assert [r["step"] for r in records] == list(range(1, train_config.max_steps + 1))
    assert [r["lr"] for r in records] == pytest.approx([learning_rate(s, train_config)
                                                        for s in range(train_config.max_steps)])
    evaluated = [r["step"] for r in records if "val_loss" in r]
    assert evaluated == sorted({*range(train_config.eval_interval, train_config.max_steps + 1,
                                       train_config.eval_interval), train_config.max_steps})
    assert records[-1]["val_bits_per_byte"] == pytest.approx(metrics["bits_per_byte"], abs=0.01)


def test_a_mixture_of_experts_trains_and_logs_its_routers_load(tmp_path, text_file):
    out = tmp_path / "moe"
    assert run_script("pretrain", ["--data", str(text_file), "--out-dir", str(out), "--max-steps", "4",
                                   "--eval-interval", "2", "--experts", "3", "--experts-per-token", "2",
                                   *PRETRAIN_FLAGS]) == 0
    model = model_from_checkpoint(out / "checkpoint.pt")
    assert (model.config.n_experts, model.config.experts_per_token, model.config.mlp) == (3, 2, "swiglu")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    loads = [r["expert_load"] for r in records if "expert_load" in r]
    assert len(loads) == 2  # at steps 2 and 4: the tokens routed since the evaluation before
    for load in loads:
        assert len(load) == model.config.n_layers and all(len(layer) == 3 for layer in load)
        assert all(abs(sum(layer) - 1) < 1e-6 for layer in load)
    assert all(r["balance_loss"] >= 1 - 1e-6 for r in records if "balance_loss" in r)  # 1 at best: an even load
