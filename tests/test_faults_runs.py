"""Issue 27, groups 1, 2 and 5: where a run writes is checked before it starts, a run folder holds one run at a
time and never loses an earlier one without --overwrite, a failed save keeps the trained weights, and bad sizes,
encodings and mixed-up flags get a message before any work.

Each test runs a script in this process (tests/scripts.py) (tiny models, --test-mode) or the package's API, and states
the outcome: the exit status, a pattern the message must match, and what the folders hold afterwards.
"""

import errno
import itertools
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from processes import run as run_process
from scripts import ROOT, SCRIPTS, run_script
from test_dpo import model_path, pairs_path  # noqa: F401  (fixtures)
from test_faults_finetune import OURS, ours
from test_faults_pretrain import RUN, copy_run, finished_run, run_main  # noqa: F401  (finished_run: a fixture)
from tiny_training import PRETRAIN, PRETRAIN_FLAGS, TEXT, pretrain_with_hook

from llmscratch.alignment import tasks
from llmscratch.finetuning.classify import Classifier
from llmscratch.finetuning.instruct import read_json_records
from llmscratch.model.checkpoint import export_model, load_checkpoint, model_from_checkpoint, save_checkpoint
from llmscratch.model.config import GPTConfig
from llmscratch.model.generate import stream
from llmscratch.model.gpt import GPT
from llmscratch.runfolder import LOCK_FILE, claim
from llmscratch.text.tokenizer import BPETokenizer

FINETUNING = ("classifier", "instructions", "preferences")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny exported Llama-style model over bytes + <|endoftext|> (a finetuning script's --base)."""
    folder = tmp_path_factory.mktemp("base")
    export_model(ours(), folder / "model.safetensors", BPETokenizer([], special_tokens={"<|endoftext|>": 256}))
    items = [{"context": "Call me", "choices": [" Ishmael.", " Ahab."], "answer": 0}] * 2  # short: the report card's
    (folder / "choices.json").write_text(json.dumps(items))  # bundled sets outgrow this model's context
    return folder / "model.safetensors"


def argv_of(name: str, out: Path, base: Path, model_path: Path, pairs_path: Path, *flags: str) -> list[str]:
    """The flags of a --test-mode run of a finetuning script (or the report card) into ``out``."""
    if name == "preferences":
        start = ["--model", str(model_path), "--data", str(pairs_path)]
    elif name == "evaluate":
        items = str(base.parent / "choices.json")
        start = ["--model", f"tiny={base}", "--choices", items, "--cloze", items]
    else:
        start = ["--base", str(base)]
    return [*start, "--out-dir", str(out), "--test-mode", "--no-progress", *flags]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# =========================================================================== 1. checked before the work
def a_file(tmp_path):
    (tmp_path / "taken").write_text("a file of the user's")
    return tmp_path / "taken", r"--out-dir \S+taken: is a file, not a folder"


def under_a_file(tmp_path):
    (tmp_path / "taken").write_text("a file of the user's")
    return tmp_path / "taken" / "run", r"--out-dir \S+run: \S+taken is a file, not a folder"


def read_only(tmp_path):
    (tmp_path / "locked").mkdir()
    return tmp_path / "locked" / "run", r"--out-dir \S+run: \S+locked is not writable"


@pytest.mark.parametrize("name", [*FINETUNING, "evaluate"])
@pytest.mark.parametrize("where", [a_file, under_a_file, read_only])
def test_an_out_dir_that_cannot_be_written_is_refused_before_any_work(name, where, tmp_path, base, model_path,
                                                                      pairs_path, capsys, monkeypatch):
    out, message = where(tmp_path)
    real_access = os.access  # a read-only folder, as root sees one (root may write anywhere)
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path).name == "locked"
                        else real_access(path, mode))
    before = snapshot(tmp_path)
    assert run_script(name, argv_of(name, out, base, model_path, pairs_path)) == 2
    captured = capsys.readouterr()
    assert re.search(message, captured.err), captured.err
    assert captured.out == "" and "Traceback" not in captured.err  # refused before loading or training anything
    assert snapshot(tmp_path) == before


def refuse_writes_under(folder: Path, monkeypatch) -> None:
    """Every file renamed into ``folder`` (every atomic write ends so) fails as on a full disk."""
    real_replace = os.replace

    def replace(source, target):
        if Path(target).parent.resolve() == folder.resolve():
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("name, model_file", [("classifier", "classifier.pt"), ("instructions", "model.safetensors"),
                                              ("preferences", "model.safetensors")])
