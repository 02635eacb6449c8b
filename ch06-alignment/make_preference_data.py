"""Make the chapter-6 data: preference pairs and a multiple-choice set from the instruction families.

    python ch06-alignment/make_preference_data.py --answers-from runs/instructions   # the model answers, then both sets
    python ch06-alignment/make_preference_data.py            # rebuild both sets from the committed answers
    python ch06-alignment/make_preference_data.py --check    # fails if a committed set differs

Preference pairs: one per record of llmscratch/assets/instructions.json, chosen = the correct
output. rejected = the chapter-5 model's own answer where it is wrong and well-formed
(source "on-policy": the mistakes DPO most needs to push down), else a plausible mistake made
by a rule from the record (source "rule:<name>": off by one, the unreversed word, the wrong
plural ...). Each pair keeps its record's split, so no test prompt is trained on.

Multiple choice: one item per test record, the right answer and three of the rule mistakes,
the right answer at a seeded random position. The model's answers are left out of it, so the
set does not depend on (and is not made harder for) one particular model. Chance is 25%, as
is picking the first choice. The mistakes lie on both sides of the right answer in length (a
letter more, a letter less), so picking the longest or the shortest choice scores ~15%, below
chance, and the second shortest or longest ~35%, above it (the rules leave no way round this:
a singular is always shorter than its plural): compare models, not a model and 25%.

The model's answers come from a trained model, and CPUs round float products differently,
so they are generated once (--answers-from) and committed; from them, the rules and --seed,
both sets are rebuilt the same everywhere, and --check needs no model.
"""

import argparse
import hashlib
import json
import random
import re
import shlex
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from llmscratch.assets import (
    INSTRUCTION_ANSWERS_PATH,
    INSTRUCTION_CHOICES_PATH,
    INSTRUCTIONS_PATH,
    PREFERENCES_PATH,
    dumps_records,
    write_or_check_records,
)
from llmscratch.atomic import write_text_atomically
from llmscratch.cli import check_out_files, run_script
from llmscratch.evaluation import exact_match, normalize_answer
from llmscratch.instruct import SPLITS, format_prompt, validate_records
from llmscratch.preference import validate_pairs

N_WRONG_CHOICES = 3  # a multiple-choice item has the right answer and three wrong ones
MAX_NEW_TOKENS = 24  # as ch05-finetuning/finetune_instructions.py scores the model
ANSWER_FIELDS = {"instruction": str, "input": str, "answer": str, "well_formed": bool}  # one answer's, and their types

LETTERS = re.compile(r"[a-z]( [a-z])*")
NUMBER = re.compile(r"\d+")
WORDS = re.compile(r"[a-z]+( [a-z]+)*")
NUMBERS = re.compile(r"\d+( \d+)*")


# --------------------------------------------------------------------------- small edits of a list
def swap_adjacent(items: list[str], rng: random.Random) -> list[str]:
    """items with one adjacent pair of different items swapped (unchanged if all are equal)."""
    places = [i for i in range(len(items) - 1) if items[i] != items[i + 1]]
    if not places:
        return items
    i = rng.choice(places)
    return [*items[:i], items[i + 1], items[i], *items[i + 2 :]]


def drop_one(items: list[str], rng: random.Random) -> list[str]:
    """items without one of them."""
    i = rng.randrange(len(items))
    return items[:i] + items[i + 1 :]


def repeat_one(items: list[str], rng: random.Random, extra: int = 1) -> list[str]:
    """items with one of them written ``extra`` more times."""
    i = rng.randrange(len(items))
    return items[: i + 1] + [items[i]] * extra + items[i + 1 :]


def shift_letters(letters: list[str], by: int) -> list[str]:
    """Each letter moved ``by`` places in the alphabet, z wrapping round to a."""
    return [chr((ord(c) - ord("a") + by) % 26 + ord("a")) for c in letters]


# --------------------------------------------------------------------------- the mistakes of each family
OFF_BY = {-1: "one_less", 1: "one_more", 2: "two_more", -2: "two_less"}


# Each maps (input items, correct output items, rng) to {rule name: wrong answer items}.
# Rules that happen to give the right answer (a palindrome left unreversed) are dropped later.
def reverse_letters(given, right, rng):
    return {"unreversed": given, "swapped_pair": swap_adjacent(right, rng), "rotated": right[1:] + right[:1],
            "dropped_letter": drop_one(right, rng), "doubled_letter": repeat_one(right, rng)}


