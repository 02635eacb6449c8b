"""Generate the instruction data set: rule-following tasks whose answers can be checked exactly.

    python ch05-finetuning/make_instruction_data.py            # rewrites llmscratch/assets/instructions.json
    python ch05-finetuning/make_instruction_data.py --check    # fails if the committed file differs

No instruction set with a usable license exists offline, so the project makes its own: 13 task
families (reverse, sort or count letters, plurals by rule, first/last word, counting ...), each
answer computed by a rule. Inputs are short and letters are written apart ("w h a l e") so that
each letter is its own token, with a byte-level BPE trained on Moby-Dick and with GPT-2's:
a small model can then learn the rule from examples instead of having to know how words are
spelled. Words come from the bundled Moby-Dick. Every (instruction, input) pair is unique, so
no test prompt is ever seen in training. The output is the same for the same --seed. The families
live in llmscratch.alignment.tasks, beside the mistakes chapter 6 makes from them.
"""

import argparse
import sys
from collections import Counter
from pathlib import Path

from llmscratch.alignment.tasks import make_records
from llmscratch.assets import INSTRUCTIONS_PATH, write_or_check_records
from llmscratch.cli import check_out_files, run_script


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
