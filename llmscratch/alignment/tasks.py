"""The instruction task families of chapters 5 and 6, and the data sets made from them.

Each family (reverse the letters, count the words, the plural of a noun ...) has one home here:
how a record is drawn (``draw``: chapter 5's instruction set, ``make_records``), how its answers
are written (``pattern``), and the mistakes people and small models make on it (``mistakes``:
chapter 6's rejected answers and wrong choices, ``plausible_mistakes`` and
``build_preference_data``). Inputs are short and letters are written apart ("w h a l e"), so that
each letter is its own token. Everything is seeded: the same seed gives the same records.
"""

import random
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from llmscratch.alignment.preference import validate_pairs
from llmscratch.assets import read_moby_dick
from llmscratch.finetuning.instruct import SPLITS, exact_match, format_prompt, normalize_answer, validate_records

SPLIT_FRACTIONS = {"train": 0.7, "validation": 0.1, "test": 0.2}
N_WRONG_CHOICES = 3  # a multiple-choice item has the right answer and three wrong ones
ANSWER_FIELDS = {"instruction": str, "input": str, "answer": str, "well_formed": bool}  # one answer's, and their types

# How the answers of the families are written
LETTERS = re.compile(r"[a-z]( [a-z])*")
NUMBER = re.compile(r"\d+")
WORDS = re.compile(r"[a-z]+( [a-z]+)*")
NUMBERS = re.compile(r"\d+( \d+)*")

# Regular nouns only (no -f/-fe, -o or irregular plurals): `plural` below decides them all.
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


