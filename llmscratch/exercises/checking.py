"""How an exercise is checked: run the reader's answer case by case, stop at the first wrong one, say why.

A chapter's checkers (``llmscratch.exercises.ch01`` ... ``ch07``) register each exercise with
``Chapter.exercise``. A checker calls the reader's answer through ``attempt`` and compares with
``expect_equal`` / ``expect_close``, smallest case first, so the first ``Mismatch`` raised is the
smallest failing input. ``Chapter.check`` turns the outcome into a ``Verdict`` and prints it; it
never raises, so a notebook keeps running whatever the answer does.

The answer cannot move the goalposts: a check runs against the package as the exercises loaded it
(an answer that replaced ``llmscratch.model.attention.causal_mask`` or ``GPT.forward`` gets the originals
put back after each call, and its own after the check), under torch's default switches, within a
time limit. ``load_answers`` reads a reader's answers file, a ``.py`` file or an exercises notebook.
"""

import ast
import contextlib
import contextvars
import json
import math
import secrets
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmscratch.exercises.isolation import (PACKAGE, TIME_LIMIT, ForbiddenCall, TimeLimitExceeded, TorchSwitches,
                                            forbidden, package_as_loaded, resolve, shown, time_limited, too_slow)

__all__ = ["Chapter", "Exercise", "Mismatch", "NotDone", "Verdict", "answers_path", "attempt", "describe", "diagnose",
           "diagnose_nonfinite", "expect_close", "expect_equal", "fresh_generator", "load_answers", "number_of",
           "random_bool", "random_float", "random_int", "random_seed"]

DIFFICULTIES = ("warm-up", "medium", "hard")
KINDS = ("write it yourself", "extend the package")
BOOL_HINT = ("return booleans (dtype torch.bool), not 0/1 numbers nor an additive mask of 0 and -inf: a comparison "
             "gives booleans, and masked_fill and SDPA take a boolean mask")
EXIT_HINT = "return your result: sys.exit ends the whole program, which here reads as a failure"
# this check's seed, and whether fresh cases were drawn from it
_FRESH: contextvars.ContextVar[dict] = contextvars.ContextVar("fresh")
_FORBIDDEN: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("forbidden", default=())


class Mismatch(Exception):
    """The smallest failing case: its input, what was expected, what came back, and the usual mistake."""

    def __init__(self, case: str, expected: Any, got: Any, hint: str):
        super().__init__(case)
        self.case, self.expected, self.got, self.hint = case, expected, got, hint

    def report(self) -> str:
        return (f"  input:    {self.case}\n  expected: {_text(self.expected)}\n  got:      {_text(self.got)}\n"
                f"  hint:     {self.hint}")


class NotDone(Exception):
    """The answer is still the stub (it raised a bare NotImplementedError, not one of torch's with a message)."""


@dataclass(frozen=True)
class Exercise:
    """One exercise: the name the reader's answer goes by, where it sits in the chapter, and its checker."""

    name: str  # the function (or class) the reader defines, e.g. "causal_mask"
    title: str
    difficulty: str  # one of DIFFICULTIES
    section: str  # the notebook section it follows
    kind: str  # one of KINDS
    checker: Callable[[Any], int] = field(repr=False)  # raises Mismatch; returns the number of cases passed
    forbidden: tuple[str, ...] = ()  # dotted paths of what the answer must rebuild, not call ("torch.nn.functional.x")


@dataclass(frozen=True)
class Verdict:
    exercise: Exercise
    status: str  # "passed", "failed" or "not done yet"
    detail: str = ""

    def __str__(self) -> str:
        head = f"{self.exercise.name}: {self.status}"
        return f"{head} {self.detail}" if self.status == "passed" else f"{head}\n{self.detail}".rstrip()


