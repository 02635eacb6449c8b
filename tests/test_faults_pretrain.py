"""Faults of the pretraining pipeline (issue 12): each bad input or lost state gives a clear, early outcome.

A table of cases, each run through ch04-pretraining/pretrain.py (run in this process, tests/scripts.py) or the
package's API: the exit status or exception, a pattern the message must match, and the files that must come
out unchanged (byte for byte). Then the cases that need more than a table: signals, a full disk,
stale temporaries, and the order of leaving the process group.
"""

import errno
import gc
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from processes import start_until_lines
from scripts import run_script
from tiny_training import PRETRAIN, PRETRAIN_FLAGS, TEXT, model_config, tokenizer

from llmscratch.files import DiskFullError
from llmscratch.model.checkpoint import export_model, load_checkpoint, model_from_checkpoint, save_checkpoint
from llmscratch.model.gpt import GPT
from llmscratch.text.corpus import load_token_split, prepare_token_files
from llmscratch.text.tokenizer import BPETokenizer
from llmscratch.training import distributed
from llmscratch.training.train import Trainer

RUN = "run"  # the run folder, under tmp_path


def run_main(argv: list[str]) -> int | str:
    """pretrain.py run with ``argv``, in this process: its exit status."""
    return run_script("pretrain", argv)


def digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A tiny finished run (4 steps, a checkpoint every 2), copied afresh for each test that needs one."""
    folder = tmp_path_factory.mktemp("finished")
    (folder / "text.txt").write_text(TEXT, encoding="utf-8")
    assert run_main(["--data", str(folder / "text.txt"), "--out-dir", str(folder / RUN), "--max-steps", "4",
                          "--checkpoint-interval", "2", *PRETRAIN_FLAGS]) == 0
    return folder


def copy_run(finished_run: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copy(finished_run / "text.txt", tmp_path / "text.txt")
    shutil.copytree(finished_run / RUN, tmp_path / RUN)
    # run.json names the text by its old path: point it (and nothing else) at the copy.
    flags = json.loads((tmp_path / RUN / "run.json").read_text())
    flags["data"] = [str(tmp_path / "text.txt")]
    flags["tokenizer"] = str(tmp_path / RUN / "tokenizer.llmscratch.json")
    (tmp_path / RUN / "run.json").write_text(json.dumps(flags))
    return tmp_path / RUN


@dataclass
class ScriptCase:
    """pretrain.py run with setup(tmp_path) + PRETRAIN_FLAGS exits with ``code``, ``message`` in its output."""

    name: str
    setup: Callable[[Path], list[str]]
    code: int
    message: str  # a regex searched in stdout + stderr
    unchanged: list[str] = field(default_factory=list)  # files under tmp_path, compared byte for byte
    creates_nothing: bool = False  # the run folder must not exist afterwards
    needs_run: bool = False  # setup gets a copy of a finished run in tmp_path / RUN


def text(name: str, content: str) -> Callable[[Path], list[str]]:
    def setup(tmp_path):
        (tmp_path / name).write_text(content, encoding="utf-8")
        return ["--data", str(tmp_path / name), "--out-dir", str(tmp_path / RUN), *PRETRAIN_FLAGS]
    return setup


def with_text(*flags: str) -> Callable[[Path], list[str]]:
    def setup(tmp_path):
        (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
        return ["--data", str(tmp_path / "text.txt"), "--out-dir", str(tmp_path / RUN), *PRETRAIN_FLAGS,
                *(flag.replace("{tmp}", str(tmp_path)) for flag in flags)]
    return setup


def token_folder_with_bad_id(tmp_path):
    tok = BPETokenizer.train(TEXT, 300, special_tokens=["<|endoftext|>"])
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    prepare_token_files(tmp_path / "text.txt", tmp_path / "tokens", tok)
    tok.save(tmp_path / "tok.json")
    ids = np.fromfile(tmp_path / "tokens" / "train.bin", dtype=np.uint16)
    ids[1234] = 300  # the first id past the vocabulary of 300
    ids[2000] = 65535
    ids.tofile(tmp_path / "tokens" / "train.bin")
    flags = [f for f in PRETRAIN_FLAGS if f not in ("--tokenizer", "bpe:300")]
    return ["--data", str(tmp_path / "tokens"), "--tokenizer", str(tmp_path / "tok.json"),
            "--out-dir", str(tmp_path / RUN), *flags]


def resume(*flags: str) -> Callable[[Path], list[str]]:
    def setup(tmp_path):
        return ["--out-dir", str(tmp_path / RUN), "--resume", "--no-progress", *flags]
    return setup


def damaged_run_json(content: str) -> Callable[[Path], list[str]]:
    def setup(tmp_path):
        (tmp_path / RUN / "run.json").write_text(content)
        return ["--out-dir", str(tmp_path / RUN), "--resume", "--max-steps", "5"]
    return setup


def deleted_tokenizer(tmp_path):
    (tmp_path / RUN / "tokenizer.llmscratch.json").unlink()
    return ["--out-dir", str(tmp_path / RUN), "--resume", "--max-steps", "5"]


def moved_run(tmp_path):
    (tmp_path / RUN).rename(tmp_path / "moved")
    # The run folder's own tokenizer is found in its new place, not at the path run.json recorded.
    return ["--out-dir", str(tmp_path / "moved"), "--resume", "--max-steps", "5"]


def moved_data(tmp_path):
    (tmp_path / "text.txt").rename(tmp_path / "elsewhere.txt")
    return ["--out-dir", str(tmp_path / RUN), "--resume", "--max-steps", "5"]


def under_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    return with_text("--out-dir", "{tmp}/file/run")(tmp_path)


RUN_FILES = [f"{RUN}/run.json", f"{RUN}/checkpoint.pt", f"{RUN}/tokenizer.llmscratch.json", f"{RUN}/metrics.jsonl",
             f"{RUN}/model.safetensors"]

SCRIPT_CASES = [
    # Issue 12.1: an empty text: a clear error before any tokenizer work, not a ZeroDivisionError.
    ScriptCase("empty text", text("empty.txt", ""), 2, r"--data \S*empty\.txt: no text",
               creates_nothing=True),
    ScriptCase("empty text, gpt2", lambda p: text("empty.txt", "")(p) + ["--tokenizer", "gpt2"], 2,
               r"empty.txt: no text", creates_nothing=True),
    # Too little text: the advice fits the split that is short.
    ScriptCase("short training split", lambda p: text("short.txt", "Call me Ishmael. " * 3)(p)
               + ["--val-fraction", "0.9"], 2,
               r"training split.*--val-fraction \(now 0\.9\)",
               creates_nothing=True),
    ScriptCase("short validation split", lambda p: text("short.txt", "Call me Ishmael. " * 20)(p)
               + ["--val-fraction", "0.01"], 2,
               r"validation split.*--val-fraction \(now 0\.01\)",
               creates_nothing=True),
    # Issue 12.3: ids past the vocabulary are found when the folder is loaded, with the file and the id.
    ScriptCase("token id past the vocabulary", token_folder_with_bad_id, 2,
               r"tokens/train\.bin.*token id 300 at position 1,234.*300 ids",
               creates_nothing=True),
    # Issue 12.5: a refused --resume changes nothing, so a later plain --resume still works.
    ScriptCase("resume with another preset", resume("--preset", "llama-mini"), 2,
               r"d_model: model \d+ vs checkpoint \d+", unchanged=RUN_FILES, needs_run=True),
    ScriptCase("resume with another batch size", resume("--batch-size", "3"), 2,
               "batch_size=2.*batch_size=3", unchanged=RUN_FILES, needs_run=True),
    # Issue 12.6: a damaged run.json: the checkpoint's copy of the flags is used, and said so.
    ScriptCase("truncated run.json", damaged_run_json('{"data": ["te'), 0,
               r"run\.json.*\S*checkpoint\.pt", needs_run=True),
    ScriptCase("empty run.json", damaged_run_json(""), 0, r"run.json is unreadable", needs_run=True),
    ScriptCase("run.json of another shape", damaged_run_json("[1, 2]"), 0, r"run.json does not hold a run's flags",
               needs_run=True),
    # Issue 12.7: evaluation sizes below one window are refused before any work.
    ScriptCase("eval tokens below a window", with_text("--eval-tokens", "16"), 2,
               r"--eval-tokens 16 .*17 tokens",
               creates_nothing=True),
    ScriptCase("final eval tokens below a window", with_text("--final-eval-tokens", "2"), 2,
               r"--final-eval-tokens 2 .*17 tokens", creates_nothing=True),
    # Rough edges.
    ScriptCase("resume without its tokenizer file", deleted_tokenizer, 0, r"done in", needs_run=True),
    ScriptCase("resume of a moved run folder", moved_run, 0, r"done in", needs_run=True),
    ScriptCase("resume whose data moved", moved_data, 2,
               r"--resume: .*--data \S*text\.txt .*run\.json",
               unchanged=RUN_FILES, needs_run=True),
    ScriptCase("out-dir under a file", under_a_file, 2, r"--out-dir \S*file/run: \S*file is a file, not a folder",
               unchanged=["file"]),
    ScriptCase("lr overflowing float32", with_text("--lr", "1e300"), 2,
               r"--lr: '1e300' .*3\.4e\+38", creates_nothing=True),
    ScriptCase("lr infinite", with_text("--lr", "inf"), 2, r"--lr: 'inf'",
               creates_nothing=True),
    ScriptCase("weight decay NaN", with_text("--weight-decay", "nan"), 2,
               r"--weight-decay: 'nan'", creates_nothing=True),
    ScriptCase("dropout of 1, before the tokenizer", with_text("--dropout", "1"), 2, r"dropout must be in \[0, 1\)",
               creates_nothing=True),
]


# A case that runs to the end trains (seconds): slow.
@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case.code == 0 else case
                                  for case in SCRIPT_CASES], ids=[case.name for case in SCRIPT_CASES])
def test_script_faults(case, tmp_path, finished_run, capsys, monkeypatch):
    if case.needs_run:
        copy_run(finished_run, tmp_path)
    argv = case.setup(tmp_path)
    before = {name: digest(tmp_path / name) for name in case.unchanged}
    if case.code != 0:  # a refused run trains no tokenizer: the check came before the expensive work
        monkeypatch.setattr(BPETokenizer, "train", classmethod(lambda *a, **k: pytest.fail("tokenizer trained")))
    assert run_main(argv) == case.code
    captured = capsys.readouterr()
    assert re.search(case.message, captured.out + captured.err), captured.out + captured.err
    assert "Traceback" not in captured.err
    assert {name: digest(tmp_path / name) for name in case.unchanged} == before
    if case.creates_nothing:
        assert not (tmp_path / RUN).exists()


def test_a_refused_resume_leaves_a_run_that_still_resumes(tmp_path, finished_run):
    copy_run(finished_run, tmp_path)
    assert run_main(["--out-dir", str(tmp_path / RUN), "--resume", "--preset", "llama-mini"]) == 2
    assert run_main(["--out-dir", str(tmp_path / RUN), "--resume", "--max-steps", "5", "--no-progress"]) == 0
    assert load_checkpoint(tmp_path / RUN / "checkpoint.pt")["step"] == 5


def test_out_dir_on_a_read_only_filesystem_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == tmp_path else real_access(path, mode))
    monkeypatch.setattr(BPETokenizer, "train", classmethod(lambda *a, **k: pytest.fail("tokenizer trained")))
    assert run_main(with_text()(tmp_path)) == 2
    assert re.search(rf"--out-dir \S+: {re.escape(str(tmp_path))} is not writable", capsys.readouterr().err)


# --------------------------------------------------------------------------- the API
@dataclass
class ApiCase:
    name: str
    setup: Callable[[Path], None] | None  # makes the files the call works on
    call: Callable[[Path], object]  # the call that must fail
    error: type[BaseException]
    message: str
    unchanged: list[str] = field(default_factory=list)  # files under tmp_path, compared byte for byte


def good_token_folder(tmp_path):
    """A valid token folder (with a file of the user's beside the token files), and a binary file."""
    (tmp_path / "good.txt").write_text(TEXT[:5000], encoding="utf-8")
    prepare_token_files(tmp_path / "good.txt", tmp_path / "tok", tokenizer())
    (tmp_path / "tok" / "notes.txt").write_text("the user's own file")
    (tmp_path / "binary.dat").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "tiny.txt").write_text("a", encoding="utf-8")


