"""Tokenizer benchmark: GPT-2 encode throughput (ours vs tiktoken) and BPE training time.

    python -m benchmarks.bench_tokenizer      # from the repository root; prints a Markdown table
"""

import argparse

import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str

from benchmarks.common import interleaved_medians, machine_description, median, time_once, today
from llmscratch.assets import read_moby_dick
from llmscratch.tokenizer import ENDOFTEXT, BPETokenizer, load_gpt2_ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="interleaved rounds; medians are reported")
    parser.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size for the training benchmark")
    parser.add_argument("--train-runs", type=int, default=3, help="training runs; the median is reported")
    args = parser.parse_args()

    text = read_moby_dick()
    megabytes = len(text.encode("utf-8")) / 1e6
    ranks = load_gpt2_ranks()
    reference = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                  special_tokens={ENDOFTEXT: 50256})
    expected = reference.encode_ordinary(text)

    def ours() -> float:
        tokenizer = BPETokenizer.gpt2()  # fresh: its chunk cache starts empty every run
        ids = []
        seconds = time_once(lambda: ids.extend(tokenizer.encode_ordinary(text)))
        assert ids == expected, "from-scratch GPT-2 encoding differs from tiktoken"
        return seconds

    def theirs() -> float:
        encoding = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                     special_tokens={ENDOFTEXT: 50256})
        return time_once(lambda: encoding.encode_ordinary(text))  # single-threaded

    times = interleaved_medians({"llmscratch": ours, "tiktoken": theirs}, args.runs)
    ours_s, theirs_s = median(times["llmscratch"]), median(times["tiktoken"])
    train_s = median([time_once(lambda: BPETokenizer.train(text, args.vocab_size))
                      for _ in range(args.train_runs)])

    print(f"### Tokenizer ({today()})\n")
    print("Command: `python -m benchmarks.bench_tokenizer`  ")
    print(f"Machine: {machine_description()}  ")
    print(f"Text: Moby-Dick, {megabytes:.2f} MB, {len(expected):,} GPT-2 tokens (identical ids "
          f"from both). Median of {args.runs} interleaved runs, a fresh tokenizer each run.\n")
    print("| GPT-2 encode, one thread | seconds | MB/s | vs tiktoken |")
    print("|---|---|---|---|")
    print(f"| tiktoken {tiktoken.__version__} (Rust) | {theirs_s:.3f} | {megabytes / theirs_s:.2f} | 1.00 |")
    print(f"| llmscratch BPETokenizer (Python) | {ours_s:.3f} | {megabytes / ours_s:.2f} | "
          f"{theirs_s / ours_s:.2f} |")
    print(f"\nBPE training, vocabulary {args.vocab_size:,} on all of Moby-Dick: "
          f"{train_s:.2f} s (median of {args.train_runs}; target: at most 15 s).")


if __name__ == "__main__":
    main()