class Chapter:
    """The exercises of one chapter, in the order the notebook asks them."""

    def __init__(self, name: str, title: str):
        self.name, self.title = name, title
        self.exercises: dict[str, Exercise] = {}
        PACKAGE.add_loaded()  # the chapter's references are loaded by now: remember them as they are

    def exercise(self, name: str, *, title: str, difficulty: str, section: str, kind: str,
                 forbidden: Iterable[str] = ()):
        """Decorator: register ``checker(answer) -> cases passed`` as the check of exercise ``name``.

        ``forbidden``: the functions (or classes) the answer is to rebuild, which raise while it runs.
        """
        if difficulty not in DIFFICULTIES or kind not in KINDS or name in self.exercises:
            raise ValueError(f"exercise {name!r}: difficulty {difficulty!r} must be one of {DIFFICULTIES}, "
                             f"kind {kind!r} one of {KINDS}, and the name new in {self.name}")
        forbidden = tuple(forbidden)
        for path in forbidden:
            resolve(path)  # a misspelt path fails here, when the chapter loads, not in a reader's check

        def register(checker: Callable[[Any], int]) -> Callable[[Any], int]:
            self.exercises[name] = Exercise(name, title, difficulty, section, kind, checker, forbidden)
            return checker

        return register

    def check(self, answer: Any, name: str | None = None, *, quiet: bool = False,
              time_limit: float | None = TIME_LIMIT, seed: int | None = None) -> Verdict:
        """Check the reader's ``answer`` (found by its ``__name__`` unless ``name`` is given); print the verdict.

        Beside its fixed cases a check draws fresh ones from ``seed`` (None: a new seed each time,
        which a failure prints, so that ``check(answer, seed=...)`` replays it).

        A check still running after ``time_limit`` seconds fails, where a timer can stop it (see
        ``isolation.time_limited``: a notebook's kernel on Linux or macOS, not Windows).
        """
        name = name or getattr(answer, "__name__", None)
        if name not in self.exercises:
            raise KeyError(f"{self.name} has no exercise named {name!r}; its exercises are {list(self.exercises)}")
        verdict = _judge(self.exercises[name], answer, time_limit, secrets.randbelow(2**31) if seed is None else seed)
        if not quiet:
            print(verdict)
        return verdict

    def table(self, verdicts: Iterable[Verdict]) -> str:
        """The verdicts as a text table, the details of the failures below it."""
        verdicts = list(verdicts)
        width = max([len("exercise")] + [len(v.exercise.name) for v in verdicts])
        lines = [f"{self.name}: {self.title}", f"{'exercise':<{width}}  {'difficulty':<10}  verdict",
                 f"{'-' * width}  {'-' * 10}  {'-' * 12}"]
        lines += [f"{v.exercise.name:<{width}}  {v.exercise.difficulty:<10}  {v.status}" for v in verdicts]
        failures = [str(v) for v in verdicts if v.status == "failed" and v.detail]
        return "\n".join(lines + ([""] + failures if failures else []))


def _judge(exercise: Exercise, answer: Any, time_limit: float | None, seed: int) -> Verdict:
    if answer is None:
        return Verdict(exercise, "not done yet", "  (no answer of this name found)")
    forbidding = _FORBIDDEN.set(exercise.forbidden)  # attempt takes them away while the answer runs
    fresh = {"seed": seed, "drawn": False}
    seeding = _FRESH.set(fresh)
    try:
        # fork_rng: the reader's notebook keeps its random stream; the limit is inside it, so that
        # the stream is put back even when the time runs out
        with package_as_loaded(), torch.random.fork_rng(devices=[]), time_limited(time_limit):
            passed = exercise.checker(answer)
    except ForbiddenCall as call:  # a forbidden function the answer kept and called outside attempt
        return Verdict(exercise, "failed", f"  hint:     {_forbidden_hint(call.name)}")
    except TimeLimitExceeded:
        return Verdict(exercise, "failed", f"  {too_slow(time_limit)}")
    except NotDone:
        return Verdict(exercise, "not done yet", "  (the stub still raises NotImplementedError)")
    except Mismatch as mismatch:
        replay = (f"\n  seed:     {seed} (its fresh cases are drawn again by check(your_answer, seed={seed}), "
                  f"or by --seed {seed} on the command line)" if fresh["drawn"] else "")
        return Verdict(exercise, "failed", mismatch.report() + replay)
    except SystemExit as exit:  # from the answer's code outside attempt (its module's methods, say)
        return Verdict(exercise, "failed", f"  your code called sys.exit({exit.code!r}); {EXIT_HINT}")
    except Exception as err:  # a bug in a checker must not stop the reader's notebook either
        return Verdict(exercise, "failed", f"  the check itself could not run: {type(err).__name__}: {err}")
    finally:
        _FORBIDDEN.reset(forbidding)
        _FRESH.reset(seeding)
    return Verdict(exercise, "passed", f"({passed} cases)")


def fresh_generator() -> torch.Generator:
    """A private generator for the cases drawn fresh each check (an answer cannot learn them by heart).

    Seeded from the check's seed, which a failure prints; outside a check, seed 0.
    """
    fresh = _FRESH.get({"seed": 0, "drawn": False})
    fresh["drawn"] = True
    return torch.Generator().manual_seed(fresh["seed"])


def random_int(generator: torch.Generator, low: int, high: int) -> int:
    """An int drawn uniformly from ``low .. high``, both included."""
    return int(torch.randint(low, high + 1, (), generator=generator))