def sort_letters(given, right, rng):
    return {"unsorted": given, "swapped_pair": swap_adjacent(right, rng), "reverse_order": right[::-1],
            "last_letter_first": right[-1:] + right[:-1], "dropped_letter": drop_one(right, rng)}


def count(given, right, rng):
    n = int(right[0])
    return {name: [str(n + d)] for d, name in OFF_BY.items() if n + d >= 1}


def double_letters(given, right, rng):
    i = rng.randrange(len(given))
    once = [c for j, c in enumerate(given) for _ in range(1 if j == i else 2)]
    return {"undoubled": given, "word_twice": given + given, "one_letter_once": once,
            "one_letter_thrice": repeat_one(right, rng)}


def next_letter(given, right, rng):
    i = rng.randrange(len(given))
    return {"unchanged": given, "previous_letter": shift_letters(given, -1), "two_ahead": shift_letters(given, 2),
            "one_letter_unchanged": right[:i] + given[i : i + 1] + right[i + 1 :]}


def plural(given, right, rng):
    noun = "".join(given)
    mistakes = {"always_s": noun + "s", "always_es": noun + "es", "singular": noun}
    if noun.endswith("y"):  # the -ies rule used where it does not apply (day -> daies)
        mistakes["ies_misused"] = noun[:-1] + "ies"
    else:  # the final consonant doubled, as in busses
        mistakes["doubled_final"] = noun + noun[-1] + "es"
    return {name: list(word) for name, word in mistakes.items()}


def first_word(given, right, rng):
    return {"last_word": given[-1:], "second_word": given[1:2], "third_word": given[2:3],
            "first_two_words": given[:2]}


def last_word(given, right, rng):
    return {"first_word": given[:1], "second_to_last": given[-2:-1], "third_to_last": given[-3:-2],
            "last_two_words": given[-2:]}


def reverse_words(given, right, rng):
    return {"unreversed": given, "swapped_pair": swap_adjacent(right, rng), "dropped_word": drop_one(right, rng),
            "repeated_word": repeat_one(right, rng)}


def repeat_word(given, right, rng):
    return {f"{name}_time": [given[0]] * (len(right) + d) for d, name in OFF_BY.items() if len(right) + d >= 1}


def next_number(given, right, rng):
    n = int(given[0])
    mistakes = {"unchanged": n, "added_two": n + 2, "subtracted_one": n - 1, "added_ten": n + 10}
    return {name: [str(value)] for name, value in mistakes.items() if value >= 0}


def count_up(given, right, rng):
    numbers = [int(n) for n in right]
    start, end = numbers[0], numbers[-1]
    mistakes = {"one_too_far": range(start, end + 2), "stopped_early": range(start, end),
                "started_late": range(start + 1, end + 1), "counted_down": numbers[::-1]}
    if start > 0:
        mistakes["started_early"] = range(start - 1, end + 1)
    if len(numbers) > 2:
        mistakes["skipped_one"] = [start, *drop_one(numbers[1:-1], rng), end]
    return {name: [str(n) for n in items] for name, items in mistakes.items()}


# family -> (its mistakes, the pattern every answer of the family matches)
FAMILIES: dict[str, tuple[Callable, re.Pattern]] = {
    "reverse_letters": (reverse_letters, LETTERS), "sort_letters": (sort_letters, LETTERS),
    "count_letters": (count, NUMBER), "double_letters": (double_letters, LETTERS),
    "next_letter": (next_letter, LETTERS), "plural": (plural, LETTERS), "first_word": (first_word, WORDS),
    "last_word": (last_word, WORDS), "reverse_words": (reverse_words, WORDS), "count_words": (count, NUMBER),
    "repeat_word": (repeat_word, WORDS), "next_number": (next_number, NUMBER), "count_up": (count_up, NUMBERS),
}


def plausible_mistakes(record: dict, rng: random.Random) -> dict[str, str]:
    """{rule name: wrong answer} for an instruction record: at least three, distinct once normalised,
    none equal to the output, each written like the family's answers. ValueError if not."""
    family = record.get("family")
    if family not in FAMILIES:
        raise ValueError(f"record {record.get('instruction')!r} / {record.get('input')!r}: family {family!r} has no "
                         f"mistake rules; expected one of {sorted(FAMILIES)}")
    rules, pattern = FAMILIES[family]
    seen = {normalize_answer(record["output"])}
    mistakes = {}
    for name, items in rules(record["input"].split(), record["output"].split(), rng).items():
        text = " ".join(items)
        if text and normalize_answer(text) not in seen:
            if not pattern.fullmatch(text):
                raise ValueError(f"rule {family}:{name} wrote {text!r} for input {record['input']!r}, which is not "
                                 f"written like the family's answers ({pattern.pattern})")
            seen.add(normalize_answer(text))
            mistakes[name] = text
    if len(mistakes) < N_WRONG_CHOICES:
        raise ValueError(f"family {family!r}, input {record['input']!r}: only {len(mistakes)} distinct mistakes "
                         f"({mistakes}), expected at least {N_WRONG_CHOICES}")
    return mistakes


