"""``python -m llmscratch.exercises ch02 my_answers.py``: a table of verdicts, one row per exercise."""

import argparse
import sys

from llmscratch.exercises import CHAPTERS, chapter
from llmscratch.exercises.checking import load_answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llmscratch.exercises",
        description="Check your answers to a chapter's exercises: every exercise function (or class) the file "
                    "defines, under the exercise's name, is run against the package; the others read "
                    "'not done yet'. Exit status 1 if any answer is wrong.")
    parser.add_argument("chapter", choices=CHAPTERS, help="the chapter whose exercises to check")
    parser.add_argument("answers", help="a Python file defining your answers (as in the chapter's exercises notebook)")
    args = parser.parse_args(argv)
    try:
        module = load_answers(args.answers)
    except FileNotFoundError as err:
        parser.error(str(err))
    except Exception as err:  # the reader's file itself does not run: say so, not a traceback of ours
        parser.error(f"{args.answers} does not run: {type(err).__name__}: {err}")
    exercises = chapter(args.chapter)
    verdicts = exercises.check_module(module)
    print(exercises.table(verdicts))
    return 1 if any(v.status == "failed" for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
