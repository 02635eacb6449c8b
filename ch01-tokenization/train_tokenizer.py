"""Train a byte-level BPE tokenizer on a text and compare its compression with GPT-2's.

    python ch01-tokenization/train_tokenizer.py                  # bundled Moby-Dick, 4,096 tokens
    python ch01-tokenization/train_tokenizer.py --input my.txt --vocab-size 8000 --out tok.json
"""

import argparse
import sys
import time
from pathlib import Path

from llmscratch.assets import MOBY_DICK_PATH
from llmscratch.cli import check_out_files, run_script
from llmscratch.text.checks import check_special_tokens
from llmscratch.text.corpus import read_text_file
from llmscratch.text.data import split_text
from llmscratch.text.tokenizer import ENDOFTEXT, BPETokenizer


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--input", type=Path, nargs="+", default=[MOBY_DICK_PATH],
                        help="UTF-8 text file(s) to train on (default: the bundled Moby-Dick)")
    parser.add_argument("--vocab-size", type=int, default=4096,
                        help="size of the vocabulary: 256 bytes + merges + special tokens")
    parser.add_argument("--val-fraction", type=float, default=0.1,
                        help="fraction at the end of the text held out to measure compression")
    parser.add_argument("--special-tokens", nargs="*", default=[ENDOFTEXT],
                        help="special tokens appended after the merges")
    parser.add_argument("--out", type=Path, default=Path("runs/tokenizer/bpe.json"),
                        help="where to save the trained tokenizer (a readable JSON file)")
    args = parser.parse_args(argv)
    for path in args.input:
        if not path.exists():
            parser.error(f"--input {path}: no such file")
    if not 0.0 <= args.val_fraction < 1.0:
        parser.error(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    try:
        check_special_tokens(args.special_tokens)
    except ValueError as err:
        parser.error(f"--special-tokens: {err}")
    for path in args.input:  # (one call per input: the flag names them all alike)
        check_out_files(parser, {"--out": args.out}, inputs={"--input": path})
    minimum = 256 + len(args.special_tokens)
    if args.vocab_size < minimum:
        parser.error(f"--vocab-size must be at least {minimum} (256 bytes + special tokens), "
                     f"got {args.vocab_size}")
    return args


def read_inputs(paths: list[Path]) -> str:
    """The input files joined by newlines; an unreadable or blank file exits with its name."""
    texts = []
    for path in paths:
        try:
            text = read_text_file(path, "--input")
        except ValueError as err:
            sys.exit(f"error: {err}")
        except OSError as err:
            sys.exit(f"error: --input {path} cannot be read: {err}")
        if not text.strip():
            sys.exit(f"error: --input {path} is {'empty' if not text else 'only whitespace'}; "
                     f"give a text to learn merges from")
        texts.append(text)
    return "\n".join(texts)


def bytes_per_token(tokenizer: BPETokenizer, text: str) -> float:
    return len(text.encode("utf-8")) / max(1, len(tokenizer.encode(text, disallowed_special=())))


def main(argv=None) -> None:
    args = parse_args(argv)
    text = read_inputs(args.input)
    train_text, held_out = split_text(text, args.val_fraction)
    inputs = " ".join(str(path) for path in args.input)
    if not train_text.strip():
        sys.exit(f"error: the training part of --input {inputs} (the first {1 - args.val_fraction:.0%}) "
                 f"is blank; give a longer text or a smaller --val-fraction")
    print(f"training on {len(train_text.encode('utf-8')):,} bytes, "
          f"holding out {len(held_out.encode('utf-8')):,} bytes")

    start = time.perf_counter()
    tokenizer = BPETokenizer.train(train_text, args.vocab_size, special_tokens=args.special_tokens,
                                   name=f"bpe-{args.vocab_size}", progress=True)
    print(f"learned {len(tokenizer.merges):,} merges in {time.perf_counter() - start:.1f} s")
    if not tokenizer.merges and args.vocab_size > 256 + len(args.special_tokens):
        sys.exit(f"error: --input {inputs} is too small: its training part has no two bytes side by "
                 f"side within a chunk, so there is nothing to merge; nothing saved")

    longest = sorted(tokenizer.vocab.values(), key=len)[-8:]
    print("longest tokens:", ", ".join(repr(t.decode("utf-8", "replace")) for t in longest))
    if held_out:
        gpt2 = BPETokenizer.gpt2()
        ours, theirs = bytes_per_token(tokenizer, held_out), bytes_per_token(gpt2, held_out)
        print(f"held-out compression: {ours:.2f} bytes/token with {tokenizer.vocab_size:,} tokens, "
              f"{theirs:.2f} with GPT-2's {gpt2.vocab_size:,}")
        sample = " ".join(held_out[:200].split()[:16])
        pieces = [tokenizer.decode([i]) for i in tokenizer.encode(sample, disallowed_special=())]
        print(f"held-out sample, tokens split by '|': {'|'.join(pieces)}")
    try:
        tokenizer.save(args.out)
    except OSError as err:
        sys.exit(f"error: could not save the tokenizer to --out {args.out}: {err}")
    print(f"saved {args.out}  (load it with BPETokenizer.load)")


if __name__ == "__main__":
    run_script(main)
