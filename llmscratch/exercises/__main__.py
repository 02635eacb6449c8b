"""``python -m llmscratch.exercises ch02 my_answers.py``: a table of verdicts, one row per exercise.

The answers (a Python file, or the chapter's exercises notebook once filled in) run in a worker
process (``running``), so that an endless loop, a ``sys.exit`` or a crash in them fails the
exercise it hit instead of the checker. Beside its fixed cases each check draws fresh ones from a
new seed, which a failure prints; ``--seed N`` draws them again from N.

Exit status: 0 when no answer failed, 1 when one did (or the file answers another chapter's
exercises), 2 when the command is wrong or the answers file does not load, 130 on Ctrl-C.
"""

import argparse
import math
import sys

from llmscratch.exercises import CHAPTERS, chapter
from llmscratch.exercises.checking import answers_path
from llmscratch.exercises.isolation import TIME_LIMIT
from llmscratch.exercises.running import check_answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llmscratch.exercises",
        description="Check your answers to a chapter's exercises: every exercise function (or class) the file "
                    "defines, under the exercise's name, is run against the package; the others read "
                    "'not done yet'. Exit status 0 if no answer is wrong, 1 if one is (or the file answers another "
                    "chapter's exercises), 2 if the file does not load.")
    parser.add_argument("chapter", choices=CHAPTERS, help="the chapter whose exercises to check")
    parser.add_argument("answers", help="your answers: a Python file, or the chapter's exercises notebook (.ipynb) "
                                        "with its stubs filled in (its check(...) calls are left to this command)")
    parser.add_argument("--time-limit", type=_seconds, default=TIME_LIMIT, metavar="SECONDS",
                        help="seconds for loading the answers and for each exercise's check; one still running "
                             "after it fails (default: %(default)g; each worked answer takes a few at most)")
    parser.add_argument("--seed", type=_seed, metavar="N",
                        help="draw every check's fresh cases from seed N: the seed a failed check printed, to replay "
                             "its failing case (default: a new seed for each check)")
    args = parser.parse_args(argv)
    try:
        path = answers_path(args.answers)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    try:
        outcome = check_answers(args.chapter, path, args.time_limit, args.seed)
    except KeyboardInterrupt:  # the worker is gone with it (running._Worker)
        print("\ninterrupted: no verdicts", file=sys.stderr)
        return 130
    print(chapter(args.chapter).table(outcome.verdicts), flush=True)
    if outcome.load_error:
        print(f"{parser.prog}: error: {args.answers} {outcome.load_error}", file=sys.stderr)
        return 2
    if all(v.status == "not done yet" for v in outcome.verdicts):
        if hint := _other_chapter_hint(args.chapter, args.answers, outcome.defined):
            print(hint, end="")
            return 1  # the wrong chapter checked: not a pass
    return 1 if any(v.status == "failed" for v in outcome.verdicts) else 0


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise argparse.ArgumentTypeError(f"{text}: a time limit is a positive, finite number of seconds")
    return seconds


def _seed(text: str) -> int:
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if not 0 <= seed < 2**64:
        raise argparse.ArgumentTypeError(f"{text}: a seed is a whole number from 0 to 2**64 - 1 (the one a failed "
                                         "check printed after 'seed:')")
    return seed


def _other_chapter_hint(chapter_name: str, answers: str, defined: list[str]) -> str:
    """When the answers define none of this chapter's exercises but some of another's: which, and the command."""
    if set(defined) & set(chapter(chapter_name).exercises):
        return ""
    found = {other: sorted(set(defined) & set(chapter(other).exercises)) for other in CHAPTERS if other != chapter_name}
    other = max(found, key=lambda name: len(found[name]))
    if not found[other]:
        return ""
    return (f"\n{answers} answers none of {chapter_name}'s exercises, but {len(found[other])} of {other}'s "
            f"({', '.join(found[other])}); check them with\n  python -m llmscratch.exercises {other} {answers}\n")


if __name__ == "__main__":
    sys.exit(main())