def prepare(*names: str) -> Callable[[Path], object]:
    return lambda tmp_path: prepare_token_files([tmp_path / name for name in names], tmp_path / "tok", tokenizer())


def load_split_with_bad_id(tmp_path):
    ids = np.fromfile(tmp_path / "tok" / "val.bin", dtype=np.uint16)
    ids[7] = 4000
    ids.tofile(tmp_path / "tok" / "val.bin")
    load_token_split(tmp_path / "tok", "val")


def forward_bad_id(tmp_path):
    GPT(model_config())(torch.tensor([[1, 2, 320]]))


def load_safetensors_as_checkpoint(tmp_path):
    export_model(GPT(model_config()), tmp_path / "model.safetensors", tokenizer())
    (tmp_path / "model.safetensors").rename(tmp_path / "model.pt")  # given where a .pt is expected
    load_checkpoint(tmp_path / "model.pt")


def load_pickled_code(tmp_path):
    torch.save({"model": {}, "model_config": {}, "callback": print}, tmp_path / "code.pt")
    model_from_checkpoint(tmp_path / "code.pt")


TOKEN_FILES = ["tok/meta.json", "tok/train.bin", "tok/val.bin", "tok/notes.txt"]

API_CASES = [
    # Issue 12.4: a failing prepare leaves the folder it was to replace exactly as it was.
    ApiCase("prepare with a binary input", good_token_folder, prepare("good.txt", "binary.dat"), ValueError,
            r"binary\.dat .*NUL byte \(byte 0\)", TOKEN_FILES),
    ApiCase("prepare with a missing input", good_token_folder, prepare("good.txt", "missing.txt"), ValueError,
            r"missing.txt: no such file", TOKEN_FILES),
    ApiCase("prepare with a folder as input", good_token_folder, prepare("tok"), ValueError,
            r"tok: a folder", TOKEN_FILES),
    ApiCase("prepare with too little text", good_token_folder, prepare("tiny.txt"), ValueError,
            r"each split needs at least 1", TOKEN_FILES),
    ApiCase("token file with an id past the vocabulary", good_token_folder, load_split_with_bad_id, ValueError,
            r"tok/val\.bin .*token id 4000 at position 7.*300 ids"),
    ApiCase("GPT.forward with an id past the vocabulary", None, forward_bad_id, ValueError,
            r"token id 320 .*\(0\.\.319\)"),
    ApiCase("a safetensors file where a checkpoint is expected", None, load_safetensors_as_checkpoint, ValueError,
            r"model\.pt is a safetensors file"),
    ApiCase("a checkpoint with pickled code", None, load_pickled_code, ValueError,
            r"code\.pt is not a readable llmscratch checkpoint"),
]