def random_bool(generator: torch.Generator) -> bool:
    """True or False, each half the time."""
    return random_int(generator, 0, 1) == 1


def random_seed(generator: torch.Generator) -> int:
    """A seed for a fresh case's own weights or samples (``torch.manual_seed``, ``Generator.manual_seed``)."""
    return random_int(generator, 0, 2**31 - 1)


def random_float(generator: torch.Generator, low: float, high: float, digits: int = 2) -> float:
    """A float drawn uniformly from [low, high], rounded to ``digits`` decimals (so that a case prints short)."""
    return round(low + (high - low) * float(torch.rand((), generator=generator)), digits)


def attempt(answer: Callable, *args: Any, case: str, errors: dict[str, str] | None = None,
            nonfinite_cast: str | None = None, **kwargs: Any) -> Any:
    """``answer(*args, **kwargs)`` inside a check; an exception it raises becomes a Mismatch naming the case.

    errors maps a text to a hint: an exception whose message holds the text gets that hint (the
    usual mistake behind, say, "size of tensor"), any other the general one. ``nonfinite_cast``: the
    hint of an answer that casts NaN or inf to an integer dtype (0 / 0 by a zero scale: undefined, whatever
    the result). Whatever the answer changed in the package or in torch's switches is put back before the
    checker goes on. The functions the exercise asks the reader to rebuild raise while the answer runs
    (``forbidden``).
    """
    switches = TorchSwitches.now()
    casts = _NonFiniteCasts() if nonfinite_cast else contextlib.nullcontext()
    try:
        with forbidden(_FORBIDDEN.get(), answer), casts:
            result = answer(*args, **kwargs)
    except ForbiddenCall as call:
        raise Mismatch(case, "your own computation", f"a call of {shown(call.name)}",
                       _forbidden_hint(call.name)) from None
    except SystemExit as exit:
        raise Mismatch(case, "a result", f"your code called sys.exit({exit.code!r})", EXIT_HINT) from None
    except Exception as err:
        if isinstance(err, NotImplementedError) and not str(err):  # the stub's bare raise, not torch's
            raise NotDone from None
        got = f"{type(err).__name__}: {err}"
        hint = next((hint for text, hint in (errors or {}).items() if text in got),
                    "your code raised an exception on this input (read the message above)")
        raise Mismatch(case, "a result", got, hint) from None
    finally:
        PACKAGE.restore()
        switches.restore()
    if problem := _unreadable(result):  # caught here, before a checker's own code trips over it
        raise Mismatch(case, "a tensor of values", describe(result), problem)
    if nonfinite_cast and casts.seen:
        raise Mismatch(case, "integers made from finite numbers", "NaN or inf cast to an integer dtype", nonfinite_cast)
    return result


class _NonFiniteCasts(TorchDispatchMode):
    """Notes whether an integer tensor was made from floats holding NaN or inf (NaN's integer is undefined)."""

    CASTS = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)

    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.CASTS and not self.seen:
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            self.seen = (isinstance(out, torch.Tensor) and _is_integer(out) and isinstance(source, torch.Tensor)
                         and source.is_floating_point() and not bool(source.isfinite().all()))
        return out


def _forbidden_hint(path: str) -> str:
    return f"write it without {shown(path)}: rebuilding it from simpler operations is the exercise"


def expect_equal(got: Any, expected: Any, *, case: str, hint: str, dtype: torch.dtype | None = None) -> None:
    """Mismatch unless ``got == expected`` (tensors: same shape and every element equal).

    ``dtype``: the floating dtype the exercise's spec names, which ``got`` must have exactly (integer dtypes
    are always checked exactly; floating ones only where the spec names one, as a float64 reference stands
    for any float).
    """
    if isinstance(expected, torch.Tensor):
        _expect_tensor(got, expected, case, hint, atol=0.0, rtol=0.0, dtype=dtype)
    elif not _equal(got, expected):
        raise Mismatch(case, expected, got, hint)


def expect_close(got: Any, expected: Any, *, case: str, hint: str, atol: float = 1e-5, rtol: float = 1e-4,
                 dtype: torch.dtype | None = None) -> None:
    """Mismatch unless ``got`` is a tensor (or float) of ``expected``'s shape, equal within atol + rtol * |expected|.

    ``dtype``: the floating dtype the spec names, checked exactly (see ``expect_equal``).
    """
    if isinstance(expected, torch.Tensor):
        _expect_tensor(got, expected, case, hint, atol=atol, rtol=rtol, dtype=dtype)
    elif not (isinstance(got, (int, float)) and math.isclose(got, expected, rel_tol=rtol, abs_tol=atol)):
        raise Mismatch(case, expected, got, hint)


