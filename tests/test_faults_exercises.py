"""Answers that misbehave: the exercise checker must not hang, report a pass it did not check, or blame the wrong thing.

Each test is one fault (issue 27). The command line must always print its table, its exit status
must follow the verdicts (1 if one failed, 0 if none, 2 if the command or the answers file is
unusable), and each row must say what happened to that exercise. The checks run in a notebook
(``ch02.CHAPTER.check``) must turn the same faults into verdicts, against references the answer
cannot reach, and leave the reader's session as it was.
"""

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from exercise_suite import answers_of
from processes import run

import llmscratch.model.attention
from llmscratch.exercises import ch02, ch03
from llmscratch.exercises.__main__ import main
from llmscratch.exercises.checking import Chapter, attempt, expect_close, load_answers
from llmscratch.model.rope import RotaryEmbedding

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = answers_of(ROOT / "tests" / "exercise_answers" / "ch02_solutions.py")  # each answer's source, by name
sol = load_answers(ROOT / "tests" / "exercise_answers" / "ch02_solutions.py")
NAMES = list(ch02.CHAPTER.exercises)


def answers_file(folder: Path, *parts: str) -> Path:
    """``folder/answers.py`` for ch02, of ``parts``: the names of worked answers, or source text of the test's own."""
    path = folder / "answers.py"
    path.write_text("\n\n".join(SOLUTIONS.get(part, textwrap.dedent(part)) for part in ("imports", *parts)) + "\n")
    return path


def check_file(path: Path, *flags: str):
    """``python -m llmscratch.exercises ch02 path`` in a process of its own, killed after two minutes."""
    return run([sys.executable, "-m", "llmscratch.exercises", "ch02", str(path), *flags], timeout=120, cwd=ROOT)


def check_here(capfd, path: Path) -> tuple[int, str, str]:
    """The command line's exit status, stdout and stderr for ch02, its main() run here (the answers in a worker).

    Only for answers that cannot end this process should the checker break (no os._exit, no endless loop).
    """
    status = main(["ch02", str(path)])
    return (status, *capfd.readouterr())  # capfd, not capsys: the worker's prints would land there too


def rows(stdout: str) -> dict[str, str]:
    """The table's verdict by exercise name."""
    return {line.split()[0]: line.split(maxsplit=2)[2] for line in stdout.splitlines()
            if line.split() and line.split()[0] in NAMES and len(line.split()) >= 3}


def detail(stdout: str, name: str) -> str:
    """The indented lines under the table that explain ``name``'s failure."""
    after = stdout.partition(f"\n{name}: failed\n")[2]
    return "\n".join(itertools.takewhile(lambda line: line.startswith("  "), after.splitlines()))


# --------------------------------------------------------------------------- the command line
@pytest.fixture(scope="module")
def misbehaving(tmp_path_factory):
    """One run over answers that loop, exit and die, one after another, with right answers between them."""
    path = answers_file(tmp_path_factory.mktemp("misbehaving"), "causal_mask", """
        import os
        import sys

        def split_heads(x, n_heads):
            while True:
                pass

        def grouped_query_attention(q, k, v):
            sys.exit(0)

        def rope_interleaved(x, start_pos=0, theta=10_000.0):
            sys.exit("giving up")

        def attention_maps(model, idx):
            os._exit(0)
        """)
    return check_file(path, "--time-limit", "5")


@pytest.mark.slow
def test_an_endless_loop_in_an_answer_fails_that_exercise_and_the_others_are_still_checked(misbehaving):
    assert misbehaving.returncode == 1, misbehaving.stdout + misbehaving.stderr
    assert rows(misbehaving.stdout)["split_heads"] == "failed"
    assert "within 5 s" in detail(misbehaving.stdout, "split_heads")
    assert rows(misbehaving.stdout)["causal_mask"] == "passed"


