"""Speculative decoding benchmark: the bundled model as the target, a small draft, greedy tokens/s with and without it.

    python -m benchmarks.bench_speculative                  # trains a small draft first: 300 steps (100 took 80 s
                                                            # on one thread of a busy 2-core machine)
    python -m benchmarks.bench_speculative --draft PATH     # a draft checkpoint that shares the target's tokenizer
    python -m benchmarks.bench_speculative --quick          # a shorter draft training, fewer prompts and rounds

Target: the bundled model (llmscratch/assets/moby_llama_mini.safetensors). Draft: --draft, or a 2-layer model
of the target's design and tokenizer trained here on the first 90% of Moby-Dick. Prompts: passages of the
held-out last 10%. Both ways decode greedily, batch 1, with KV caches, eagerly (no torch.compile for either);
the speculative tokens are asserted identical to the target's alone. Interleaved rounds, medians.

Then the cost model of ``llmscratch.deployment.speculative``: a draft step's time over a target step's (c) and a
(k+1)-token target forward over a one-token one (v), measured, give a predicted speed-up set beside the
measured one; the same c and v timed for a gpt2-small-shaped target (random weights) say whether 1.3x is
within reach at that size, at the acceptance measured here.
"""

import argparse
import dataclasses
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.common import add_threads_flag, load_average, machine_description, median, set_threads, today
from llmscratch.assets import PRETRAINED_PATH, read_moby_dick
from llmscratch.deployment.speculative import (SpeculativeStats, expected_tokens_per_round, predicted_speedup,
                                               speculative_generate)
from llmscratch.model.checkpoint import model_from_checkpoint, tokenizer_from_checkpoint
from llmscratch.model.config import GPTConfig
from llmscratch.model.generate import generate
from llmscratch.model.gpt import GPT
from llmscratch.profiling import round_robin, time_once
from llmscratch.text.data import RandomWindowBatches, split_text
from llmscratch.training.config import TrainConfig
from llmscratch.training.evaluation import evaluate, token_byte_lengths
from llmscratch.training.optim import OptimizerStep

DRAFT_SHAPE = dict(n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, d_ff=384, context_length=128)
GOAL = 1.3  # the speed-up asked of speculative decoding (issue 31)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default=None, metavar="PATH",
                        help="the draft model: a model.safetensors or checkpoint.pt with the target's vocabulary "
                             "(default: train a 2-layer draft here)")
    parser.add_argument("--quick", action="store_true",
                        help="100 draft steps instead of 300, 4 prompts instead of 8, 3 rounds instead of 5, "
                             "k in 1 3 instead of 1 2 4")
    add_threads_flag(parser)
    args = parser.parse_args()
    set_threads(parser, args.threads)
    args.steps, args.prompts, args.rounds = (100, 4, 3) if args.quick else (300, 8, 5)
    args.ks = [1, 3] if args.quick else [1, 2, 4]
    args.prompt_tokens, args.new_tokens = 32, 64
    args.target = model_from_checkpoint(PRETRAINED_PATH).eval()
    args.tokenizer = tokenizer_from_checkpoint(PRETRAINED_PATH)
    if args.draft is not None:
        args.draft_model = load_draft(parser, args)
    return args


# --------------------------------------------------------------------------- the models and the text
def load_draft(parser: argparse.ArgumentParser, args: argparse.Namespace) -> GPT:
    """The --draft model, or parser.error naming why it cannot draft for the target."""
    try:
        draft = model_from_checkpoint(args.draft).eval()
    except (OSError, ValueError, KeyError) as error:
        parser.error(f"--draft {args.draft}: {error}")
    needed = args.prompt_tokens + args.new_tokens
    if draft.config.vocab_size != args.target.config.vocab_size or draft.config.context_length < needed:
        parser.error(f"--draft {args.draft}: needs the target's {args.target.config.vocab_size}-token vocabulary and "
                     f"a context of at least {needed} positions; it has {draft.config.vocab_size} and "
                     f"{draft.config.context_length}")
    try:
        same = tokenizer_from_checkpoint(args.draft).vocab == args.tokenizer.vocab
    except ValueError:  # saved without a tokenizer: the vocabulary size is all there is to check
        same = True
    if not same:
        parser.error(f"--draft {args.draft}: its tokenizer is not the target's (the token ids mean other text)")
    return draft