def _equal(got: Any, expected: Any) -> bool:
    try:
        return bool(got == expected)
    except Exception:  # a tensor against a list, say: no single truth value, so not equal
        return False


def _expect_tensor(got: Any, expected: torch.Tensor, case: str, hint: str, atol: float, rtol: float,
                   dtype: torch.dtype | None = None) -> None:
    if not isinstance(got, torch.Tensor):
        raise Mismatch(case, describe(expected), f"a {type(got).__name__}, not a tensor", hint)
    if problem := _unreadable(got):
        raise Mismatch(case, describe(expected), describe(got), problem)
    if got.shape != expected.shape:
        raise Mismatch(case, f"shape {tuple(expected.shape)}", f"shape {tuple(got.shape)}",
                       f"the shape is wrong; {hint}")
    if expected.dtype == torch.bool and got.dtype != torch.bool:  # a 0/1 or 0/-inf mask: its values say nothing yet
        raise Mismatch(case, f"dtype {expected.dtype}", f"dtype {got.dtype}", BOOL_HINT)
    if _kind(got) != _kind(expected):
        raise Mismatch(case, f"dtype {expected.dtype}", f"dtype {got.dtype}", hint)
    if _is_integer(expected) and got.dtype != expected.dtype:  # int32 ids compare equal, yet cross_entropy refuses them
        raise Mismatch(case, f"dtype {expected.dtype}", f"dtype {got.dtype}", _integer_dtype_hint(expected.dtype))
    if dtype is not None and got.dtype != dtype:
        raise Mismatch(case, f"dtype {dtype}", f"dtype {got.dtype}",
                       f"the result must be exactly {dtype}, as the exercise says: convert with .to({dtype})")
    got_d, expected_d = got.detach().cpu().double(), expected.detach().cpu().double()
    bad = ~torch.isclose(got_d, expected_d, atol=atol, rtol=rtol, equal_nan=True)
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise Mismatch(case, describe(expected) + f", at {where}: {expected_d[where].item():.6g}",
                       describe(got) + f", at {where}: {got_d[where].item():.6g} "
                                       f"({int(bad.sum())} of {bad.numel()} elements differ)", hint)


def _kind(tensor: torch.Tensor) -> tuple[bool, bool, bool]:
    """Floating, complex, boolean: what a float64 reference and a float32 answer share."""
    return tensor.is_floating_point(), tensor.is_complex(), tensor.dtype == torch.bool


def _is_integer(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)


def _integer_dtype_hint(dtype: torch.dtype) -> str:
    """The hint of an integer tensor of another integer dtype: the dtype is checked exactly."""
    if dtype == torch.long:
        return ("integer tensors must be exactly torch.long (int64): F.cross_entropy refuses int32 targets and "
                "indexing wants int64; make them with dtype=torch.long")
    return f"the dtype must be exactly {dtype}: make the tensor with dtype={dtype}"


def _unreadable(value: Any) -> str | None:
    """Why a tensor result (or one in the tuple, list or dict it is) holds no values to compare; None if it does."""
    parts = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else [value]
    for part in parts:
        if not isinstance(part, torch.Tensor):
            continue
        if part.is_meta:
            return ("your result is on the meta device: it has no values (make it from the inputs, "
                    "e.g. on x.device)")
        if part.is_nested or part.is_quantized or part.layout != torch.strided:
            return "your result is not an ordinary tensor (sparse, nested or quantized): return a dense one"
    return None


def diagnose(got: Any, mistakes: dict[str, Callable[[], Any]], default: str, atol: float = 1e-5) -> str:
    """The hint of the first usual mistake whose result ``got`` reproduces, else ``default``.

    Booleans reproduce only booleans: a float mask of the same 0s and 1s is a mistake of its own.
    """
    for hint, wrong in mistakes.items():
        try:
            value = wrong()
            if isinstance(value, torch.Tensor):
                if (isinstance(got, torch.Tensor) and got.shape == value.shape
                        and (got.dtype == torch.bool) == (value.dtype == torch.bool) and torch.allclose(
                        got.detach().double().cpu(), value.double().cpu(), atol=atol, equal_nan=True)):
                    return hint
            elif got == value:
                return hint
        except Exception:  # a mistake that cannot be computed for this case just does not match
            continue
    return default


