"""The tests every chapter's exercises must pass, written once: subclass ``ExerciseSuite`` in a chapter's test file.

    class TestChapter(ExerciseSuite):
        chapter, folder, wrong = ch03, "ch03-architecture", WRONG
        slow = {"generate_greedy"}  # (optional) exercises whose checks take seconds: their tests are marked slow

``wrong`` lists ``(exercise, wrong answer, the smallest failing input it must report, the hint it must
get)`` (or ``(exercise, wrong answer, hint)``). The suite checks that each worked answer (``tests/exercise_answers/<chapter>_solutions.py``)
passes, that each wrong answer fails with its input and hint, that every exercise has two wrong answers,
that the stubs (and the exercises notebook's stubs) read "not done yet", that the solutions notebook holds
the solutions file's answers, that an answer which learned one seed's cases by heart fails another seed's
(``memorising``), and that the command line passes the solutions file and reads an empty file as "not done yet".
"""

import ast
import functools
import hashlib
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch
from torch import nn

from llmscratch.exercises.__main__ import main
from llmscratch.exercises.checking import load_answers

ROOT = Path(__file__).resolve().parents[1]


def stub(*args, **kwargs):
    raise NotImplementedError


class Stub(nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()
        raise NotImplementedError


def solutions_path(chapter) -> Path:
    """The worked answers of a chapter's exercises (``chapter``: its module, e.g. llmscratch.exercises.ch03)."""
    return ROOT / "tests" / "exercise_answers" / f"{chapter.CHAPTER.name}_solutions.py"


@functools.cache
def solutions(chapter):
    """The chapter's solutions file, imported once."""
    return load_answers(solutions_path(chapter))


def answers_of(path: Path) -> dict[str, str]:
    """The solutions file's answers by name: its ``# %% name`` cells, else its top-level functions and classes."""
    text = path.read_text()
    chunks = text.split("\n# %% ")[1:]
    if chunks:
        return {chunk.split("\n", 1)[0]: chunk.split("\n", 1)[1].strip() for chunk in chunks}
    return {node.name: ast.get_source_segment(text, node) for node in ast.parse(text).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def code_cells(path: Path) -> list[nbformat.NotebookNode]:
    return [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]


# --------------------------------------------------------------------------- answers that learned cases by heart
PLAIN = (bool, int, float, complex, str, bytes, type(None))
SEEN_SEED, OTHER_SEED = 1, 2  # the seed whose cases a memorising answer learns, and another


def argument_key(value, seen: dict[int, object] | None = None) -> str:
    """A text equal for equal arguments, run after run, and different for different ones.

    Tensors go by their values, models by their weights and settings, functions by their name and what they
    close over, other objects by their public attributes.
    """
    seen = {} if seen is None else seen  # id -> the object, held so that no id is reused by a later one
    if isinstance(value, PLAIN + (torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().flatten()
        return f"tensor{tuple(value.shape)}{value.dtype}:{hashlib.sha1(data.view(torch.uint8).numpy()).hexdigest()}"
    if isinstance(value, torch.Generator):
        return f"generator:{argument_key(value.get_state())}"
    if id(value) in seen:  # met before in these arguments: a cycle, or the same object twice
        return "<again>"
    seen[id(value)] = value
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        if all(isinstance(item, PLAIN) for item in items):
            return repr(items)
        return f"{type(value).__name__}[{', '.join(argument_key(item, seen) for item in items)}]"
    if isinstance(value, dict):
        if all(isinstance(item, PLAIN) for pair in value.items() for item in pair):
            return repr(value)
        return "{" + ", ".join(f"{argument_key(k, seen)}: {argument_key(v, seen)}" for k, v in value.items()) + "}"
    if isinstance(value, nn.Module):
        settings = {name: _public(module) for name, module in value.named_modules()}
        weights = argument_key(value.state_dict(), seen)
        return f"module {type(value).__qualname__} {argument_key(settings, seen)} {weights}"
    if callable(value) and hasattr(value, "__code__"):  # a function: its name, what it closes over, its defaults
        cells = [cell.cell_contents for cell in value.__closure__ or ()]
        return (f"function {value.__module__}.{value.__qualname__} "
                f"{argument_key([cells, value.__defaults__, value.__kwdefaults__], seen)}")
    if hasattr(value, "__self__") and hasattr(value, "__func__"):  # a bound method
        return f"method {argument_key(value.__func__, seen)} of {argument_key(value.__self__, seen)}"
    if isinstance(value, type) or not hasattr(value, "__dict__"):
        return f"{type(value).__qualname__} {value!r}"
    return f"{type(value).__qualname__} {argument_key(_public(value), seen)}"


def _public(value) -> dict:
    """An object's attributes but those whose names start with "_" (caches, torch's own bookkeeping)."""
    return {name: item for name, item in vars(value).items() if not name.startswith("_")}


def memorising(worked, known: set[str], learn: bool):
    """The worked answer, wrapped so that it answers only the arguments in ``known`` (``learn``: it adds them).

    For a function, the arguments of each call; for a class, those it is built with and those of each forward
    call. It answers the arguments it knows by running the worked answer again, not by handing back a stored
    result: a check backpropagates through some results and reads what others did to the model.
    """
    def recall(arguments) -> None:
        key = argument_key(arguments)
        if learn:
            known.add(key)
        elif key not in known:
            raise LookupError("these arguments are none of those learned by heart")

    if not isinstance(worked, type):
        @functools.wraps(worked)
        def answer(*args, **kwargs):
            recall(("call", args, kwargs))
            return worked(*args, **kwargs)
        return answer

    class Memorising(worked):
        def __init__(self, *args, **kwargs):
            recall(("build", args, kwargs))
            super().__init__(*args, **kwargs)

        def forward(self, *args, **kwargs):
            recall(("forward", args, kwargs))
            return super().forward(*args, **kwargs)

    Memorising.__name__ = Memorising.__qualname__ = worked.__name__
    return Memorising


class ExerciseSuite:
    chapter = None  # the chapter's module, e.g. llmscratch.exercises.ch03
    folder = ""  # the chapter's folder, which holds exercises.ipynb and solutions.ipynb
    wrong: list = []
    slow: set = set()  # exercises whose checks train or generate for seconds: their tests are marked slow

    @classmethod
    def pytest_generate_tests(cls, metafunc):
        def marked(exercise: str, value):
            return pytest.param(value, marks=pytest.mark.slow) if exercise in cls.slow else value

        names = list(cls.chapter.CHAPTER.exercises)
        if "name" in metafunc.fixturenames:
            metafunc.parametrize("name", [marked(name, name) for name in names], ids=names)
        if "wrong_answer" in metafunc.fixturenames:
            metafunc.parametrize("wrong_answer", [marked(w[0], w) for w in cls.wrong],
                                 ids=[f"{w[0]}-{w[-1]}" for w in cls.wrong])

    @classmethod
    def verdict(cls, answer, name):
        return cls.chapter.CHAPTER.check(answer, name, quiet=True)

    @classmethod
    def rows(cls, stdout: str) -> dict[str, str]:
        exercises = cls.chapter.CHAPTER.exercises
        return {line.split()[0]: line for line in stdout.splitlines() if line and line.split()[0] in exercises}

    def test_the_worked_answer_passes(self, name):
        result = self.verdict(getattr(solutions(self.chapter), name), name)
        assert result.status == "passed", str(result)

    def test_a_wrong_answer_fails_with_its_hint(self, wrong_answer):
        name, answer, *smallest_input, hint = wrong_answer  # the smallest failing input may go unsaid
        smallest_input = smallest_input[0] if smallest_input else ""
        result = self.verdict(answer, name)
        assert result.status == "failed", str(result)
        assert "the check itself could not run" not in result.detail, str(result)
        case_line = next(line for line in result.detail.splitlines() if line.startswith("  input:"))
        assert smallest_input in case_line and hint in result.detail.split("  hint:")[-1], str(result)

    def test_every_exercise_has_two_wrong_answers_and_the_chapter_both_kinds_and_all_difficulties(self):
        exercises = self.chapter.CHAPTER.exercises.values()
        counts = {e.name: sum(w[0] == e.name for w in self.wrong) for e in exercises}
        assert min(counts.values()) >= 2, counts
        assert len(counts) >= 6 and {e.kind for e in exercises} == {"write it yourself", "extend the package"}
        assert {e.difficulty for e in exercises} == {"warm-up", "medium", "hard"}

    def test_the_stubs_read_not_done_yet(self):
        for name in self.chapter.CHAPTER.exercises:
            assert self.verdict(Stub if name[0].isupper() else stub, name).status == "not done yet", name

    def test_an_answer_that_learned_one_seeds_cases_by_heart_fails_another_seed(self, name):
        """Every check draws fresh cases: answering only the cases of one seed passes that seed and fails another."""
        known: set[str] = set()
        worked = getattr(solutions(self.chapter), name)
        check = functools.partial(self.chapter.CHAPTER.check, name=name, quiet=True)
        learning = check(memorising(worked, known, learn=True), seed=SEEN_SEED)
        assert learning.status == "passed", str(learning)
        answer = memorising(worked, known, learn=False)
        assert check(answer, seed=SEEN_SEED).status == "passed", "the learned cases must come back exactly"
        other = check(answer, seed=OTHER_SEED)
        assert other.status == "failed" and "none of those learned by heart" in other.detail, str(other)
        assert f"seed:     {OTHER_SEED} (its fresh cases are drawn again by check(your_answer, seed={OTHER_SEED})" \
            in other.detail, str(other)

    def test_the_exercises_notebook_stubs_read_not_done_yet(self):
        namespace: dict = {}
        for cell in code_cells(ROOT / self.folder / "exercises.ipynb"):
            if not cell.source.startswith("check("):
                exec(cell.source, namespace)
        for name in self.chapter.CHAPTER.exercises:
            assert self.verdict(namespace[name], name).status == "not done yet", name

    def test_the_solutions_notebook_has_the_same_answers_as_the_solutions_file(self):
        answers = answers_of(solutions_path(self.chapter))
        cells = code_cells(ROOT / self.folder / "solutions.ipynb")
        tagged = {cell.metadata["answer"]: cell.source.strip() for cell in cells if "answer" in cell.metadata}
        if tagged:  # each answer cell is tagged with its name in the metadata
            assert tagged == answers
            assert set(answers) == {"imports", *self.chapter.CHAPTER.exercises}
        else:  # each answer is in one of the notebook's code cells
            assert set(answers) == set(self.chapter.CHAPTER.exercises)
            sources = [cell.source.strip() for cell in cells]
            for name, source in answers.items():
                assert source in sources, f"the solutions notebook's cell for {name} differs from the solutions file"

    @pytest.mark.slow
    def test_the_command_line_passes_every_row_of_the_solutions_file(self):
        result = subprocess.run([sys.executable, "-m", "llmscratch.exercises", self.chapter.CHAPTER.name,
                                 str(solutions_path(self.chapter))], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert result.returncode == 0, result.stdout + result.stderr
        rows = self.rows(result.stdout)
        assert len(rows) == len(self.chapter.CHAPTER.exercises), result.stdout + result.stderr
        assert all(row.endswith("passed") for row in rows.values()), result.stdout

    @pytest.mark.slow
    def test_the_command_line_reads_an_empty_file_as_not_done_yet(self, tmp_path, capsys):
        (tmp_path / "empty.py").write_text("")
        assert main([self.chapter.CHAPTER.name, str(tmp_path / "empty.py")]) == 0
        rows = self.rows(capsys.readouterr().out)
        assert len(rows) == len(self.chapter.CHAPTER.exercises)
        assert all(row.endswith("not done yet") for row in rows.values()), rows