@pytest.mark.parametrize("case", API_CASES, ids=[case.name for case in API_CASES])
def test_api_faults(case, tmp_path):
    if case.setup is not None:
        case.setup(tmp_path)
    before = {name: digest(tmp_path / name) for name in case.unchanged}
    assert None not in before.values()
    with pytest.raises(case.error) as raised:
        case.call(tmp_path)
    assert re.search(case.message, str(raised.value)), str(raised.value)
    assert "weights_only" not in str(raised.value)  # never the advice to run a file's pickled code
    assert {name: digest(tmp_path / name) for name in case.unchanged} == before
    if case.unchanged:
        assert not [p for p in (tmp_path / "tok").iterdir() if p.name.endswith(".tmp")]  # no work folder left


# --------------------------------------------------------------------------- a full disk
def test_a_full_disk_names_the_folder_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    model = GPT(model_config())
    save_checkpoint(tmp_path / "checkpoint.pt", {"model": model.state_dict(), "model_config": {}, "step": 1})
    before = digest(tmp_path / "checkpoint.pt")
    real_save = torch.save
    for failure in (OSError(errno.ENOSPC, "No space left on device"),
                    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")):
        def half_a_save(obj, f, failure=failure):
            real_save({"partial": torch.ones(10)}, f)
            raise failure

        monkeypatch.setattr(torch, "save", half_a_save)
        with pytest.raises(DiskFullError) as raised:
            save_checkpoint(tmp_path / "checkpoint.pt", {"model": {}, "model_config": {}, "step": 2})
        message = str(raised.value)
        assert raised.value.errno == errno.ENOSPC
        assert re.search(rf"disk is full.* checkpoint\.pt in {re.escape(str(tmp_path.resolve()))}.* kept", message)
        assert digest(tmp_path / "checkpoint.pt") == before
        assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # the temporary is gone
    monkeypatch.setattr(torch, "save", real_save)
    assert load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 1


def test_a_full_disk_during_a_run_is_a_clear_error(tmp_path, capsys, monkeypatch):
    real_save, saves = torch.save, []

    def disk_fills_on_the_second_save(obj, f):
        saves.append(obj["step"])
        if len(saves) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", disk_fills_on_the_second_save)
    assert run_main(with_text("--max-steps", "4", "--checkpoint-interval", "2")(tmp_path)) == 1
    err = capsys.readouterr().err
    assert re.search(r"error: .*disk is full.* checkpoint\.pt in \S+run \([\d,]+ bytes free\).* kept", err), err
    monkeypatch.setattr(torch, "save", real_save)
    assert load_checkpoint(tmp_path / RUN / "checkpoint.pt")["step"] == 2


# --------------------------------------------------------------------------- signals
def test_ctrl_c_saves_the_step_under_way_and_says_where_resume_restarts(tmp_path, capsys, monkeypatch):
    real_step, calls = Trainer.train_step, []

    def step_then_interrupt(self):
        calls.append(self.step)
        result = real_step(self)
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the run
        return result

    monkeypatch.setattr(Trainer, "train_step", step_then_interrupt)
    handler = signal.getsignal(signal.SIGINT)
    assert run_main(with_text("--max-steps", "20", "--checkpoint-interval", "5")(tmp_path)) == 130
    out = capsys.readouterr().out
    assert re.search(r"SIGINT: .*checkpoint", out)
    assert re.search(r"\S*checkpoint\.pt .*step 3; --resume --out-dir \S+ .*step 3", out)
    assert load_checkpoint(tmp_path / RUN / "checkpoint.pt")["step"] == 3
    assert signal.getsignal(signal.SIGINT) is handler  # the caller's handler is back
    assert calls == [0, 1, 2]
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert run_main(["--out-dir", str(tmp_path / RUN), "--resume", "--max-steps", "5"]) == 0
    assert len((tmp_path / RUN / "metrics.jsonl").read_text().splitlines()) == 5


def test_a_second_ctrl_c_stops_at_once_and_names_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    real_step = Trainer.train_step

    def step_then_interrupt_twice(self):
        result = real_step(self)
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(Trainer, "train_step", step_then_interrupt_twice)
    assert run_main(with_text("--max-steps", "20", "--checkpoint-interval", "2")(tmp_path)) == 130
    assert re.search(r"step 3; --resume --out-dir \S+ .*step 2", capsys.readouterr().out)
    assert load_checkpoint(tmp_path / RUN / "checkpoint.pt")["step"] == 2


def test_sigterm_saves_a_checkpoint_instead_of_dying_silently(tmp_path):
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    command = [sys.executable, str(PRETRAIN), "--data", str(tmp_path / "text.txt"), "--out-dir", str(tmp_path / RUN),
               "--max-steps", "100000", "--checkpoint-interval", "100000", "--eval-interval", "100000",
               "--sample-interval", "100000", *PRETRAIN_FLAGS]
    metrics = tmp_path / RUN / "metrics.jsonl"
    run = start_until_lines(command, metrics, lines=3, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE)
    assert run.poll() is None, run.communicate()[1]
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 128 + signal.SIGTERM, err  # 143, as a shell reports a process that SIGTERM ended
    step = load_checkpoint(tmp_path / RUN / "checkpoint.pt")["step"]
    assert step >= 3 and re.search(rf"step {step}; --resume --out-dir {re.escape(str(tmp_path / RUN))} .*step {step}",
                                   out), out
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()][-1] == step


