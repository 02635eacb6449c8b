"""Generate the instruction data set: rule-following tasks whose answers can be checked exactly.

    python ch05-finetuning/make_instruction_data.py            # rewrites llmscratch/assets/instructions.json
    python ch05-finetuning/make_instruction_data.py --check    # fails if the committed file differs

No instruction set with a usable license exists offline, so the project makes its own: 13 task
families (reverse, sort or count letters, plurals by rule, first/last word, counting ...), each
answer computed by a rule. Inputs are short and letters are written apart ("w h a l e") so that
each letter is its own token, with a byte-level BPE trained on Moby-Dick and with GPT-2's:
a small model can then learn the rule from examples instead of having to know how words are
spelled. Words come from the bundled Moby-Dick. Every (instruction, input) pair is unique, so
no test prompt is ever seen in training. The output is the same for the same --seed.
"""

import argparse
import random
import re
import string
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from llmscratch.assets import INSTRUCTIONS_PATH, read_moby_dick, write_or_check_records
from llmscratch.cli import check_out_files, run_script
from llmscratch.instruct import validate_records

SPLITS = {"train": 0.7, "validation": 0.1, "test": 0.2}

# Regular nouns only (no -f/-fe, -o or irregular plurals): the rule table below decides them all.
NOUNS = """
ship boat whale sail mast oar rope wave star bird hand eye head deck cabin anchor harpoon captain
sailor island river tree stone door book lamp coat hat cup plate table chair bell cloud storm hill
road house tower king ring coin shell rock fin tail bone jaw horn drum flag map pen bag seal cliff
desk lake pond barrel bucket candle kettle spear line hook net chart sword shield helmet window
box fox tax church bench lunch match watch inch torch patch ditch brush dish wish bush ash flash
crash lash glass mass kiss dress class compass harness witness sandwich wax branch coach beach
city body lady baby story party army enemy country family berry cherry penny puppy fly sky spy
duty ferry jelly navy pony copy diary lily ruby study worry
day key boy toy bay ray way tray valley monkey journey donkey turkey chimney alley play
""".split()


def plural(noun: str) -> str:
    """The regular English plural: -es after s, x, ch, sh; consonant + y -> -ies; else -s."""
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def spaced(letters) -> str:
    return " ".join(letters)


def common_words(count: int = 400) -> list[str]:
    """The most frequent lowercase words of 3 to 6 letters in Moby-Dick (each used 40+ times)."""
    counts = Counter(w for w in re.findall(r"[a-z]+", read_moby_dick()) if 3 <= len(w) <= 6)
    return [word for word, _ in counts.most_common(count)]


