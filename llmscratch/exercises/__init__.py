"""The chapters' exercises, checked by the package: ``from llmscratch.exercises import ch02; ch02.CHAPTER.check(f)``.

Each chapter module (``ch01`` ... ``ch07``) holds a ``Chapter`` whose checkers run the reader's
function or module against the package's own implementation or an independent reference, on
seeded and edge-case inputs, and print one verdict. From a shell,
``python -m llmscratch.exercises ch02 my_answers.py`` (or ``ch02-attention/exercises.ipynb``) checks
every answer a file or notebook defines, in a worker process that no answer can hang or end
(``running``). An answer cannot reach the references it is compared with (``isolation``).
"""

import importlib

from llmscratch.exercises.checking import Chapter

__all__ = ["CHAPTERS", "chapter"]

CHAPTERS = ("ch01", "ch02", "ch03", "ch04", "ch05", "ch06", "ch07")


def chapter(name: str) -> Chapter:
    """The ``Chapter`` of exercises of chapter ``name`` ("ch01" ... "ch07")."""
    if name not in CHAPTERS:
        raise ValueError(f"no exercises for chapter {name!r}; expected one of {', '.join(CHAPTERS)}")
    return importlib.import_module(f"llmscratch.exercises.{name}").CHAPTER