# --------------------------------------------------------------------------- stale temporaries
def test_stale_temporaries_of_the_checkpoint_are_removed_at_start_and_nothing_else(tmp_path, finished_run):
    run = copy_run(finished_run, tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=60)
    dead_pid = int(dead.stdout)  # a process that has ended
    stale = run / f".checkpoint.pt.{dead_pid}.0123abcd.tmp"
    live = run / f".checkpoint.pt.{os.getppid()}.0123abcd.tmp"  # a running process may still be writing it
    others = [run / f".model.safetensors.{dead_pid}.0123abcd.tmp", run / ".checkpoint.pt.notes.tmp",
              run / "checkpoint.pt.tmp"]
    for path in (stale, live, *others):
        path.write_bytes(b"half a checkpoint")
    assert run_main(["--out-dir", str(run), "--resume", "--max-steps", "5", "--no-progress"]) == 0
    assert not stale.exists()
    assert live.exists() and all(path.exists() for path in others)


# --------------------------------------------------------------------------- leaving the process group
@pytest.mark.slow
def test_no_trainer_is_alive_when_the_process_group_is_left(tmp_path, finished_run, monkeypatch, capsys):
    """Every way out of main() drops the Trainer (and its DDP wrapper) before distributed.teardown."""
    trainers, seen = [], []
    real_init = Trainer.__init__

    def tracked_init(self, *args, **kwargs):
        trainers.append(weakref.ref(self))
        real_init(self, *args, **kwargs)

    def teardown():
        gc.collect()  # as the real one does: only references that are not garbage count
        seen.append([ref for ref in trainers if ref() is not None])

    monkeypatch.setattr(Trainer, "__init__", tracked_init)
    monkeypatch.setattr(distributed, "teardown", teardown)
    run = copy_run(finished_run, tmp_path)

    def leaves_cleanly(argv, code=None, error=None):
        calls = len(seen)
        if error is None:
            assert run_main(argv) == code
        else:
            with pytest.raises(error):  # an unexpected error still shows its traceback
                run_main(argv)
        assert len(seen) == calls + 1 and seen[-1] == [], "teardown not called, or called with a Trainer alive"

    leaves_cleanly(["--out-dir", str(run), "--resume", "--max-steps", "5", "--no-progress"], 0)  # success
    leaves_cleanly(["--out-dir", str(run), "--resume", "--batch-size", "3"], 2)  # an error return

    def interrupted(self):
        raise KeyboardInterrupt

    def crashed(self):
        raise RuntimeError("a bug")

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    leaves_cleanly(["--out-dir", str(run), "--resume", "--max-steps", "8"], 130)  # Ctrl-C
    monkeypatch.setattr(Trainer, "train_step", crashed)
    leaves_cleanly(["--out-dir", str(run), "--resume", "--max-steps", "8"], error=RuntimeError)
    assert len(trainers) == 4
