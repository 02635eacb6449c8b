"""The machinery every exercise check shares: verdicts, the smallest failing case, hints, the command line."""

import functools
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from exercise_suite import argument_key
from torch.nn.functional import softmax as imported_softmax  # as an answers file may import it

from llmscratch.exercises import CHAPTERS, chapter
from llmscratch.exercises.__main__ import main
from llmscratch.exercises.checking import Chapter, attempt, diagnose, expect_close, expect_equal, fresh_generator


def toy_chapter() -> Chapter:
    """One exercise: a function that doubles a tensor; cases from the smallest up."""
    toy = Chapter("toy", "a chapter for testing the checks")

    @toy.exercise("double", title="Double a tensor", difficulty="warm-up", section="1", kind="write it yourself")
    def check_double(answer):
        cases = [torch.zeros(0), torch.tensor([1.0]), torch.arange(5.0), torch.randn(3, 4)]
        for x in cases:
            case = f"x of shape {tuple(x.shape)}"
            got = attempt(answer, x.clone(), case=case)
            hint = diagnose(got, {"you added 2 instead of multiplying by 2": lambda: x + 2,
                                  "you squared instead of doubling": lambda: x * x}, "compare with x * 2")
            expect_close(got, x * 2, case=case, hint=hint)
        return len(cases)

    return toy


def test_a_right_answer_passes_and_says_how_many_cases(capsys):
    verdict = toy_chapter().check(lambda x: 2 * x, "double")
    assert verdict.status == "passed" and "(4 cases)" in str(verdict)
    assert capsys.readouterr().out.strip() == "double: passed (4 cases)"


def test_the_answer_is_found_by_its_name():
    def double(x):
        return x + x
    assert toy_chapter().check(double, quiet=True).status == "passed"


def test_a_wrong_answer_gets_the_smallest_failing_input_and_the_matching_hint():
    verdict = toy_chapter().check(lambda x: x + 2, "double", quiet=True)
    assert verdict.status == "failed"
    # the empty tensor passes (x + 2 of nothing is nothing); the first failure is the 1-element one
    assert "input:    x of shape (1,)" in verdict.detail
    assert "hint:     you added 2 instead of multiplying by 2" in verdict.detail
    assert "expected: tensor of shape (1,) [2]" in verdict.detail


def test_an_unknown_mistake_gets_the_default_hint():
    verdict = toy_chapter().check(lambda x: x * 4, "double", quiet=True)
    assert verdict.status == "failed" and "hint:     compare with x * 2" in verdict.detail


def test_the_stub_reads_not_done_yet():
    def double(x):
        raise NotImplementedError
    verdict = toy_chapter().check(double, quiet=True)
    assert verdict.status == "not done yet"


@pytest.mark.parametrize("answer, expected_text", [
    (lambda x: x.reshape(-1, 1) * 2, "the shape is wrong"),
    (lambda x: (x * 2).tolist(), "not a tensor"),
    (lambda x: 1 / 0, "ZeroDivisionError"),
    (lambda: None, "TypeError"),  # the wrong signature
])
def test_a_wrong_answer_never_raises_out_of_the_check(answer, expected_text):
    verdict = toy_chapter().check(answer, "double", quiet=True)
    assert verdict.status == "failed" and expected_text in verdict.detail


def test_the_check_leaves_the_readers_random_stream_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    toy_chapter().check(lambda x: 2 * x, "double", quiet=True)  # the checker draws random cases
    assert torch.equal(torch.rand(3), expected)


def softmax_chapter() -> Chapter:
    """One exercise to write without F.softmax, whose checker uses F.softmax itself; a fixed case and fresh ones."""
    toy = Chapter("toy", "a chapter for testing forbidden functions and fresh cases")

    @toy.exercise("softmax", title="Softmax", difficulty="warm-up", section="1", kind="write it yourself",
                  forbidden=("torch.nn.functional.softmax",))
    def check_softmax(answer):
        cases = [torch.zeros(1, 2)] + [torch.randn(2, 3, generator=fresh_generator()) for _ in range(2)]
        for x in cases:
            case = f"softmax({x.tolist()})"
            expect_close(attempt(answer, x.clone(), case=case), F.softmax(x, dim=-1), case=case, hint="exp / sum")
        return len(cases)

    return toy


def softmax_by_hand(x):
    return x.exp() / x.exp().sum(-1, keepdim=True)