def diagnose_nonfinite(got: Any, mistakes: dict[str, Callable[[], Any]], default: str, *, hint: str,
                       nan_only: bool = False) -> str:
    """``hint`` when ``got`` is a float tensor holding NaN (or inf, unless ``nan_only``), else ``diagnose``'s hint.

    A non-finite result has a usual cause of its own. Only an inf one may still be a listed mistake's (a
    library function that gives inf for large logits, say): a NaN would match any mistake that is NaN there.
    """
    if isinstance(got, torch.Tensor) and not _unreadable(got) and got.is_floating_point():
        if got.isnan().any():
            return hint
        if not nan_only and not got.isfinite().all():
            return diagnose(got, mistakes, "") or hint
    return diagnose(got, mistakes, default)


def describe(value: Any, limit: int = 8) -> str:
    """A short, readable account of a value: small tensors in full, large ones by shape and first values."""
    if isinstance(value, torch.Tensor) and _unreadable(value):
        return f"a tensor of layout {value.layout} on the {value.device} device, with no values to show"
    if isinstance(value, torch.Tensor):
        flat = value.detach().flatten()
        head = ", ".join(f"{x:.4g}" if value.is_floating_point() else str(x) for x in flat[:limit].tolist())
        more = ", ..." if flat.numel() > limit else ""
        return f"tensor of shape {tuple(value.shape)} [{head}{more}]"
    return _text(value)


def number_of(got: Any, case: str, what: str) -> float:
    """``got`` as a float (a Python number or a one-element tensor), else a Mismatch saying ``what`` was expected."""
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        return got.item()
    if isinstance(got, (int, float)) and not isinstance(got, bool):
        return float(got)
    raise Mismatch(case, what, describe(got), f"return {what}")


def _text(value: Any, limit: int = 200) -> str:
    try:
        text = value if isinstance(value, str) else repr(value)
    except Exception as err:  # the answer's own class, its __repr__ broken: say what it is instead
        text = f"an object of type {type(value).__name__} (its repr raised {type(err).__name__})"
    return text if len(text) <= limit else text[: limit - 5] + " ...'"


# --------------------------------------------------------------------------- the reader's answers file
def answers_path(path: str | Path) -> Path:
    """``path`` if it names an answers file (.py or .ipynb); else an OSError or ValueError saying what to give."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; give the .py file or exercises notebook (.ipynb) "
                                "with your answers")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected a Python file or notebook with your answers)")
    if path.suffix not in (".py", ".ipynb"):
        raise ValueError(f"{path} is neither a Python file (.py) nor a notebook (.ipynb); "
                         "give the file with your answers")
    return path


def load_answers(path: str | Path) -> types.ModuleType:
    """Run a reader's answers file as a module and return it: a Python file, or a notebook's code cells in order.

    As ``python path`` would, with the file's folder first on sys.path (so it can import its
    neighbours), but under a name of its own, so that an ``if __name__ == "__main__":`` block stays out.
    """
    path = answers_path(path)
    module = types.ModuleType(f"answers_{path.stem}")
    module.__file__ = str(path)
    sys.modules[module.__name__] = module  # as an import would: dataclasses and pickle look the module up
    if str(path.parent.resolve()) not in sys.path:
        sys.path.insert(0, str(path.parent.resolve()))
    codes = _notebook_code(path) if path.suffix == ".ipynb" else [compile(path.read_bytes(), str(path), "exec")]
    for code in codes:
        exec(code, vars(module))
    return module


def _notebook_code(path: Path) -> Iterator[types.CodeType]:
    """The notebook's code cells, compiled one by one (an error names its cell), as plain Python.

    IPython's ``%magic`` and ``!shell`` lines become ``pass``, cells run by a ``%%cell magic`` are
    left out, and so are the notebook's own ``check(...)`` calls: the caller checks every answer itself.
    """
    try:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a readable notebook ({type(err).__name__}: {err})") from None
    for number, cell in enumerate(cells, 1):
        source = "".join(cell.get("source", ""))
        if cell.get("cell_type") != "code" or source.lstrip().startswith("%%"):
            continue
        tree = ast.parse("\n".join(map(_python_line, source.splitlines())), f"{path}, cell {number}")
        tree.body = [statement for statement in tree.body if not _calls_check(statement)]
        yield compile(tree, f"{path}, cell {number}", "exec")


def _python_line(line: str) -> str:
    stripped = line.lstrip()
    return line[: len(line) - len(stripped)] + "pass" if stripped.startswith(("%", "!")) else line


def _calls_check(statement: ast.stmt) -> bool:
    """Whether a statement is just ``check(...)`` or ``<chapter>.CHAPTER.check(...)``."""
    call = statement.value if isinstance(statement, ast.Expr) else None
    return isinstance(call, ast.Call) and (getattr(call.func, "id", None) == "check"
                                           or getattr(call.func, "attr", None) == "check")