# --------------------------------------------------------------------------- building the two sets
def record_rng(seed: int, purpose: str, record: dict) -> random.Random:
    """A generator for one record and one purpose: each record's draws do not depend on the others."""
    return random.Random(f"{seed}/{purpose}/{record['instruction']}/{record['input']}")


def preference_pair(record: dict, answer: dict, seed: int) -> dict:
    """The pair of one record: the model's answer as the rejected one when it is wrong and well-formed."""
    pair = {"instruction": record["instruction"], "input": record["input"], "chosen": record["output"]}
    text = answer["answer"]
    if answer["well_formed"] and text.strip() and not exact_match(text, record["output"]):
        rejected, source = text, "on-policy"
    else:
        mistakes = plausible_mistakes(record, record_rng(seed, "mistakes", record))
        rule = record_rng(seed, "pair", record).choice(sorted(mistakes))
        rejected, source = mistakes[rule], f"rule:{rule}"
    return {**pair, "rejected": rejected, "family": record["family"], "split": record["split"], "source": source}


def choice_item(record: dict, seed: int) -> dict:
    """A multiple-choice item: the right answer among three rule mistakes, at a random position."""
    mistakes = plausible_mistakes(record, record_rng(seed, "mistakes", record))
    rng = record_rng(seed, "choices", record)
    choices = [mistakes[name] for name in rng.sample(sorted(mistakes), N_WRONG_CHOICES)]
    answer = rng.randrange(N_WRONG_CHOICES + 1)
    choices.insert(answer, record["output"])
    return {"context": format_prompt(record), "choices": choices, "answer": answer, "family": record["family"]}


def key(record: dict) -> tuple[str, str]:
    return record["instruction"], record["input"]


def build(records: list[dict], answers: list[dict], seed: int) -> tuple[list[dict], list[dict]]:
    """(preference pairs, multiple-choice items) from the instruction records and the model's answers."""
    validate_records(records)
    for index, answer in enumerate(answers):
        if not isinstance(answer, dict) or not all(isinstance(answer.get(k), t) for k, t in ANSWER_FIELDS.items()):
            fields = ", ".join(f"{k}: {t.__name__}" for k, t in ANSWER_FIELDS.items())
            raise ValueError(f"answer {index} of the answers file: expected {{{fields}}}, got {answer!r}")
    by_prompt = {key(a): a for a in answers}
    missing = [key(r) for r in records if key(r) not in by_prompt]
    if missing:
        raise ValueError(f"the answers file has no answer to {len(missing)} of the {len(records)} prompts (first: "
                         f"{missing[0]!r}); regenerate it with --answers-from RUN_FOLDER")
    for index, record in enumerate(records):
        if record.get("split") not in SPLITS or record.get("family") not in FAMILIES:
            raise ValueError(f"instruction record {index}: split {record.get('split')!r} and family "
                             f"{record.get('family')!r}; expected a split in {SPLITS} and a known family")
    pairs = validate_pairs([preference_pair(r, by_prompt[key(r)], seed) for r in records])
    trained = {key(p) for p in pairs if p["split"] == "train"}
    leaked = [key(p) for p in pairs if p["split"] == "test" and key(p) in trained]
    if leaked:
        raise ValueError(f"{len(leaked)} test prompts are also training prompts (first: {leaked[0]!r})")
    items = [choice_item(r, seed) for r in records if r["split"] == "test"]
    return pairs, items