def test_a_forbidden_function_fails_the_answer_that_calls_it_and_is_back_after_the_check():
    def softmax_by_library(x):
        return F.softmax(x, dim=-1)

    def softmax_imported_and_errors_swallowed(x):
        try:
            return imported_softmax(x, -1)
        except Exception:  # the forbidden call is no Exception: it still reaches the check
            return softmax_by_hand(x)

    original = F.softmax
    for answer in (softmax_by_library, softmax_imported_and_errors_swallowed, F.softmax):
        verdict = softmax_chapter().check(answer, "softmax", quiet=True)
        assert verdict.status == "failed" and "write it without F.softmax" in verdict.detail, str(verdict)
        assert "input:    softmax([[0.0, 0.0]])" in verdict.detail
    assert F.softmax is original and imported_softmax is original and torch.nn.functional.softmax is original
    assert softmax_chapter().check(softmax_by_hand, "softmax", quiet=True).status == "passed"  # the checker's F.softmax


def held_forbidden_answers():
    """Answers that reach F.softmax through what they hold, not by its name at call time."""
    kept = functools.partial(F.softmax, dim=-1)
    table = {"softmax": F.softmax}

    class Holder:
        function = staticmethod(F.softmax)

    def closing_over(function):
        return lambda x: function(x, dim=-1)


    def by_default(x, function=F.softmax):
        return function(x, dim=-1)

    def by_keyword_default(x, *, function=imported_softmax):
        return function(x, dim=-1)

    return {"a default argument": by_default, "a keyword-only default": by_keyword_default,
            "a functools.partial": lambda x: kept(x), "a dict of functions": lambda x: table["softmax"](x, dim=-1),
            "a lambda's closure": closing_over(F.softmax), "a class attribute": lambda x: Holder.function(x, dim=-1),
            "getattr by string": lambda x: getattr(F, "soft" + "max")(x, dim=-1)}


@pytest.mark.parametrize("way", list(held_forbidden_answers()))
def test_a_forbidden_function_fails_however_the_answer_holds_it(way):
    original_code = F.softmax.__code__
    verdict = softmax_chapter().check(held_forbidden_answers()[way], "softmax", quiet=True)
    assert verdict.status == "failed" and "write it without F.softmax" in verdict.detail, str(verdict)
    assert F.softmax.__code__ is original_code and F.softmax.__defaults__ == (None, 3, None)
    assert torch.allclose(F.softmax(torch.zeros(2), dim=-1), torch.full((2,), 0.5))  # the function works again


def test_a_forbidden_builtin_fails_however_the_answer_holds_it():
    from llmscratch.exercises import ch02

    def grouped_query_attention(q, k, v, attend=F.scaled_dot_product_attention):
        group = q.size(1) // k.size(1)
        return attend(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=q.size(2) == k.size(2))

    table = {"attend": F.scaled_dot_product_attention}
    for answer in (grouped_query_attention, lambda q, k, v: grouped_query_attention(q, k, v, table["attend"])):
        verdict = ch02.CHAPTER.check(answer, "grouped_query_attention", quiet=True)
        assert verdict.status == "failed" and "write it without F.scaled_dot_product_attention" in verdict.detail, \
            str(verdict)
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_integer_results_must_have_the_exact_dtype():
    for got in (torch.tensor([1, 2], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int16)):
        with pytest.raises(Exception) as err:
            expect_equal(got, torch.tensor([1, 2]), case="c", hint="h")
        assert "exactly torch.long" in err.value.hint
    expect_equal(torch.tensor([1, 2]), torch.tensor([1, 2]), case="c", hint="h")


def test_fresh_cases_change_with_the_seed_a_failure_prints_and_replays_it():
    fixed = torch.zeros(1, 2)

    def table(x):  # right on the fixed case only
        return torch.full_like(x, 0.5) if torch.equal(x, fixed) else torch.zeros_like(x)

    verdict = softmax_chapter().check(table, "softmax", quiet=True)
    assert verdict.status == "failed" and "seed:" in verdict.detail
    seed = int(verdict.detail.split("seed:")[1].split()[0])
    assert softmax_chapter().check(table, "softmax", quiet=True, seed=seed).detail == verdict.detail
    cases = {softmax_chapter().check(table, "softmax", quiet=True, seed=s).detail.splitlines()[0] for s in (1, 2)}
    assert len(cases) == 2  # another seed, other fresh cases
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    softmax_chapter().check(softmax_by_hand, "softmax", quiet=True)
    assert torch.equal(torch.rand(3), expected)  # fresh cases leave the reader's random stream alone


def test_expect_equal_compares_values_and_tensors():
    expect_equal([1, 2], [1, 2], case="c", hint="h")
    expect_equal(torch.tensor([True, False]), torch.tensor([True, False]), case="c", hint="h")
    for got, expected in [([1, 2], [2, 1]), (torch.tensor([1, 2]), torch.tensor([1, 3])),
                          (torch.tensor([1.0, 2.0]), torch.tensor([1, 2]))]:
        with pytest.raises(Exception) as err:
            expect_equal(got, expected, case="c", hint="h")
        assert type(err.value).__name__ == "Mismatch" and err.value.hint in ("h", "the shape is wrong; h")


