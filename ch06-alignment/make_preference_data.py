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
both sets are rebuilt the same everywhere, and --check needs no model. The rules live in
llmscratch.alignment.tasks, beside the families they belong to.
"""

import argparse
import json
import shlex
import sys
from collections import Counter
from pathlib import Path

from llmscratch.alignment.tasks import build_preference_data
from llmscratch.assets import (INSTRUCTIONS_PATH, INSTRUCTION_ANSWERS_PATH, INSTRUCTION_CHOICES_PATH, PREFERENCES_PATH,
                               dumps_answers, write_or_check_records)
from llmscratch.cli import check_out_files, run_script
from llmscratch.files import write_text_atomically
from llmscratch.finetuning.instruct import SPLITS, exact_match, model_answers, validate_records


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
        folder = args.answers_from
        path = folder / "model.safetensors" if folder.is_dir() else folder
        if not path.is_file() or path.suffix != ".safetensors":
            raise ValueError(f"--answers-from {folder}: expected a run folder holding model.safetensors, or that file")
        content = model_answers(path, records, command, progress=not args.no_progress)
        write_text_atomically(args.answers, dumps_answers(content))
        wrong = sum(not exact_match(a["answer"], r["output"]) for a, r in zip(content["answers"], records))
        print(f"wrote {len(records):,} answers to {args.answers}: {wrong:,} wrong")
    answers = read_json(args.answers, "the model's answers, written by --answers-from")
    if not isinstance(answers, dict) or not isinstance(answers.get("answers"), list):
        raise ValueError(f"{args.answers}: expected {{'model': ..., 'answers': [...]}}, as --answers-from "  # noqa: TRY004
                         "writes")
    pairs, items = build_preference_data(records, answers["answers"], args.seed)
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