@pytest.mark.slow
def test_sys_exit_0_in_an_answer_fails_it_instead_of_ending_the_checker_with_status_0(misbehaving):
    assert rows(misbehaving.stdout)["grouped_query_attention"] == "failed" and misbehaving.returncode == 1
    assert "sys.exit(0)" in detail(misbehaving.stdout, "grouped_query_attention")


@pytest.mark.slow
def test_sys_exit_with_a_message_in_an_answer_fails_it(misbehaving):
    assert rows(misbehaving.stdout)["rope_interleaved"] == "failed"
    assert "sys.exit('giving up')" in detail(misbehaving.stdout, "rope_interleaved")


@pytest.mark.slow
def test_os_exit_in_an_answer_fails_it_and_a_fresh_process_checks_the_rest(misbehaving):
    assert rows(misbehaving.stdout)["attention_maps"] == "failed"
    assert "exit status 0" in detail(misbehaving.stdout, "attention_maps")
    assert [rows(misbehaving.stdout)[name] for name in ("QKNormAttention", "SlidingWindowAttention")] == [
        "not done yet", "not done yet"]  # checked by a fresh process


def expect_unloadable(status: int, out: str, err: str, reason: str) -> None:
    """Exit status 2, the table with every row failed, and the reason (what it names) on stderr."""
    assert status == 2, out + err
    assert rows(out) == {name: "failed" for name in NAMES}, out
    assert re.search(rf"answers\.py does not run: .*{re.escape(reason)}", err), err


@pytest.mark.slow
def test_an_endless_loop_at_import_fails_every_row_and_says_so(tmp_path):
    result = check_file(answers_file(tmp_path, "causal_mask", "while True:\n    pass"), "--time-limit", "5")
    expect_unloadable(result.returncode, result.stdout, result.stderr, "within 5 s")


@pytest.mark.slow
def test_os_exit_at_import_fails_every_row_and_says_so(tmp_path):
    result = check_file(answers_file(tmp_path, "causal_mask", "import os\nos._exit(0)"))
    expect_unloadable(result.returncode, result.stdout, result.stderr, "exit status 0")


