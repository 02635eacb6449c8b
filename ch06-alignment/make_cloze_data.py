"""Generate the Moby-Dick cloze set: which of four sentences truly comes next?

    python ch06-alignment/make_cloze_data.py            # rewrites llmscratch/assets/moby_cloze.json
    python ch06-alignment/make_cloze_data.py --check    # fails if the committed file differs

Everything comes from the held-out tenth of the novel, the text that pretraining validates on,
so no item was seen in training: a sentence after the two or three sentences before it, among
three distractors from other paragraphs of nearly its length, at a random position. The rules
(where a sentence ends, which sentences may be items or distractors) live in llmscratch.alignment.cloze.
The same --seed gives the same file.
"""

import argparse
import sys
from pathlib import Path

from llmscratch.alignment.cloze import make_items
from llmscratch.assets import MOBY_CLOZE_PATH, read_moby_dick, write_or_check_records
from llmscratch.cli import check_out_files, run_script
from llmscratch.text.data import VAL_FRACTION, held_out_moby_dick


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="seed of the distractors and answer positions")
    parser.add_argument("--out", type=Path, default=MOBY_CLOZE_PATH, help="where to write the JSON list")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit with an error if --out differs from what would be written")
    args = parser.parse_args(argv)
    if not args.check:
        check_out_files(parser, {"--out": args.out})
    text = read_moby_dick()
    held_out = held_out_moby_dick(text)
    try:
        items = make_items(held_out, text[: len(text) - len(held_out)], args.seed)
        write_or_check_records({args.out: items}, args.check)
    except ValueError as err:
        sys.exit(f"error: {err}")
    if args.check:
        print(f"{args.out} is up to date")
        return
    print(f"wrote {len(items):,} items to {args.out} (from the last {VAL_FRACTION:.0%} of Moby-Dick, "
          f"{len(held_out):,} characters)")


if __name__ == "__main__":
    run_script(main)