def train_draft(target: GPT, train_tokens: np.ndarray, steps: int) -> tuple[GPT, float]:
    """A 2-layer model of the target's design (DRAFT_SHAPE) trained ``steps`` AdamW steps; also the seconds it took."""
    torch.manual_seed(0)
    draft = GPT(dataclasses.replace(target.config, **DRAFT_SHAPE))
    config = TrainConfig(max_steps=steps, batch_size=16, lr=3e-3, min_lr=3e-4, warmup_steps=min(50, steps // 4),
                         seed=0, peak_tflops=1.0)
    optimizer_step = OptimizerStep(draft, config, torch.device("cpu"), advice="the draft diverged: try fewer steps")
    batches = RandomWindowBatches(train_tokens, config.batch_size, DRAFT_SHAPE["context_length"], seed=0)
    draft.train()
    start = time.perf_counter()
    for _ in tqdm(range(steps), desc="training the draft", file=sys.stderr):
        optimizer_step([next(batches)], lambda batch: draft(batch[0], targets=batch[1]))
    return draft.eval(), time.perf_counter() - start


def held_out_prompts(tokens: np.ndarray, count: int, length: int) -> list[torch.Tensor]:
    """count prompts (1, length), evenly spaced through the held-out tokens."""
    starts = np.linspace(0, len(tokens) - length - 1, count).astype(int)
    return [torch.tensor(tokens[s:s + length], dtype=torch.long)[None] for s in starts]


# --------------------------------------------------------------------------- timings
def decode_all(args, target, draft, prompts) -> tuple[dict, dict, dict]:
    """Rounds of greedy decoding over every prompt, target alone then each k: (seconds, tokens, stats)."""
    candidates = {"alone": lambda idx: generate(target, idx, args.new_tokens)}
    for k in args.ks:
        candidates[k] = lambda idx, k=k: speculative_generate(target, draft, idx, args.new_tokens, k=k)
    outputs = {name: [decode(idx) for idx in prompts] for name, decode in candidates.items()}  # also the warm-up
    tokens = {name: [out if name == "alone" else out.tokens for out in outs] for name, outs in outputs.items()}
    stats = {k: sum_stats([out.stats for out in outputs[k]]) for k in args.ks}
    for k in args.ks:
        for expected, got in zip(tokens["alone"], tokens[k]):
            assert torch.equal(expected, got), f"k={k}: speculative greedy tokens differ from the target's alone"
    seconds = round_robin({name: lambda decode=decode: time_once(lambda: [decode(idx) for idx in prompts])
                           for name, decode in candidates.items()}, args.rounds, description="decoding rounds")
    return {name: median(values) for name, values in seconds.items()}, tokens, stats


def sum_stats(all_stats: list[SpeculativeStats]) -> SpeculativeStats:
    return SpeculativeStats(**{field.name: sum(getattr(s, field.name) for s in all_stats)
                               for field in dataclasses.fields(SpeculativeStats)})


def forward_costs(target: GPT, draft: GPT, ks: list[int], position: int, rounds: int, calls: int) -> dict:
    """Median seconds of one cached forward at ``position``: the target's of 1 and of k+1 tokens, the draft's of 1.

    Returns {"target 1": s, "target k+1": {k: s}, "draft 1": s}; each time is that of ``calls`` calls over calls.
    """
    def forward(model: GPT, n_tokens: int):
        caches = model.make_kv_caches(1, position + max(ks) + 1)
        ids, positions = torch.zeros(1, n_tokens, dtype=torch.long), torch.arange(position, position + n_tokens)

        @torch.inference_mode()
        def calls_of_it():
            for _ in range(calls):
                model(ids, caches, input_pos=positions)

        with torch.inference_mode():
            model(torch.zeros(1, position, dtype=torch.long), caches)  # a filled cache, as mid-generation
            model(ids, caches, input_pos=positions)  # warm-up
        return lambda: time_once(calls_of_it) / calls

    steps = {("target", 1): forward(target, 1), ("draft", 1): forward(draft, 1)}
    steps.update({("target", k + 1): forward(target, k + 1) for k in ks})
    seconds = {name: median(values) for name, values in round_robin(steps, rounds).items()}
    return {"target 1": seconds["target", 1], "draft 1": seconds["draft", 1],
            "target k+1": {k: seconds["target", k + 1] for k in ks}}


def needed_acceptance(goal: float, k: int, c: float, v: float) -> float | None:
    """The least per-token acceptance a at which predicted_speedup reaches goal (None: not even at a = 1)."""
    if predicted_speedup(1.0, k, c, v) < goal:
        return None
    low, high = 0.0, 1.0
    for _ in range(50):  # the predicted speed-up grows with a: bisect
        middle = (low + high) / 2
        low, high = (middle, high) if predicted_speedup(middle, k, c, v) < goal else (low, middle)
    return high


def gpt2_pair(draft_config: GPTConfig) -> tuple[GPT, GPT]:
    """A gpt2-small-shaped target and a GPT-2-designed draft of draft_config's depth and width, both random."""
    torch.manual_seed(0)
    target = GPT(GPTConfig.from_preset("gpt2-small")).eval()
    shape = {name: getattr(draft_config, name) for name in ("n_layers", "d_model", "n_heads", "d_ff")}
    return target, GPT(GPTConfig(**shape)).eval()


# --------------------------------------------------------------------------- the report
def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    target, tokenizer = args.target, args.tokenizer
    train_text, held_out_text = split_text(read_moby_dick(), 0.1)
    held_out = np.array(tokenizer.encode(held_out_text), dtype=np.int64)
    if args.draft is None:
        train_tokens = np.array(tokenizer.encode(train_text), dtype=np.int64)
        draft, train_seconds = train_draft(target, train_tokens, args.steps)
        draft_source = (f"trained here: {DRAFT_SHAPE['n_layers']} layers, d_model {DRAFT_SHAPE['d_model']}, "
                        f"context {DRAFT_SHAPE['context_length']}, the target's design and tokenizer, {args.steps} "
                        f"AdamW steps of 16 x {DRAFT_SHAPE['context_length']} tokens on the first 90% of Moby-Dick "
                        f"in {train_seconds:.0f} s")
    else:
        draft, draft_source = args.draft_model, f"`{args.draft}`"
    token_bytes = token_byte_lengths(tokenizer, target.config.vocab_size)
    quality = {name: evaluate(model, held_out, token_bytes, 8, torch.device("cpu"), max_tokens=16_384)
               for name, model in (("target", target), ("draft", draft))}
    prompts = held_out_prompts(held_out, args.prompts, args.prompt_tokens)
    seconds, _, stats = decode_all(args, target, draft, prompts)
    position = args.prompt_tokens + args.new_tokens // 2
    costs = forward_costs(target, draft, args.ks, position, args.rounds, calls=20)
    gpt2_target, gpt2_draft = gpt2_pair(draft.config)
    gpt2_costs = forward_costs(gpt2_target, gpt2_draft, args.ks, position, args.rounds, calls=3)
    report(args, target, draft, draft_source, quality, seconds, stats, costs, gpt2_draft, gpt2_costs,
           time.perf_counter() - start)


def report(args, target, draft, draft_source, quality, seconds, stats, costs, gpt2_draft, gpt2_costs,
           elapsed) -> None:
    new_tokens = args.new_tokens * args.prompts
    alone = new_tokens / seconds["alone"]
    command = " ".join(["python -m benchmarks.bench_speculative", *sys.argv[1:]])
    print(f"### Speculative decoding ({today()})\n")
    print(f"Command: `{command}` ({elapsed / 60:.1f} minutes in all)  ")
    print(f"Machine: {machine_description()}; load average {load_average()} at the end  ")
    print(f"Target: the bundled model ({target.num_params() / 1e6:.1f}M parameters), held-out bits per byte "
          f"{quality['target']['bits_per_byte']:.3f}. "
          f"Draft ({draft.num_params() / 1e6:.2f}M parameters): {draft_source}; held-out bits per byte "
          f"{quality['draft']['bits_per_byte']:.3f} (first 16,384 held-out tokens each).  ")
    print(f"Decoding: {args.prompts} prompts of {args.prompt_tokens} tokens from the held-out tenth, {args.new_tokens} "
          f"new tokens each, greedy, batch 1, KV caches, eager (no torch.compile, either way); speculative tokens "
          f"asserted identical to the target's alone. Tokens/s: all new tokens over the median wall time of "
          f"{args.rounds} interleaved rounds (prefill included).\n")
    c = costs["draft 1"] / costs["target 1"]
    print("| greedy decoding | tokens/s | speed-up | acceptance (kept / drafted) | a (per judged guess) | "
          "tokens per round, measured / predicted | v | predicted speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| target alone (`generate`) | {alone:.1f} | 1.00 | | | | | |")
    for k in args.ks:
        s = stats[k]
        v = costs["target k+1"][k] / costs["target 1"]
        rate = new_tokens / seconds[k]
        expected = expected_tokens_per_round(s.token_acceptance, k)
        print(f"| speculative, k = {k} | {rate:.1f} | {rate / alone:.2f} | {s.acceptance_rate:.1%} | "
              f"{s.token_acceptance:.3f} | {new_tokens / s.rounds:.2f} / {expected:.2f} | {v:.2f} | "
              f"{predicted_speedup(s.token_acceptance, k, c, v):.2f} |")
    print(f"\nCost model inputs (cached forwards at position {args.prompt_tokens + args.new_tokens // 2}, medians): "
          f"a target step {costs['target 1'] * 1e3:.2f} ms, a draft step {costs['draft 1'] * 1e3:.2f} ms, so "
          f"c = {c:.3f}; v = the (k+1)-token target forward over the one-token one. The predicted speed-up is "
          f"(1 - a^(k+1)) / (1 - a) / (k c + v) (`llmscratch.deployment.speculative.predicted_speedup`), a from the "
          f"rounds "
          f"above; what it leaves out (the sampling and bookkeeping between forwards, the prefill, a round's "
          f"first draft forward of 2 tokens after a round that kept every guess) is the gap to the measured one.\n")
    gpt2_c = gpt2_costs["draft 1"] / gpt2_costs["target 1"]
    print(f"At gpt2-small's size (124M parameters, random weights, the same eager cached forwards; draft: GPT-2 "
          f"design, {gpt2_draft.config.n_layers} layers, d_model {gpt2_draft.config.d_model}, the 50,257-token "
          f"vocabulary, {gpt2_draft.num_params() / 1e6:.1f}M parameters): a target step "
          f"{gpt2_costs['target 1'] * 1e3:.1f} ms, a draft step {gpt2_costs['draft 1'] * 1e3:.2f} ms, "
          f"c = {gpt2_c:.3f}.\n")
    print(f"| gpt2-small pair, k | v | v / (k + 1) | predicted speed-up at this run's a | a needed for {GOAL}x |")
    print("|---|---:|---:|---:|---:|")
    best = 0.0
    for k in args.ks:
        v = gpt2_costs["target k+1"][k] / gpt2_costs["target 1"]
        predicted = predicted_speedup(stats[k].token_acceptance, k, gpt2_c, v)
        best = max(best, predicted)
        needed = needed_acceptance(GOAL, k, gpt2_c, v)
        print(f"| {k} | {v:.2f} | {v / (k + 1):.2f} | {predicted:.2f} (a = {stats[k].token_acceptance:.3f}) | "
              f"{'out of reach' if needed is None else f'{needed:.3f}'} |")
    verdict = "reachable" if best >= GOAL else "out of reach"
    print(f"\nWith this run's acceptance, {GOAL}x at gpt2-small's size is {verdict} (best predicted: {best:.2f}x). "
          f"Verification is nearly free (v near 1) only where a step is bound by reading the weights; v / (k + 1) "
          f"near 1 means a forward of k + 1 tokens costs as much as k + 1 forwards of one, and no draft can help.")


if __name__ == "__main__":
    main()