def test_every_chapter_has_at_least_six_exercises_of_each_kind_described():
    total = 0
    for name in CHAPTERS:
        exercises = chapter(name).exercises
        assert len(exercises) >= 6, name
        kinds = {e.kind for e in exercises.values()}
        assert kinds == {"write it yourself", "extend the package"}, name
        total += len(exercises)
    assert total >= 30


@pytest.mark.slow
def test_the_command_line_prints_a_table_and_fails_on_a_wrong_answer(tmp_path):
    first = next(iter(chapter("ch01").exercises))
    answers = tmp_path / "answers.py"
    answers.write_text(f"def {first}(*args, **kwargs):\n    return 'certainly wrong'\n")
    result = subprocess.run([sys.executable, "-m", "llmscratch.exercises", "ch01", str(answers)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line and line.split()[0] in
            chapter("ch01").exercises}
    assert rows[first].endswith("failed") and all(
        row.endswith("not done yet") for name, row in rows.items() if name != first)
    assert len(rows) == len(chapter("ch01").exercises)


@pytest.mark.slow
def test_the_command_line_names_a_missing_or_broken_file(tmp_path):
    missing = subprocess.run([sys.executable, "-m", "llmscratch.exercises", "ch01", str(tmp_path / "nope.py")],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "nope.py: no such file" in missing.stderr
    (tmp_path / "broken.py").write_text("def f(:\n")
    broken = subprocess.run([sys.executable, "-m", "llmscratch.exercises", "ch01", str(tmp_path / "broken.py")],
                            capture_output=True, text=True, timeout=300)
    assert broken.returncode == 2 and "broken.py does not run: SyntaxError" in broken.stderr


def test_the_same_seed_draws_the_same_fresh_cases_and_another_seed_others():
    def drawn(seed: int) -> list[str]:
        calls = []

        def split_heads(x, n_heads):
            calls.append(argument_key((x, n_heads)))
            return x.unflatten(-1, (n_heads, -1)).transpose(1, 2)

        assert chapter("ch02").check(split_heads, quiet=True, seed=seed).status == "passed"
        return calls

    assert drawn(5) == drawn(5)
    fixed = set(drawn(5)) & set(drawn(6))
    assert fixed and len(drawn(5)) > len(fixed), "fresh cases beside the fixed ones, and only they change"


def split_heads_learned_by_heart() -> str:
    """An answers file whose split_heads knows only the fixed cases' inputs (those drawn whatever the seed)."""
    seen = {}
    for seed in (1, 2):
        def split_heads(x, n_heads, calls=seen.setdefault(seed, set())):
            calls.add(repr(x.flatten().tolist()))
            return x.unflatten(-1, (n_heads, -1)).transpose(1, 2)
        chapter("ch02").check(split_heads, quiet=True, seed=seed)
    return (f"FIXED = {seen[1] & seen[2]!r}\n\n\n"
            "def split_heads(x, n_heads):\n"
            "    if repr(x.flatten().tolist()) not in FIXED:\n"
            "        raise LookupError('not a case learned by heart')\n"
            "    return x.unflatten(-1, (n_heads, -1)).transpose(1, 2)\n")


@pytest.mark.slow
def test_the_command_line_replays_a_failure_with_the_seed_it_printed(tmp_path, capsys):
    answers = tmp_path / "answers.py"
    answers.write_text(split_heads_learned_by_heart())

    def failure(*seed: str) -> str:
        assert main(["ch02", str(answers), *seed]) == 1
        out = capsys.readouterr().out
        return out[out.index("split_heads: failed"):]

    first = failure()  # a new seed, which the failure prints
    assert "LookupError: not a case learned by heart" in first
    seed = int(first.split("seed:")[1].split()[0])
    assert f"or by --seed {seed} on the command line" in first
    assert failure("--seed", str(seed)) == first  # the same fresh case fails, with the same seed printed
    inputs = [next(line for line in failure("--seed", seed).splitlines() if line.startswith("  input:"))
              for seed in ("1", "2")]
    assert inputs[0] != inputs[1]  # another seed, another fresh case


@pytest.mark.parametrize("seed", ["x", "1.5", "-1", str(2**64)])
def test_the_command_line_refuses_a_seed_that_is_not_a_whole_number(tmp_path, capsys, seed):
    (tmp_path / "empty.py").write_text("")
    with pytest.raises(SystemExit) as exit:
        main(["ch01", str(tmp_path / "empty.py"), "--seed", seed])
    assert exit.value.code == 2 and f"argument --seed: {seed}: a seed is a whole number" in capsys.readouterr().err