# ------------------------------------------------------------------ the task families
# Each draws one (instruction, input, output) from a random generator and the word list.
def reverse_letters(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    word = rng.choice([w for w in words if len(w) <= 5])
    return "Reverse the order of the letters.", spaced(word), spaced(word[::-1])


def sort_letters(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    word = rng.choice([w for w in words if len(w) <= 5])
    return "Sort the letters in alphabetical order.", spaced(word), spaced(sorted(word))


def count_letters(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    word = rng.choice(words)
    return "How many letters are there?", spaced(word), str(len(word))


def double_letters(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    word = rng.choice([w for w in words if len(w) <= 5])
    return "Write each letter twice.", spaced(word), spaced(c + " " + c for c in word)


def next_letter(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    alphabet = string.ascii_lowercase
    chosen = [rng.choice(alphabet[:-1]) for _ in range(3)]  # never z: it has no next letter
    shifted = [alphabet[alphabet.index(c) + 1] for c in chosen]
    return "Replace each letter by the next one in the alphabet.", spaced(chosen), spaced(shifted)


def plural_of(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    noun = rng.choice(NOUNS)
    return "Spell the plural of the word.", spaced(noun), spaced(plural(noun))


def first_word(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    chosen = rng.sample(words, rng.randint(3, 5))
    return "What is the first word?", " ".join(chosen), chosen[0]


def last_word(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    chosen = rng.sample(words, rng.randint(3, 5))
    return "What is the last word?", " ".join(chosen), chosen[-1]


def reverse_words(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    chosen = rng.sample(words, rng.randint(2, 4))
    return "Reverse the order of the words.", " ".join(chosen), " ".join(chosen[::-1])


def count_words(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    chosen = rng.sample(words, rng.randint(2, 6))
    return "How many words are there?", " ".join(chosen), str(len(chosen))


def repeat_word(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    word, times = rng.choice(words), rng.choice([2, 3])
    return f"Repeat the word {'twice' if times == 2 else 'three times'}.", word, " ".join([word] * times)


def next_number(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    number = rng.randint(0, 299)
    return "Add one to the number.", str(number), str(number + 1)


def count_up(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    """The one family without an input: the whole task is in the instruction."""
    start, length = rng.randint(1, 40), rng.randint(2, 5)
    numbers = list(range(start, start + length))
    return f"Count from {numbers[0]} to {numbers[-1]}.", "", " ".join(map(str, numbers))


FAMILIES: dict[str, Callable[[random.Random, list[str]], tuple[str, str, str]]] = {
    "reverse_letters": reverse_letters, "sort_letters": sort_letters, "count_letters": count_letters,
    "double_letters": double_letters, "next_letter": next_letter, "plural": plural_of,
    "first_word": first_word, "last_word": last_word, "reverse_words": reverse_words,
    "count_words": count_words, "repeat_word": repeat_word, "next_number": next_number, "count_up": count_up,
}


STALLED = 10_000  # draws in a row without a new record, after which a family counts as exhausted


def make_records(per_family: int, seed: int) -> list[dict]:
    """per_family unique records of every family, each with its family and split."""
    rng = random.Random(seed)
    records = []
    words = common_words()
    for family, draw in FAMILIES.items():
        seen: dict[tuple[str, str], str] = {}
        repeats = 0  # draws in a row that gave nothing new: many of them, and the family has run dry
        while len(seen) < per_family and repeats < STALLED:  # a family with too few distinct records fails below
            instruction, input_text, output = draw(rng, words)
            repeats = repeats + 1 if (instruction, input_text) in seen else 0
            seen.setdefault((instruction, input_text), output)
        if len(seen) < per_family:
            raise ValueError(f"family {family!r} has only {len(seen)} distinct records, fewer than {per_family}")
        items = list(seen.items())
        rng.shuffle(items)
        n_val, n_test = round(SPLITS["validation"] * per_family), round(SPLITS["test"] * per_family)
        for i, ((instruction, input_text), output) in enumerate(items):
            split = "test" if i < n_test else "validation" if i < n_test + n_val else "train"
            records.append({"instruction": instruction, "input": input_text, "output": output,
                            "family": family, "split": split})
    validate_records(records)  # an empty or malformed output stops the build here, not in training
    return records


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--per-family", type=int, default=120, help="records per task family (13 families)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random choices")
    parser.add_argument("--out", type=Path, default=INSTRUCTIONS_PATH, help="where to write the JSON list")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit with an error if --out differs from what would be written")
    args = parser.parse_args(argv)
    if args.per_family < 10:
        parser.error(f"--per-family must be at least 10 (to fill the three splits), got {args.per_family}")
    if not args.check:
        check_out_files(parser, {"--out": args.out})
    try:
        records = make_records(args.per_family, args.seed)
        write_or_check_records({args.out: records}, args.check)
    except ValueError as err:
        sys.exit(f"error: {err}")
    if args.check:
        print(f"{args.out} is up to date")
        return
    counts = Counter(r["split"] for r in records)
    print(f"wrote {sum(counts.values()):,} records to {args.out}: {dict(counts)}")


if __name__ == "__main__":
    run_script(main)
