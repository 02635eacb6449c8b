"""Tokenizer benchmark: GPT-2 encode throughput (ours vs tiktoken) and BPE training time.

    python -m benchmarks.bench_tokenizer      # from the repository root; prints a Markdown table

Two kinds of text: Moby-Dick (prose: many short chunks, where the chunk cache helps) and
pathological text, one 1 MB chunk without whitespace, where the cost of BPE on a single
long chunk is all there is (a quadratic merge loop would take hours there).
"""

import argparse
import random

import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str

from benchmarks.common import machine_description, median, today
from llmscratch.assets import read_moby_dick
from llmscratch.profiling import round_robin, time_once
from llmscratch.text.tokenizer import ENDOFTEXT, BPETokenizer, load_gpt2_ranks

LONG_CHUNK_BYTES = 1_000_000


def pathological_texts() -> dict[str, str]:
    """One-chunk texts of 1 MB: random DNA letters (seeded), and one letter repeated."""
    rng = random.Random(0)
    return {"random ACGT, no whitespace": "".join(rng.choices("ACGT", k=LONG_CHUNK_BYTES)),
            '"a" repeated': "a" * LONG_CHUNK_BYTES}


def compare_encoders(text: str, runs: int, ranks: dict[bytes, int]) -> tuple[float, float, int]:
    """Median seconds of (ours, tiktoken) over interleaved runs, and the number of tokens."""
    def fresh_reference() -> tiktoken.Encoding:
        return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={ENDOFTEXT: 50256})

    expected = fresh_reference().encode_ordinary(text)

    def ours() -> float:
        tokenizer = BPETokenizer.gpt2()  # fresh: its chunk cache starts empty every run
        ids = []
        seconds = time_once(lambda: ids.extend(tokenizer.encode_ordinary(text)))
        assert ids == expected, "from-scratch GPT-2 encoding differs from tiktoken"
        return seconds

    def theirs() -> float:
        encoding = fresh_reference()
        return time_once(lambda: encoding.encode_ordinary(text))  # single-threaded

    times = round_robin({"llmscratch": ours, "tiktoken": theirs}, runs)
    return median(times["llmscratch"]), median(times["tiktoken"]), len(expected)


def print_table(rows: list[tuple[str, float, float, float]]) -> None:
    """One Markdown table; each row is (text, megabytes, our seconds, tiktoken's seconds)."""
    print(f"| text | MB | tiktoken {tiktoken.__version__} s | tiktoken MB/s | llmscratch s | "
          f"llmscratch MB/s | vs tiktoken |")
    print("|---|---|---|---|---|---|---|")
    for name, megabytes, ours_s, theirs_s in rows:
        print(f"| {name} | {megabytes:.2f} | {theirs_s:.3f} | {megabytes / theirs_s:.2f} | "
              f"{ours_s:.3f} | {megabytes / ours_s:.2f} | {theirs_s / ours_s:.2f} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="interleaved rounds on Moby-Dick; medians are reported")
    parser.add_argument("--long-runs", type=int, default=5,
                        help="interleaved rounds on each 1 MB one-chunk text; medians are reported")
    parser.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size for the training benchmark")
    parser.add_argument("--train-runs", type=int, default=3, help="training runs; the median is reported")
    args = parser.parse_args(argv)

    text = read_moby_dick()
    megabytes = len(text.encode("utf-8")) / 1e6
    ranks = load_gpt2_ranks()
    ours_s, theirs_s, n_tokens = compare_encoders(text, args.runs, ranks)
    rows = [("Moby-Dick", megabytes, ours_s, theirs_s)]
    long_texts = pathological_texts()
    for name, long_text in long_texts.items():
        long_ours, long_theirs, _ = compare_encoders(long_text, args.long_runs, ranks)
        rows.append((f"one chunk: {name}", LONG_CHUNK_BYTES / 1e6, long_ours, long_theirs))
    train_s = median([time_once(lambda: BPETokenizer.train(text, args.vocab_size))
                      for _ in range(args.train_runs)])
    acgt = long_texts["random ACGT, no whitespace"]
    long_train_s = median([time_once(lambda: BPETokenizer.train(acgt, args.vocab_size))
                           for _ in range(args.train_runs)])

    print(f"### Run of {today()}\n")
    print("Command: `python -m benchmarks.bench_tokenizer`  ")
    print(f"Machine: {machine_description()}  ")
    print(f"GPT-2 encode (`encode_ordinary`), one thread, identical ids from both (asserted); a fresh "
          f"tokenizer each run. Moby-Dick: {n_tokens:,} GPT-2 tokens, median of {args.runs} "
          f"interleaved runs; each one-chunk text: median of {args.long_runs}.\n")
    print_table(rows)
    print(f"\nBPE training, vocabulary {args.vocab_size:,}, median of {args.train_runs}: all of "
          f"Moby-Dick {train_s:.2f} s (target: at most 15 s); 1 MB of random ACGT in one chunk "
          f"{long_train_s:.2f} s.")


if __name__ == "__main__":
    main()