# --------------------------------------------------------------------------- drawing a record
# Each draws one (instruction, input, output) from a random generator and the word list.
def draw_reverse_letters(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    word = rng.choice([w for w in words if len(w) <= 5])
    return "Reverse the order of the letters.", spaced(word), spaced(word[::-1])


def draw_sort_letters(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    word = rng.choice([w for w in words if len(w) <= 5])
    return "Sort the letters in alphabetical order.", spaced(word), spaced(sorted(word))


def draw_count_letters(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    word = rng.choice(words)
    return "How many letters are there?", spaced(word), str(len(word))


def draw_double_letters(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    word = rng.choice([w for w in words if len(w) <= 5])
    return "Write each letter twice.", spaced(word), spaced(c + " " + c for c in word)


def draw_next_letter(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    alphabet = string.ascii_lowercase
    chosen = [rng.choice(alphabet[:-1]) for _ in range(3)]  # never z: it has no next letter
    shifted = [alphabet[alphabet.index(c) + 1] for c in chosen]
    return "Replace each letter by the next one in the alphabet.", spaced(chosen), spaced(shifted)


def draw_plural(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    noun = rng.choice(NOUNS)
    return "Spell the plural of the word.", spaced(noun), spaced(plural(noun))


def draw_first_word(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    chosen = rng.sample(words, rng.randint(3, 5))
    return "What is the first word?", " ".join(chosen), chosen[0]


def draw_last_word(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    chosen = rng.sample(words, rng.randint(3, 5))
    return "What is the last word?", " ".join(chosen), chosen[-1]


def draw_reverse_words(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    chosen = rng.sample(words, rng.randint(2, 4))
    return "Reverse the order of the words.", " ".join(chosen), " ".join(chosen[::-1])


def draw_count_words(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    chosen = rng.sample(words, rng.randint(2, 6))
    return "How many words are there?", " ".join(chosen), str(len(chosen))


def draw_repeat_word(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    word, times = rng.choice(words), rng.choice([2, 3])
    return f"Repeat the word {'twice' if times == 2 else 'three times'}.", word, " ".join([word] * times)


def draw_next_number(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    number = rng.randint(0, 299)
    return "Add one to the number.", str(number), str(number + 1)


def draw_count_up(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    """The one family without an input: the whole task is in the instruction."""
    start, length = rng.randint(1, 40), rng.randint(2, 5)
    numbers = list(range(start, start + length))
    return f"Count from {numbers[0]} to {numbers[-1]}.", "", " ".join(map(str, numbers))


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
# Each maps (input items, correct output items, rng) to {rule name: wrong answer items}.
# Rules that happen to give the right answer (a palindrome left unreversed) are dropped later.
OFF_BY = {-1: "one_less", 1: "one_more", 2: "two_more", -2: "two_less"}


def reverse_letters_mistakes(given: list[str], right: list[str], rng: random.Random) -> dict[str, list[str]]:
    return {"unreversed": given, "swapped_pair": swap_adjacent(right, rng), "rotated": right[1:] + right[:1],
            "dropped_letter": drop_one(right, rng), "doubled_letter": repeat_one(right, rng)}


def sort_letters_mistakes(given: list[str], right: list[str], rng: random.Random) -> dict[str, list[str]]:
    return {"unsorted": given, "swapped_pair": swap_adjacent(right, rng), "reverse_order": right[::-1],
            "last_letter_first": right[-1:] + right[:-1], "dropped_letter": drop_one(right, rng)}


def count_mistakes(given: list[str], right: list[str], rng: random.Random) -> dict[str, list[str]]:
    n = int(right[0])
    return {name: [str(n + d)] for d, name in OFF_BY.items() if n + d >= 1}


def double_letters_mistakes(given: list[str], right: list[str], rng: random.Random) -> dict[str, list[str]]:
    i = rng.randrange(len(given))
    once = [c for j, c in enumerate(given) for _ in range(1 if j == i else 2)]
    return {"undoubled": given, "word_twice": given + given, "one_letter_once": once,
            "one_letter_thrice": repeat_one(right, rng)}


def next_letter_mistakes(given: list[str], right: list[str], rng: random.Random) -> dict[str, list[str]]:
    i = rng.randrange(len(given))
    return {"unchanged": given, "previous_letter": shift_letters(given, -1), "two_ahead": shift_letters(given, 2),
            "one_letter_unchanged": right[:i] + given[i : i + 1] + right[i + 1 :]}


def plural_mistakes(given: list[str], right: list[str], rng: random.Random) -> dict[str, list[str]]:
    noun = "".join(given)
    mistakes = {"always_s": noun + "s", "always_es": noun + "es", "singular": noun}
    if noun.endswith("y"):  # the -ies rule used where it does not apply (day -> daies)
        mistakes["ies_misused"] = noun[:-1] + "ies"
    else:  # the final consonant doubled, as in busses
        mistakes["doubled_final"] = noun + noun[-1] + "es"
    return {name: list(word) for name, word in mistakes.items()}


def first_word_mistakes(given: list[str], right: list[str], rng: random.Random) -> dict[str, list[str]]:
    return {"last_word": given[-1:], "second_word": given[1:2], "third_word": given[2:3],
            "first_two_words": given[:2]}


def last_word_mistakes(given: list[str], right: list[str], rng: random.Random) -> dict[str, list[str]]:
    return {"first_word": given[:1], "second_to_last": given[-2:-1], "third_to_last": given[-3:-2],
            "last_two_words": given[-2:]}


def reverse_words_mistakes(given: list[str], right: list[str], rng: random.Random) -> dict[str, list[str]]:
    return {"unreversed": given, "swapped_pair": swap_adjacent(right, rng), "dropped_word": drop_one(right, rng),
            "repeated_word": repeat_one(right, rng)}


def repeat_word_mistakes(given: list[str], right: list[str], rng: random.Random) -> dict[str, list[str]]:
    return {f"{name}_time": [given[0]] * (len(right) + d) for d, name in OFF_BY.items() if len(right) + d >= 1}


def next_number_mistakes(given: list[str], right: list[str], rng: random.Random) -> dict[str, list[str]]:
    n = int(given[0])
    mistakes = {"unchanged": n, "added_two": n + 2, "subtracted_one": n - 1, "added_ten": n + 10}
    return {name: [str(value)] for name, value in mistakes.items() if value >= 0}


def count_up_mistakes(given: list[str], right: list[str], rng: random.Random) -> dict[str, list[str]]:
    numbers = [int(n) for n in right]
    start, end = numbers[0], numbers[-1]
    mistakes = {"one_too_far": range(start, end + 2), "stopped_early": range(start, end),
                "started_late": range(start + 1, end + 1), "counted_down": numbers[::-1]}
    if start > 0:
        mistakes["started_early"] = range(start - 1, end + 1)
    if len(numbers) > 2:
        mistakes["skipped_one"] = [start, *drop_one(numbers[1:-1], rng), end]
    return {name: [str(n) for n in items] for name, items in mistakes.items()}


@dataclass(frozen=True)
class Family:
    """One task family: how a record is drawn, the mistakes made on it, the pattern its answers match."""

    draw: Callable[[random.Random, list[str]], tuple[str, str, str]]
    mistakes: Callable[[list[str], list[str], random.Random], dict[str, list[str]]]
    pattern: re.Pattern


FAMILIES: dict[str, Family] = {
    "reverse_letters": Family(draw_reverse_letters, reverse_letters_mistakes, LETTERS),
    "sort_letters": Family(draw_sort_letters, sort_letters_mistakes, LETTERS),
    "count_letters": Family(draw_count_letters, count_mistakes, NUMBER),
    "double_letters": Family(draw_double_letters, double_letters_mistakes, LETTERS),
    "next_letter": Family(draw_next_letter, next_letter_mistakes, LETTERS),
    "plural": Family(draw_plural, plural_mistakes, LETTERS),
    "first_word": Family(draw_first_word, first_word_mistakes, WORDS),
    "last_word": Family(draw_last_word, last_word_mistakes, WORDS),
    "reverse_words": Family(draw_reverse_words, reverse_words_mistakes, WORDS),
    "count_words": Family(draw_count_words, count_mistakes, NUMBER),
    "repeat_word": Family(draw_repeat_word, repeat_word_mistakes, WORDS),
    "next_number": Family(draw_next_number, next_number_mistakes, NUMBER),
    "count_up": Family(draw_count_up, count_up_mistakes, NUMBERS),
}


# --------------------------------------------------------------------------- chapter 5: the instruction set
STALLED = 10_000  # draws in a row without a new record, after which a family counts as exhausted


def make_records(per_family: int, seed: int) -> list[dict]:
    """per_family unique records of every family, each with its family and split."""
    rng = random.Random(seed)
    records = []
    words = common_words()
    for family, rules in FAMILIES.items():
        seen: dict[tuple[str, str], str] = {}
        repeats = 0  # draws in a row that gave nothing new: many of them, and the family has run dry
        while len(seen) < per_family and repeats < STALLED:  # a family with too few distinct records fails below
            instruction, input_text, output = rules.draw(rng, words)
            repeats = repeats + 1 if (instruction, input_text) in seen else 0
            seen.setdefault((instruction, input_text), output)
        if len(seen) < per_family:
            raise ValueError(f"family {family!r} has only {len(seen)} distinct records, fewer than {per_family}")
        items = list(seen.items())
        rng.shuffle(items)
        n_val, n_test = round(SPLIT_FRACTIONS["validation"] * per_family), round(SPLIT_FRACTIONS["test"] * per_family)
        for i, ((instruction, input_text), output) in enumerate(items):
            split = "test" if i < n_test else "validation" if i < n_test + n_val else "train"
            records.append({"instruction": instruction, "input": input_text, "output": output,
                            "family": family, "split": split})
    validate_records(records)  # an empty or malformed output stops the build here, not in training
    return records


def draw_prompts(per_family: int, seed: int, exclude: Iterable[dict] = ()) -> list[dict]:
    """Up to per_family new records of every family, none with the prompt of a record in ``exclude``.

    What reinforcement learning trains on: a checker needs only the family's answer, so prompts can be
    drawn afresh, as many as the family has (a family with fewer distinct prompts gives all it has).
    Keep the test and validation records out with ``exclude``; the order is seeded and mixed.
    """
    rng = random.Random(seed)
    words = common_words()
    banned = {key(r) for r in exclude}
    records = []
    for family, rules in FAMILIES.items():
        seen: dict[tuple[str, str], str] = {}
        repeats = 0
        while len(seen) < per_family and repeats < STALLED:
            instruction, input_text, output = rules.draw(rng, words)
            fresh = (instruction, input_text) not in seen and (instruction, input_text) not in banned
            repeats = 0 if fresh else repeats + 1
            if fresh:
                seen[(instruction, input_text)] = output
        records += [{"instruction": i, "input": x, "output": o, "family": family, "split": "train"}
                    for (i, x), o in seen.items()]
    rng.shuffle(records)
    return records


# --------------------------------------------------------------------------- chapter 6: pairs and choices
def plausible_mistakes(record: dict, rng: random.Random) -> dict[str, str]:
    """{rule name: wrong answer} for an instruction record: at least three, distinct once normalised,
    none equal to the output, each written like the family's answers. ValueError if not."""
    family = record.get("family")
    if family not in FAMILIES:
        raise ValueError(f"record {record.get('instruction')!r} / {record.get('input')!r}: family {family!r} has no "
                         f"mistake rules; expected one of {sorted(FAMILIES)}")
    rules = FAMILIES[family]
    seen = {normalize_answer(record["output"])}
    mistakes = {}
    for name, items in rules.mistakes(record["input"].split(), record["output"].split(), rng).items():
        text = " ".join(items)
        if text and normalize_answer(text) not in seen:
            if not rules.pattern.fullmatch(text):
                raise ValueError(f"rule {family}:{name} wrote {text!r} for input {record['input']!r}, which is not "
                                 f"written like the family's answers ({rules.pattern.pattern})")
            seen.add(normalize_answer(text))
            mistakes[name] = text
    if len(mistakes) < N_WRONG_CHOICES:
        raise ValueError(f"family {family!r}, input {record['input']!r}: only {len(mistakes)} distinct mistakes "
                         f"({mistakes}), expected at least {N_WRONG_CHOICES}")
    return mistakes


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


def build_preference_data(records: list[dict], answers: list[dict], seed: int) -> tuple[list[dict], list[dict]]:
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


# --------------------------------------------------------------------------- chapter 6: a style, not a skill
STYLES: dict[str, Callable[[str], str]] = {
    "full-stop": lambda answer: answer + ".",  # end every answer with a full stop
}


def style_pairs(records: list[dict], style: str) -> list[dict]:
    """Preference pairs that teach a style, not a skill: for each record, chosen is its right answer written in
    ``style`` (one of STYLES), rejected the same right answer as the records write it. Each keeps its split.

    Exact match ignores the style (``normalize_answer`` strips a final full stop), so a model tuned on these
    pairs is scored as before on what it knows, and the change shows in the text of its answers.
    """
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; expected one of {sorted(STYLES)}")
    records = validate_records(records)
    pairs = [{"instruction": r["instruction"], "input": r["input"], "chosen": STYLES[style](r["output"]),
              "rejected": r["output"], "family": r.get("family", ""), "split": r.get("split", "train"),
              "source": f"style:{style}"} for r in records]
    return validate_pairs(pairs)