def worker_of(checker: int) -> int:
    """The pid of the checker's worker process (read from Linux's /proc)."""
    for child in Path(f"/proc/{checker}/task/{checker}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():  # not multiprocessing's resource tracker
            return int(child)
    raise AssertionError(f"the checker (pid {checker}) has no worker")


def running(pid: int) -> bool:
    """True while process ``pid`` runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:  # (no such process)
        return False


def wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.2)
    return condition()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the worker in Linux's /proc")
@pytest.mark.slow
def test_a_worker_stuck_in_an_answer_ends_when_the_checker_is_killed(tmp_path):
    started = tmp_path / "started"
    path = answers_file(tmp_path, f"open({str(started)!r}, 'w').close()\nwhile True:\n    pass")
    command = [sys.executable, "-m", "llmscratch.exercises", "ch02", str(path)]
    with subprocess.Popen(command, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL) as checker:
        try:
            assert wait_until(started.exists, 90), "the answers never started loading"
            worker = worker_of(checker.pid)
            checker.kill()  # as a CI timeout or an IDE's stop button may: the parent alone, at once
            checker.wait()
            assert wait_until(lambda: not running(worker), 20), "the worker outlived the checker"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(checker.pid, signal.SIGKILL)  # whatever is left of its process group


@pytest.mark.parametrize("code", ["0", "'not today'"])
def test_sys_exit_at_import_fails_every_row_and_says_so(tmp_path, capfd, code):
    expect_unloadable(*check_here(capfd, answers_file(tmp_path, "causal_mask", f"import sys\nsys.exit({code})")),
                      f"it called sys.exit({code}) while loading")


def test_answers_that_patch_the_package_at_import_cannot_change_the_references(tmp_path, capfd):
    # a reader who switched the package's mask off and RoPE's rotation while experimenting, and left it so
    path = answers_file(tmp_path, "causal_mask", "grouped_query_attention", "rope_interleaved", """
        import llmscratch.model.attention
        import llmscratch.model.rope

        llmscratch.model.attention.causal_mask = lambda q_len, kv_len, device=None: torch.ones(q_len, kv_len).bool()
        llmscratch.model.rope.RotaryEmbedding.forward = lambda self, x, start_pos=0, *, positions=None: x
        """)
    status, out, _ = check_here(capfd, path)
    assert status == 0, out
    assert [rows(out)[name] for name in NAMES[:4]] == ["passed", "not done yet", "passed", "passed"], out


@pytest.mark.parametrize("notebook, verdict", [("solutions.ipynb", "passed"), ("exercises.ipynb", "not done yet")])
@pytest.mark.slow
def test_the_chapters_notebook_is_an_answers_file(capfd, notebook, verdict):
    status, out, _ = check_here(capfd, ROOT / "ch02-attention" / notebook)
    assert status == 0 and out.startswith("ch02: Attention\n"), out  # its own check(...) calls neither run nor print
    assert rows(out) == {name: verdict for name in NAMES}, out


def test_a_notebooks_magics_shell_lines_and_check_calls_are_left_out(tmp_path):
    cells = ["%matplotlib inline\nimport torch", "!pip list", "%%bash\necho hello", SOLUTIONS["causal_mask"],
             "check(causal_mask)\nif True:\n    %time causal_mask(1, 1)"]
    notebook = {"cells": [{"cell_type": "code", "source": source, "metadata": {}, "outputs": []} for source in cells]
                + [{"cell_type": "markdown", "source": "check(nothing)", "metadata": {}}],
                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "mine.ipynb").write_text(json.dumps(notebook))
    module = load_answers(tmp_path / "mine.ipynb")  # check is not defined here: a check call left in would raise
    assert ch02.CHAPTER.check(module.causal_mask, quiet=True).status == "passed"


def test_a_notebook_that_does_not_run_names_its_cell(tmp_path):
    notebook = {"cells": [{"cell_type": "code", "source": ["x = 1\n", "def f(:\n"], "metadata": {}}]}
    (tmp_path / "mine.ipynb").write_text(json.dumps(notebook))
    with pytest.raises(SyntaxError, match=r"mine.ipynb, cell 1"):
        load_answers(tmp_path / "mine.ipynb")


@pytest.mark.parametrize("given, message", [
    ("folder", "folder is a folder"),
    ("answers.txt", "answers.txt is neither"),
])
def test_a_folder_or_another_kind_of_file_gets_told_what_to_give(tmp_path, capsys, given, message):
    (tmp_path / "folder").mkdir()
    (tmp_path / "answers.txt").write_text("def causal_mask(q_len, kv_len):\n    pass\n")
    with pytest.raises(SystemExit) as exit:
        main(["ch02", str(tmp_path / given)])
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_a_time_limit_must_be_a_positive_number_of_seconds(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["ch02", str(answers_file(tmp_path)), "--time-limit", "0"])
    assert exit.value.code == 2 and re.search(r"error: .*--time-limit.* 0\b", capsys.readouterr().err)


@pytest.mark.slow
def test_processes_an_answer_starts_end_with_the_check(tmp_path):
    pids = tmp_path / "pids.txt"
    result = check_file(answers_file(tmp_path, "causal_mask", f"""
        import subprocess

        def split_heads(x, n_heads):
            with open({str(pids)!r}, "a") as f:
                f.write(f"{{subprocess.Popen(['sleep', '300']).pid}}\\n")
            return x
        """), "--time-limit", "30")
    assert result.returncode == 1 and rows(result.stdout)["causal_mask"] == "passed", result.stdout + result.stderr
    started = [int(pid) for pid in pids.read_text().split()]
    assert started and not [pid for pid in started if running(pid)]  # none left behind by the checker


def test_answers_to_another_chapter_get_a_hint_naming_it(capfd):
    ch03_answers = ROOT / "tests" / "exercise_answers" / "ch03_solutions.py"
    status, out, _ = check_here(capfd, ch03_answers)
    assert status == 1 and rows(out) == {name: "not done yet" for name in NAMES}  # the wrong chapter: no pass
    assert re.search(rf"ch02.* {len(ch03.CHAPTER.exercises)} of ch03", out)  # every one of chapter 3's (9)
    assert f"\n  python -m llmscratch.exercises ch03 {ch03_answers}\n" in out


def test_an_answer_calling_the_function_it_rebuilds_fails_in_the_worker_with_a_hint(tmp_path, capfd):
    answers = tmp_path / "answers.py"
    answers.write_text("from llmscratch.model import attention\n\n\ndef causal_mask(q_len, kv_len):\n"
                       "    return attention.causal_mask(q_len, kv_len)\n")
    status, out, _ = check_here(capfd, answers)
    assert status == 1 and rows(out)["causal_mask"] == "failed", out
    assert "hint:     write it without causal_mask" in detail(out, "causal_mask"), out
    answers.write_text("from llmscratch.model.attention import causal_mask\n")  # the library's own, as the answer
    status, out, _ = check_here(capfd, answers)
    assert status == 1 and "hint:     write it without causal_mask" in detail(out, "causal_mask"), out


def test_answers_can_import_their_neighbours(tmp_path, capfd):
    (tmp_path / "my_mask_helpers.py").write_text(SOLUTIONS["imports"] + "\n\n" + SOLUTIONS["causal_mask"] + "\n")
    answers = tmp_path / "answers.py"
    answers.write_text("from my_mask_helpers import causal_mask\n")
    status, out, _ = check_here(capfd, answers)  # from the repository root, not the answers' folder
    assert status == 0 and rows(out)["causal_mask"] == "passed", out


# --------------------------------------------------------------------------- the checks, as a notebook runs them
def all_visible(q_len, kv_len, device=None):
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device)


def test_a_patch_made_inside_an_answer_cannot_change_the_references_and_is_undone(monkeypatch):
    attention = llmscratch.model.attention
    monkeypatch.setattr(attention, "causal_mask", attention.causal_mask)  # put back at the end

    def grouped_query_attention(q, k, v):
        llmscratch.model.attention.causal_mask = all_visible  # the answer tampers, yet computes right
        return sol.grouped_query_attention(q, k, v)

    original = llmscratch.model.attention.causal_mask
    assert ch02.CHAPTER.check(grouped_query_attention, quiet=True).status == "passed"
    assert llmscratch.model.attention.causal_mask is original


def test_the_readers_own_patches_do_not_reach_the_references_and_are_kept(monkeypatch):
    def no_rotation(self, x, start_pos=0, *, positions=None):
        return x

    monkeypatch.setattr(llmscratch.model.attention, "causal_mask", all_visible)
    monkeypatch.setattr(RotaryEmbedding, "forward", no_rotation)
    assert ch02.CHAPTER.check(sol.grouped_query_attention, quiet=True).status == "passed"
    assert ch02.CHAPTER.check(sol.rope_interleaved, quiet=True).status == "passed"
    assert llmscratch.model.attention.causal_mask is all_visible and RotaryEmbedding.forward is no_rotation


def test_grad_mode_or_dtype_switched_by_one_answer_does_not_fail_the_next():
    def causal_mask(q_len, kv_len):
        torch.set_grad_enabled(False)  # left off after an experiment
        torch.set_default_dtype(torch.float64)
        return sol.causal_mask(q_len, kv_len)

    try:
        assert ch02.CHAPTER.check(causal_mask, quiet=True).status == "passed"
        verdict = ch02.CHAPTER.check(sol.QKNormAttention, quiet=True)  # it backpropagates through the answer
        assert verdict.status == "passed", str(verdict)
        assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32  # the reader's, as they were
    finally:
        torch.set_grad_enabled(True)
        torch.set_default_dtype(torch.float32)


def test_the_checks_run_under_torchs_defaults_and_give_the_reader_theirs_back():
    torch.set_grad_enabled(False)  # as a reader's notebook may leave it after an inference cell
    try:
        assert ch02.CHAPTER.check(sol.QKNormAttention, quiet=True).status == "passed"
        assert not torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(True)


@pytest.mark.parametrize("name, answer, hint", [
    ("causal_mask", lambda q_len, kv_len: all_visible(q_len, kv_len, "meta").tril(kv_len - q_len),
     "your result is on the meta device: it has no values"),
    ("grouped_query_attention", lambda q, k, v: torch.empty_like(q, device="meta"),
     "your result is on the meta device: it has no values"),
    ("causal_mask", lambda q_len, kv_len: all_visible(q_len, kv_len).tril(kv_len - q_len).to_sparse(),
     "your result is not an ordinary tensor (sparse, nested or quantized): return a dense one"),
])
def test_a_result_without_readable_values_fails_with_a_hint_not_a_broken_check(name, answer, hint):
    verdict = ch02.CHAPTER.check(answer, name, quiet=True)
    assert verdict.status == "failed" and "the check itself could not run" not in verdict.detail, str(verdict)
    assert f"hint:     {hint}" in verdict.detail


class Opaque:
    def __repr__(self):
        raise RuntimeError("no repr today")


@pytest.mark.parametrize("result, got", [
    (torch.tensor([1, 2]), "got:      tensor([1, 2])"),  # a tensor where a number is expected: no single truth value
    (Opaque(), "got:      an object of type Opaque (its repr raised RuntimeError)"),
])
def test_a_result_of_an_unexpected_kind_fails_with_what_came_back(result, got):
    verdict = ch03.CHAPTER.check(lambda config: result, "parameter_count", quiet=True)
    assert verdict.status == "failed" and got in verdict.detail, str(verdict)


def test_a_module_without_forward_fails_instead_of_reading_not_done_yet():
    class SlidingWindowAttention(torch.nn.Module):
        def __init__(self, attention, window):
            super().__init__()
            self.attention, self.window = attention, window

        def foward(self, x, rope=None, kv_cache=None, start_pos=0, *, input_pos=None):  # misspelt
            return self.attention(x, rope, kv_cache, start_pos, input_pos=input_pos)

    verdict = ch02.CHAPTER.check(SlidingWindowAttention, quiet=True)
    assert verdict.status == "failed" and 'missing the required "forward" function' in verdict.detail, str(verdict)


def test_sys_exit_in_an_answer_is_a_verdict_and_ctrl_c_still_stops_the_check():
    def causal_mask(q_len, kv_len):
        sys.exit(0)

    verdict = ch02.CHAPTER.check(causal_mask, quiet=True)
    assert verdict.status == "failed" and "your code called sys.exit(0)" in verdict.detail

    def interrupted(q_len, kv_len):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ch02.CHAPTER.check(interrupted, "causal_mask", quiet=True)


def double_checked() -> Chapter:
    toy = Chapter("toy", "a chapter for testing the time limit")

    @toy.exercise("double", title="Double a tensor", difficulty="warm-up", section="1", kind="write it yourself")
    def check_double(answer):
        x = torch.arange(3.0)
        expect_close(attempt(answer, x, case="x = [0, 1, 2]"), 2 * x, case="x = [0, 1, 2]", hint="x * 2")
        return 1

    return toy


def endless(x):
    while True:
        pass


def stubborn(x):
    while True:
        try:
            time.sleep(0.01)
        except Exception:  # swallows every error it can
            pass


@pytest.mark.parametrize("answer", [endless, stubborn])
def test_an_endless_answer_in_a_notebook_fails_at_the_time_limit_and_leaves_no_timer(answer):
    handler = signal.getsignal(signal.SIGALRM)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    verdict = double_checked().check(answer, "double", quiet=True, time_limit=0.5)
    assert verdict.status == "failed" and verdict.detail == "  did not finish within 0.5 s (an endless loop?)"
    assert signal.getsignal(signal.SIGALRM) is handler and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert torch.equal(torch.rand(3), expected)  # the reader's random stream, as it was
    assert double_checked().check(lambda x: x * 2, "double", quiet=True, time_limit=0.5).status == "passed"
