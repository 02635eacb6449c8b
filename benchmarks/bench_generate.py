"""Generation benchmark: greedy decoding speed of gpt2-small, ours with and without the KV cache vs transformers.

    python -m benchmarks.bench_generate      # from the repository root; prints a Markdown section
"""

import argparse
import os
import sys
import tempfile

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights: nothing to download

import transformers  # noqa: E402

from benchmarks.common import interleaved_medians, machine_description, median, time_once, today  # noqa: E402
from llmscratch.generate import generate  # noqa: E402
from llmscratch.weights import load_hf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="interleaved rounds; medians are reported")
    parser.add_argument("--no-cache-runs", type=int, default=3,
                        help="how many of those rounds include the slow no-cache path")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (batch 1)")
    parser.add_argument("--new-tokens", type=int, default=200, help="tokens generated per call")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    args = parser.parse_args()
    if not 1 <= args.no_cache_runs <= args.runs:
        parser.error(f"--no-cache-runs must be between 1 and --runs={args.runs}, got {args.no_cache_runs}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    # transformers' GPT-2 with its own random init and no EOS (every call generates all tokens),
    # with its default attention (SDPA); ours loads the very same weights from its checkpoint.
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    config = transformers.GPT2Config(bos_token_id=None, eos_token_id=None)
    theirs = transformers.GPT2LMHeadModel(config).eval()
    with tempfile.TemporaryDirectory() as folder:
        theirs.save_pretrained(folder)
        ours = load_hf(folder).eval()
    idx = torch.randint(config.vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    decoders = {
        "transformers": lambda n: theirs.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n,
                                                  do_sample=False),
        "cache": lambda n: generate(ours, idx, n),
        "no-cache": lambda n: generate(ours, idx, n, use_cache=False),
    }
    for decode in decoders.values():  # warm-up: first-call allocations and kernel choices
        decode(8)
    outputs = {}

    def timed(name):
        return lambda: time_once(lambda: outputs.__setitem__(name, decoders[name](args.new_tokens)))

    times = interleaved_medians({name: timed(name) for name in decoders}, args.no_cache_runs)
    more = interleaved_medians({name: timed(name) for name in ("transformers", "cache")},
                               args.runs - args.no_cache_runs)
    for name, seconds in more.items():
        times[name] += seconds
    assert torch.equal(outputs["cache"], outputs["transformers"]), "greedy tokens differ from transformers"
    assert torch.equal(outputs["cache"], outputs["no-cache"]), "greedy tokens differ with and without the cache"
    rate = {name: args.new_tokens / median(runs) for name, runs in times.items()}

    print(f"### Generation ({today()})\n")
    print(f"Command: `{' '.join(['python -m benchmarks.bench_generate', *sys.argv[1:]])}`  ")
    print(f"Machine: {machine_description()}  ")
    print(f"Model: gpt2-small shape (124M parameters), random weights, fp32, eval; batch 1, a "
          f"{args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, greedy (identical tokens from "
          f"all three). Tokens/s = new tokens / wall time of the whole call, prefill included; medians "
          f"of interleaved runs after a short warm-up.\n")
    print("| greedy decoding | runs | seconds | tokens/s | vs transformers |")
    print("|---|---|---|---|---|")
    labels = {"transformers": f"transformers {transformers.__version__} `generate` (DynamicCache, SDPA)",
              "cache": "llmscratch `generate`, KV cache",
              "no-cache": "llmscratch `generate`, `use_cache=False`"}
    for name, label in labels.items():
        print(f"| {label} | {len(times[name])} | {median(times[name]):.2f} | {rate[name]:.1f} | "
              f"{rate[name] / rate['transformers']:.2f} |")
    print(f"\nKV cache: {rate['cache'] / rate['transformers']:.2f}x the throughput of transformers (target: at "
          f"least 1x) and {rate['cache'] / rate['no-cache']:.1f}x that of no cache (target: at least 5x).")


if __name__ == "__main__":
    main()