def test_a_save_that_fails_at_the_end_keeps_the_trained_model_in_a_folder_it_names(
        name, model_file, tmp_path, base, model_path, pairs_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the rescue folder goes beside the working directory's files
    out = tmp_path / "out"
    refuse_writes_under(out, monkeypatch)
    status = run_script(name, argv_of(name, out, base, model_path, pairs_path, "--lr", "1e-2"))
    assert isinstance(status, str), status
    found = re.fullmatch(rf"error: could not write the finetuned model to {re.escape(str(out))} \(the disk is full: "
                         rf".*\); saved to (\S+) instead", status)
    assert found, status
    rescued = Path(found.group(1))
    assert rescued.parent == tmp_path and rescued.name.startswith("out-rescued-")
    start = model_from_checkpoint(base if name != "preferences" else model_path).state_dict()
    if name == "classifier":
        trained = Classifier.load(rescued / model_file).model.gpt.state_dict()
    else:
        trained = model_from_checkpoint(rescued / model_file).state_dict()
    blocks = [k for k in start if k.startswith("blocks.")]  # (a classifier's head is not the language model's)
    assert blocks and all(k in trained for k in blocks)
    assert any(not torch.equal(trained[k], start[k]) for k in blocks)  # the finetuned weights, not the base's


def test_a_report_that_cannot_be_written_is_rescued_and_printed(tmp_path, base, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "report"
    refuse_writes_under(out, monkeypatch)
    status = run_script("evaluate", argv_of("evaluate", out, base, None, None))
    assert isinstance(status, str) and re.fullmatch(
        rf"error: could not write the report to {re.escape(str(out))} \(.*\); saved to \S+report-rescued-\S+ instead",
        status), status
    assert "| metric | tiny |" in capsys.readouterr().out  # the table is printed before anything is written
    rescued = next(tmp_path.glob("report-rescued-*"))
    assert json.loads((rescued / "report.json").read_text())["models"]["tiny"]["kind"] == "language model"


# =========================================================================== 2. never overwritten, never shared
@pytest.mark.parametrize("name, flag, where", [("classifier", "--base", "folder"), ("instructions", "--base", "file"),
                                               ("preferences", "--model", "file")])
def test_the_folder_of_the_starting_model_is_refused_as_out_dir(name, flag, where, tmp_path, base, model_path,
                                                                pairs_path, capsys):
    start = model_path if name == "preferences" else base
    shutil.copytree(start.parent, tmp_path / "start")
    given = tmp_path / "start" / start.name if where == "file" else tmp_path / "start"
    argv = argv_of(name, tmp_path / "start", base, model_path, pairs_path)
    argv[argv.index(flag) + 1] = str(given)
    before = snapshot(tmp_path)
    assert run_script(name, argv) == 2
    assert re.search(rf"error: --out-dir \S+start .*{flag} \S+", capsys.readouterr().err)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", FINETUNING)
@pytest.mark.slow
def test_a_folder_with_finished_results_needs_overwrite_and_then_holds_only_the_new_run(
        name, tmp_path, base, model_path, pairs_path, capsys):
    out = tmp_path / "out"
    assert run_script(name, argv_of(name, out, base, model_path, pairs_path, "--lora", "--lora-rank", "2")) == 0
    assert (out / "adapters.safetensors").is_file()
    first = snapshot(out)
    status = run_script(name, argv_of(name, out, base, model_path, pairs_path))
    assert isinstance(status, str) and re.fullmatch(r"error: --out-dir \S+out already holds the results of a run "
                                                    r"\(.*metrics\.json.*\); pass --overwrite to replace them, or "
                                                    r"choose another --out-dir", status), status
    assert snapshot(out) == first
    assert run_script(name, argv_of(name, out, base, model_path, pairs_path, "--overwrite")) == 0
    assert not (out / "adapters.safetensors").exists()  # the earlier run's adapters describe another model
    assert snapshot(out) != first and not (out / LOCK_FILE).exists()


@pytest.mark.slow
def test_a_finished_pretraining_run_without_its_checkpoint_is_not_overwritten(tmp_path, finished_run, capsys):
    run = copy_run(finished_run, tmp_path)
    (run / "checkpoint.pt").unlink()  # people delete it to save space
    before = snapshot(run)
    argv = ["--data", str(tmp_path / "text.txt"), "--out-dir", str(run), "--max-steps", "2", *PRETRAIN_FLAGS]
    assert run_main(argv) == 2
    assert re.search(r"error: --out-dir \S+ .*\(model\.safetensors, run\.json.*--resume.*--overwrite",
                     capsys.readouterr().err)
    assert run_main(["--out-dir", str(run), "--resume"]) == 2
    assert "holds model.safetensors, run.json" in capsys.readouterr().err
    assert snapshot(run) == before
    assert run_main([*argv, "--overwrite"]) == 0
    assert load_checkpoint(run / "checkpoint.pt")["step"] == 2
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # nothing of the run before


def hold_in_another_process(folder: Path) -> subprocess.Popen:
    """A process that claims ``folder`` and waits (until killed); returns once it holds it."""
    code = textwrap.dedent(f"""
        import sys, time
        from llmscratch.runfolder import claim
        with claim({str(folder)!r}):
            print("held", flush=True)
            time.sleep(120)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.slow
def test_a_run_folder_is_held_by_one_run_and_a_killed_holder_leaves_it_free(tmp_path, capsys):
    run = tmp_path / RUN
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    argv = ["--data", str(tmp_path / "text.txt"), "--out-dir", str(run), "--max-steps", "2", *PRETRAIN_FLAGS]
    holder = hold_in_another_process(run)
    try:
        assert run_main(argv) == 2
        assert re.search(rf"error: --out-dir {re.escape(str(run))} .*process {holder.pid}\b", capsys.readouterr().err)
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]  # nothing of this run was written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    assert run_main(argv) == 0  # the kernel let go of the lock with the process
    assert not (run / LOCK_FILE).exists()


def test_a_finetuning_run_refuses_a_folder_another_process_holds(tmp_path, base, model_path, pairs_path):
    out = tmp_path / "out"
    with claim(out):  # this process holds it, as a run under way would
        status = run_script("classifier", argv_of("classifier", out, base, model_path, pairs_path))
    assert isinstance(status, str) and re.fullmatch(rf"error: --out-dir {re.escape(str(out))} is in use by another "
                                                    rf"run \(process {os.getpid()} .*\); wait for it.*", status), status
    assert not out.exists()  # claim made it, and left nothing behind


# =========================================================================== 5. limits, encodings, mixed-up flags
def test_a_lora_rank_larger_than_the_layers_is_refused_before_training(tmp_path, base):
    status = run_script("instructions", argv_of("instructions", tmp_path / "out", base, None, None, "--lora",
                                                "--lora-rank", "100000"))
    d_model = OURS["d_model"]
    assert isinstance(status, str) and re.search(rf"rank 100000 .*blocks\.0\.attn\.\w+.* {d_model}\b", status), status
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", FINETUNING)
@pytest.mark.parametrize("trainable", ["head", "all"])  # "all": the default of two of the scripts, given all the same
def test_lora_beside_another_trainable_is_refused(name, trainable, tmp_path, base, model_path, pairs_path, capsys):
    argv = argv_of(name, tmp_path / "out", base, model_path, pairs_path, "--lora", "--trainable", trainable)
    assert run_script(name, argv) == 2
    assert re.search(r"error: .*--trainable.* --lora", capsys.readouterr().err)


TEXT_FAULTS = {
    "UTF-16 without a byte-order mark": (TEXT[:4000].encode("utf-16-le"),
                                         r"NUL byte \(byte 1\).*UTF-16"),
    "UTF-16 with its byte-order mark": (TEXT[:4000].encode("utf-16"), r"UTF-16.*byte-order mark"),
    "NUL bytes in text": (TEXT[:4000].encode() + b"\0\0\0\0" + TEXT[4000:8000].encode(),
                          rf"NUL byte \(byte {len(TEXT[:4000].encode()):,}\)"),
}


@pytest.mark.parametrize("case", TEXT_FAULTS)
def test_text_that_is_not_utf8_is_refused_naming_the_file(case, tmp_path, capsys):
    content, message = TEXT_FAULTS[case]
    (tmp_path / "text.txt").write_bytes(content)
    assert run_main(["--data", str(tmp_path / "text.txt"), "--out-dir", str(tmp_path / RUN), *PRETRAIN_FLAGS]) == 2
    assert re.search(r"error: --data \S+text\.txt .*" + message, capsys.readouterr().err)
    assert not (tmp_path / RUN).exists()
    status = run_script("tokenizer", ["--input", str(tmp_path / "text.txt"), "--out", str(tmp_path / "t.json")])
    assert isinstance(status, str) and re.search(r"error: --input \S+text\.txt .*" + message, status), status


def test_a_device_file_as_data_is_refused_not_read_until_memory_runs_out(tmp_path):
    def bounded() -> None:  # should it read /dev/zero after all, it fails in seconds, not at the machine's limit
        resource.setrlimit(resource.RLIMIT_DATA, (3 * 2**30, 3 * 2**30))

    result = run_process([sys.executable, str(PRETRAIN), "--data", "/dev/zero", "--out-dir", str(tmp_path / RUN),
                          *PRETRAIN_FLAGS], timeout=120, preexec_fn=bounded)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error: --data /dev/zero: not a regular file" in result.stderr


def test_a_stream_far_longer_than_memory_could_hold_at_once_starts_and_stays_one_window():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("llama-tiny", **{**OURS, "context_length": 8}))
    steps = stream(model, torch.tensor([[1, 2, 3]]), 10**12, temperature=0.0)  # 8 TB of ids, were they stored
    ids = [int(step[0]) for step in itertools.islice(steps, 40)]
    # Past the context the stream slides: the same ids as generating the first 40 directly.
    assert ids == [int(step[0]) for step in stream(model, torch.tensor([[1, 2, 3]]), 40, temperature=0.0)]


def test_a_prompt_longer_than_the_context_gets_a_note(tmp_path, base, capsys):
    context = OURS["context_length"]
    assert run_script("generate", [str(base), "--prompt", "ab" * context, "--max-new-tokens", "2"]) == 0
    assert re.search(rf"note: .* {2 * context} tokens, .* {context}\b.* last {context}\b", capsys.readouterr().err)


def test_the_memory_planner_refuses_a_model_beyond_what_pytorch_can_count(capsys):
    from llmscratch.training.memory import main as memory_main

    with pytest.raises(SystemExit) as exit_info:
        memory_main(["--d-model", "12000000000"])
    assert exit_info.value.code == 2
    assert re.search(r"error: .*2\^63.*--d-model", capsys.readouterr().err)


def test_resuming_with_other_data_or_another_optimizer_names_the_flag(tmp_path, finished_run, capsys):
    run = copy_run(finished_run, tmp_path)
    (tmp_path / "other.txt").write_text(TEXT[: len(TEXT) // 2], encoding="utf-8")
    before = snapshot(run)
    assert run_main(["--out-dir", str(run), "--resume", "--max-steps", "6", "--data", str(tmp_path / "other.txt")]) == 2
    assert re.search(r"cannot resume: .*[\d,]+ tokens.* [\d,]+.*--data, --tokenizer", capsys.readouterr().err)
    assert run_main(["--out-dir", str(run), "--resume", "--max-steps", "6", "--optimizer", "muon"]) == 2
    assert re.search(r"cannot resume: .*'adamw'.*'muon'.*--optimizer", capsys.readouterr().err)
    assert snapshot(run) == before


def test_resume_and_overwrite_together_are_refused(tmp_path, finished_run, capsys):
    run = copy_run(finished_run, tmp_path)
    assert run_main(["--out-dir", str(run), "--resume", "--overwrite"]) == 2
    assert "--resume continues the run in --out-dir, --overwrite starts it again: give one of them" in \
        capsys.readouterr().err


def test_preference_pairs_that_all_tie_are_refused(tmp_path, model_path, capsys):
    pairs = [{"instruction": "Say yes.", "input": "", "chosen": "yes", "rejected": "yes", "split": split}
             for split in ("train", "validation", "test") for _ in range(3)]
    (tmp_path / "pairs.json").write_text(json.dumps(pairs))
    status = run_script("preferences", argv_of("preferences", tmp_path / "out", None, model_path,
                                                tmp_path / "pairs.json"))
    assert isinstance(status, str) and re.search(r"pairs\.json, 'train' split: .*chosen.*rejected", status), status


def test_json_lines_are_read_where_a_json_list_is_expected(tmp_path):
    records = [{"instruction": "Say yes.", "input": "", "output": "yes", "split": "train"},
               {"instruction": "Say no.", "input": "", "output": "no", "split": "test"}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert read_json_records(tmp_path / "data.jsonl") == records
    (tmp_path / "bad.jsonl").write_text(json.dumps(records[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: not JSON"):
        read_json_records(tmp_path / "bad.jsonl")


@pytest.mark.slow
def test_ctrl_c_during_dpo_saves_the_model_trained_so_far(tmp_path, model_path, pairs_path, capsys, monkeypatch):
    from llmscratch.training.optim import OptimizerStep

    real_step, steps = OptimizerStep.__call__, []

    def step_then_ctrl_c(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        steps.append(self.step)
        if len(steps) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C in the terminal: the handler asks for a stop
        return result

    monkeypatch.setattr(OptimizerStep, "__call__", step_then_ctrl_c)
    out = tmp_path / "out"
    assert run_script("preferences", argv_of("preferences", out, None, model_path, pairs_path)) == 130
    captured = capsys.readouterr()
    assert re.search(r"SIGINT: .*saving", captured.out)
    assert f"interrupted: stopped after step 2 of " in captured.out and "Traceback" not in captured.err
    assert len(steps) == 2  # no step after the one under way
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["interrupted"].startswith("stopped after step 2 of") and len(metrics["steps"]) == 2
    trained, start = (model_from_checkpoint(p).state_dict() for p in (out / "model.safetensors", model_path))
    assert any(not torch.equal(trained[k], start[k]) for k in start)


def test_evaluate_refuses_bad_benchmark_files_and_devices_before_scoring(tmp_path, capsys):
    (tmp_path / "choices.json").write_text(json.dumps([{"context": "a", "choices": ["b", "c"], "answer": 0}] * 300 +
                                                      [{"context": "a", "choices": ["b", "c"], "answer": 5}]))
    (tmp_path / "ties.json").write_text(json.dumps([{"context": "a", "choices": ["b", "b"], "answer": 0}]))
    (tmp_path / "one.json").write_text(json.dumps([{"context": "a", "choices": ["b"], "answer": 0}]))
    (tmp_path / "cloze.jsonl").write_text("{not json\n{}\n")
    for argv, message in ((["--choices", str(tmp_path / "one.json")], r"item 0: 'choices' is \['b'\]: one choice"),
                          (["--cloze", str(tmp_path)], rf"--cloze {re.escape(str(tmp_path))}: a folder"),
                          (["--choices", str(tmp_path / "choices.json")],
                           r"--choices \S+choices\.json: item 300: 'answer' 5 .*\(0 to 1\)"),
                          (["--cloze", str(tmp_path / "cloze.jsonl")], r"--cloze \S+cloze\.jsonl, line 1: not JSON"),
                          (["--cloze", str(tmp_path / "ties.json")], r"item 0: 'choices' repeat one \('b'\)"),
                          (["--device", "cuda:3"] if not torch.cuda.is_available() else ["--device", "cuda:999"],
                           r"--device: device 'cuda:\d+'")):
        assert run_script("evaluate", [*argv, "--out-dir", str(tmp_path / "report")]) == 2
        assert re.search(message, capsys.readouterr().err)
        assert not (tmp_path / "report").exists()


def test_evaluate_takes_a_path_holding_an_equals_sign_as_a_path(tmp_path, base):
    folder = tmp_path / "lr=1e-3"
    shutil.copytree(base.parent, folder)
    items = str(folder / "choices.json")
    assert run_script("evaluate", ["--model", str(folder / "model.safetensors"), "--choices", items, "--cloze", items,
                                   "--out-dir", str(tmp_path / "report"), "--test-mode", "--no-progress"]) == 0
    models = json.loads((tmp_path / "report" / "report.json").read_text())["models"]
    assert list(models) == ["lr=1e-3"] and models["lr=1e-3"]["source"] == str(folder / "model.safetensors")


@pytest.mark.parametrize("metrics, problem", [("[1, 2]", "TypeError"), ("{not json", "JSONDecodeError"),
                                              ('{"config": {"seed": "x"}}', "config.seed should be an integer")])
def test_a_classifier_beside_a_bad_metrics_file_is_named(metrics, problem, tmp_path, capsys):
    from llmscratch.finetuning.classify import SPAM_LABELS, GPTClassifier

    tokenizer = BPETokenizer([], special_tokens={"<|endoftext|>": 256})
    classifier = Classifier(GPTClassifier(ours(), len(SPAM_LABELS)), tokenizer, SPAM_LABELS, 256, max_length=32)
    (tmp_path / "spam").mkdir()
    classifier.save(tmp_path / "spam" / "classifier.pt")
    (tmp_path / "spam" / "metrics.json").write_text(metrics)
    status = run_script("evaluate", ["--model", str(tmp_path / "spam"), "--test-mode", "--no-progress",
                                     "--out-dir", str(tmp_path / "report")])
    assert isinstance(status, str) and re.search(r"error: --model spam \(\S+classifier\.pt\): \S+metrics\.json", status)
    assert problem in status


def test_a_prompt_too_long_for_the_model_names_the_model_and_the_benchmark(tmp_path, base):
    context = OURS["context_length"]
    (tmp_path / "choices.json").write_text(json.dumps([{"context": "a", "choices": ["x" * 3 * context, "c"],
                                                        "answer": 0}]))
    status = run_script("evaluate", argv_of("evaluate", tmp_path / "report", base, None, None, "--choices",
                                            str(tmp_path / "choices.json")))
    assert isinstance(status, str) and re.match(rf"error: --model tiny \(\S+model\.safetensors\): .*choices.*"
                                                rf" {3 * context} tokens.*context_length={context}", status), status


@pytest.mark.parametrize("out", ["a folder", "a missing folder"])
def test_a_data_script_checks_its_output_first_and_makes_missing_folders(out, tmp_path, capsys):
    if out == "a folder":
        assert run_script("cloze", ["--out", str(tmp_path)]) == 2
        assert f"--out {tmp_path}: is a folder; give a file name" in capsys.readouterr().err
    else:
        assert run_script("cloze", ["--out", str(tmp_path / "new" / "cloze.json")]) == 0
        assert len(read_json_records(tmp_path / "new" / "cloze.json")) > 100


@pytest.mark.slow
def test_the_attention_benchmark_checks_its_plot_path_and_names_sizes_that_do_not_fit(tmp_path):
    bench = [sys.executable, str(ROOT / "ch02-attention" / "attention_bench.py"), "--no-compile", "--repeats", "1"]
    folder = run_process([*bench, "--out", str(tmp_path)], timeout=120)
    assert folder.returncode == 2 and f"--out {tmp_path}: is a folder; give a file name" in folder.stderr

    def bounded() -> None:  # the allocation fails at once, whatever memory this machine has
        resource.setrlimit(resource.RLIMIT_DATA, (3 * 2**30, 3 * 2**30))

    huge = run_process([*bench, "--batch-size", "100000", "--seq-lens", "128", "--out", str(tmp_path / "a.png")],
                       timeout=120, preexec_fn=bounded)
    assert huge.returncode == 1, huge.stderr[-2000:]
    assert re.search(r"error: batch 100000 x 128 tokens x d_model 256 .*cpu.*--batch-size.*--seq-lens", huge.stderr), \
        huge.stderr[-2000:]
    assert "Traceback" not in huge.stderr


@pytest.mark.slow
def test_attention_benchmark_flags_are_named_one_by_one(tmp_path):
    bench = [sys.executable, str(ROOT / "ch02-attention" / "attention_bench.py")]
    for flags, message in ((["--d-model", "10", "--n-heads", "4"], r"--d-model 10 .*--n-heads 4"),
                           (["--warmup", "0"], r"--warmup .*\b0$"),
                           (["--threads", "0"], r"--threads .*\b0$"),
                           (["--n-kv-heads", "0"], r"--n-kv-heads .*\b0$"),
                           (["--out", str(tmp_path / "plot")], r"--out \S+plot: .*\.png")):
        result = run_process([*bench, *flags], timeout=120)
        assert result.returncode == 2 and re.search("error: .*" + message, result.stderr, re.M), result.stderr


def test_two_outputs_of_a_data_script_on_one_path_are_refused(tmp_path, capsys):
    same = str(tmp_path / "same.json")
    assert run_script("preferences_data", ["--preferences", same, "--choices", same]) == 2
    assert f"--preferences and --choices are both {same}" in capsys.readouterr().err
    instructions = str(tmp_path / "instructions.json")
    shutil.copy(ROOT / "llmscratch" / "assets" / "instructions.json", instructions)
    assert run_script("preferences_data", ["--instructions", instructions, "--preferences", instructions,
                                           "--choices", str(tmp_path / "c.json")]) == 2
    assert re.search(r"error: .*--preferences.* --instructions", capsys.readouterr().err)
    assert not (tmp_path / "same.json").exists() and not (tmp_path / "c.json").exists()
    status = run_script("tokenizer", ["--input", instructions, "--out", instructions])
    assert status == 2 and re.search(r"error: .*--out.* --input", capsys.readouterr().err)


def test_resuming_a_finished_run_changes_nothing_and_says_so(tmp_path, finished_run, capsys):
    run = copy_run(finished_run, tmp_path)
    before = snapshot(run)
    for steps in ("4", "2"):  # as many steps as it has, or fewer
        assert run_main(["--out-dir", str(run), "--resume", "--max-steps", steps]) == 2
        assert re.search(rf"cannot resume: .*step 4, .*max_steps is {steps}: .*--max-steps", capsys.readouterr().err)
    assert snapshot(run) == before  # its summary, sample and flags are the finished run's


def test_the_memory_planner_refuses_more_blocks_than_it_can_list(capsys):
    from llmscratch.training.memory import main as memory_main

    with pytest.raises(SystemExit) as exit_info:
        memory_main(["--preset", "llama3-8b", "--n-layers", "100000000"])
    assert exit_info.value.code == 2 and "--n-layers 100,000,000: at most 10,000" in capsys.readouterr().err


def test_instruction_data_asked_for_more_than_a_family_holds_fails_at_once(tmp_path):
    with pytest.raises(ValueError, match=r"family 'reverse_letters' .*\d+ distinct records.* 1000000000000"):
        tasks.make_records(10**12, seed=0)  # (it drew 10**14 times before giving up)


def test_ctrl_c_in_a_data_script_is_a_line_and_status_130_not_a_traceback(tmp_path):
    # Ctrl-C as in a terminal: a process started in the background of a non-interactive shell (a CI job, say)
    # inherits SIGINT ignored, and Python then leaves it ignored; the script gets the default disposition back.
    tokenizer = subprocess.Popen([sys.executable, str(SCRIPTS["tokenizer"]), "--vocab-size", "8000", "--out",
                                  str(tmp_path / "t.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert tokenizer.stdout.readline().startswith("training on")  # the long part has begun
        tokenizer.send_signal(signal.SIGINT)
        _, stderr = tokenizer.communicate(timeout=120)
    finally:
        tokenizer.kill()
    assert tokenizer.returncode == 130 and stderr.strip().splitlines()[-1] == "interrupted", stderr
    assert "Traceback" not in stderr and not (tmp_path / "t.json").exists()


def test_an_input_that_is_not_a_file_is_named_for_what_it_is(tmp_path, base, capsys):
    for data, what in (("/dev/zero", "not a regular file (a device or pipe)"), (str(tmp_path), "a folder")):
        assert run_script("classifier", argv_of("classifier", tmp_path / "out", base, None, None,
                                                            "--data", data)) == 2
        assert f"--data {data}: {what}" in capsys.readouterr().err
    assert run_script("evaluate", ["--model", "lbl=", "--out-dir", str(tmp_path / "report")]) == 2
    assert "--model lbl=: no model after 'lbl'=" in capsys.readouterr().err


# =========================================================================== a rank that dies
RANK_1_DIES_AT_STEP_3 = """
if self.step == 3 and self.dist.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_the_survivors_of_a_killed_rank_say_so_and_where_to_resume(tmp_path):
    """Two one-process "nodes" (as on two machines, where no launcher kills the survivor): rank 1 dies at step 3."""
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    killing = pretrain_with_hook(tmp_path / "killing.py", RANK_1_DIES_AT_STEP_3)
    flags = ["--device", "cpu", "--data", str(tmp_path / "text.txt"), "--out-dir", str(tmp_path / RUN),
             "--max-steps", "10", "--checkpoint-interval", "2", "--no-progress", *PRETRAIN_FLAGS]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = str(29400 + os.getpid() % 500)

    def node(rank: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", port,
                str(killing), *flags]

    survivor = subprocess.Popen(node(0), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
    try:
        killed = run_process(node(1), timeout=240, env=env)
        stdout, stderr = survivor.communicate(timeout=240)
    finally:
        if survivor.poll() is None:
            os.killpg(survivor.pid, signal.SIGKILL)
    assert killed.returncode != 0
    assert re.search(r"error: process 0 stops: .*(closed|reset) by peer.*--resume --out-dir \S+ .*step 2",
                     stderr), stderr
    assert "[rank0]: Traceback" not in stderr  # (the launcher's own report of a failed worker follows it)
    assert load_checkpoint(tmp_path / RUN / "checkpoint.pt")["step"] == 2