# --------------------------------------------------------------------------- the model's answers
def model_answers(run: Path, records: list[dict], command: str, progress: bool) -> dict:
    """The answers file's content: the greedy answer of the model in ``run`` to every record's prompt."""
    # torch and the model are imported only when answers are made: --check needs neither.
    from llmscratch.finetune import load_base
    from llmscratch.instruct import respond

    path = run / "model.safetensors" if run.is_dir() else run
    if not path.is_file() or path.suffix != ".safetensors":
        raise ValueError(f"--answers-from {run}: expected a run folder holding model.safetensors, or that file")
    model, tokenizer = load_base(path)
    responses = respond(model.eval(), tokenizer, records, MAX_NEW_TOKENS, progress=progress)
    answers = [{"instruction": r["instruction"], "input": r["input"], "split": r["split"], "answer": a.text,
                "well_formed": a.well_formed} for r, a in zip(records, responses)]
    sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    model_info = {"path": str(path), "sha256": sha256, "command": command, "max_new_tokens": MAX_NEW_TOKENS,
                  "decoding": "greedy, float32"}
    return {"model": model_info, "answers": answers}


def dumps_answers(content: dict) -> str:
    return '{"model": ' + json.dumps(content["model"]) + ',\n"answers": ' + dumps_records(content["answers"]) + "}\n"


def read_json(path: Path, what: str):
    """The JSON in ``path``; ValueError naming the file and what it should hold."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file (expected {what})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a JSON file ({what}): {err}") from None


# --------------------------------------------------------------------------- the command line
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--answers-from", type=Path, metavar="RUN",
                        help="first answer every instruction prompt with this chapter-5 model (a run folder of "
                             "finetune_instructions.py, or its model.safetensors) and write them to --answers")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit with an error naming the first differing record if --preferences "
                             "or --choices differs from what would be written")
    parser.add_argument("--seed", type=int, default=0, help="seed of the rule mistakes and the choice order")
    parser.add_argument("--instructions", type=Path, default=INSTRUCTIONS_PATH, help="the instruction records")
    parser.add_argument("--answers", type=Path, default=INSTRUCTION_ANSWERS_PATH,
                        help="the model's answers: read, or written with --answers-from")
    parser.add_argument("--preferences", type=Path, default=PREFERENCES_PATH, help="where the pairs go")
    parser.add_argument("--choices", type=Path, default=INSTRUCTION_CHOICES_PATH,
                        help="where the multiple-choice items go")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while the model answers")
    args = parser.parse_args(argv)
    if args.check and args.answers_from is not None:
        parser.error("--check rebuilds from the committed answers; it cannot be combined with --answers-from")
    if args.answers_from is not None and not args.answers_from.exists():
        parser.error(f"--answers-from {args.answers_from}: no such file or folder (train it with "
                     "ch05-finetuning/finetune_instructions.py)")
    written = ({"--answers": args.answers} if args.answers_from is not None else {}) | \
        ({} if args.check else {"--preferences": args.preferences, "--choices": args.choices})
    check_out_files(parser, written, inputs={"--instructions": args.instructions} | (
        {"--answers": args.answers} if args.answers_from is None else {}))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    command = shlex.join(["python", "ch06-alignment/make_preference_data.py",
                          *(sys.argv[1:] if argv is None else argv)])
    try:
        run(args, command)
    except ValueError as err:
        sys.exit(f"error: {err}")


def run(args: argparse.Namespace, command: str) -> None:
    records = read_json(args.instructions, "a JSON list of instruction records")
    validate_records(records)
    if args.answers_from is not None:
        content = model_answers(args.answers_from, records, command, progress=not args.no_progress)
        write_text_atomically(args.answers, dumps_answers(content))
        wrong = sum(not exact_match(a["answer"], r["output"]) for a, r in zip(content["answers"], records))
        print(f"wrote {len(records):,} answers to {args.answers}: {wrong:,} wrong")
    answers = read_json(args.answers, "the model's answers, written by --answers-from")
    if not isinstance(answers, dict) or not isinstance(answers.get("answers"), list):
        raise ValueError(f"{args.answers}: expected {{'model': ..., 'answers': [...]}}, as --answers-from "  # noqa: TRY004
                         "writes")
    pairs, items = build(records, answers["answers"], args.seed)
    write_or_check_records({args.preferences: pairs, args.choices: items}, args.check)
    if args.check:
        print(f"{args.preferences} and {args.choices} are up to date")
        return
    sources = Counter((p["split"], "on-policy" if p["source"] == "on-policy" else "rule") for p in pairs)
    print(f"wrote {len(pairs):,} pairs to {args.preferences}: "
          + ", ".join(f"{split} {sources[split, 'on-policy']} on-policy + {sources[split, 'rule']} rule"
                      for split in SPLITS))
    print(f"wrote {len(items):,} multiple-choice items to {args.choices}")


if __name__ == "__main__":
    run_script(main)
