"""Pruning (llmscratch.deployment.prune) of the bundled model: what it costs in bits per byte, and what it buys in
speed.

    python -m benchmarks.bench_prune            # from the repository root; prints a Markdown section
    python -m benchmarks.bench_prune --quick    # a quarter of the held-out text, 20 recovery steps, 2 rounds

Quality: bits per byte of the bundled llama-mini on the held-out tenth of Moby-Dick (a) with the smallest
weights of its blocks zeroed, 0 to 90%, per layer and with one global threshold; (b) with a quarter or a
half of each block's key/value groups and MLP neurons removed, chosen by Taylor importance (measured on
batches of the training text) or at random, before and after a short recovery finetune on the training
90% (the same finetune of the unpruned model is the control). Speed: greedy decoding at batch 1 with the
KV cache, and a forward pass of a (8, 256) batch, in fp32, round robin, median.
"""

import argparse

import numpy as np
import torch

from benchmarks.common import add_threads_flag, load_average, machine_description, median, set_threads, today
from llmscratch.assets import PRETRAINED_PATH, read_moby_dick
from llmscratch.deployment.prune import importance, least_important, magnitude_prune, prune_structured, recover
from llmscratch.model.checkpoint import model_from_checkpoint, tokenizer_from_checkpoint
from llmscratch.model.generate import generate
from llmscratch.model.gpt import GPT
from llmscratch.profiling import round_robin, time_once
from llmscratch.text.data import RandomWindowBatches, split_text
from llmscratch.training.evaluation import evaluate, token_byte_lengths

SPARSITIES = [i / 10 for i in range(10)]
FRACTIONS = (0.25, 0.5)  # of each block's key/value groups and of its MLP neurons
IMPORTANCE_BATCHES = 8  # of 8 windows of 256 training tokens
NEW_TOKENS = 128


class Setup:
    """The bundled model and tokenizer, the training 90% and the held-out text as ids, and its scorer."""

    def __init__(self, held_out_fraction: float):
        self.model = model_from_checkpoint(PRETRAINED_PATH).float().eval()
        self.tokenizer = tokenizer_from_checkpoint(PRETRAINED_PATH)
        train_text, held_out = split_text(read_moby_dick(), 0.1)
        held_out = held_out[: int(len(held_out) * held_out_fraction)]
        self.train = np.array(self.tokenizer.encode(train_text), dtype=np.int64)
        self.val = np.array(self.tokenizer.encode(held_out), dtype=np.int64)
        self.lengths = token_byte_lengths(self.tokenizer, self.model.config.vocab_size)

    def bits(self, model: GPT) -> float:
        return evaluate(model, self.val, self.lengths, 16, torch.device("cpu"))["bits_per_byte"]


def removal(scores: torch.Tensor, fraction: float, how: str, seed: int) -> list[list[int]]:
    """Per layer, the round(fraction * units) units to remove: the least important, or a seeded random choice."""
    count = round(fraction * scores.size(1))
    if how == "importance":
        return least_important(scores, count)
    generator = torch.Generator().manual_seed(seed)
    return [sorted(torch.randperm(scores.size(1), generator=generator)[:count].tolist()) for _ in scores]


def sweep(setup: Setup) -> dict[str, list[float]]:
    """Bits per byte at each sparsity, per scope ("layer", "global")."""
    dense = setup.bits(setup.model)
    return {scope: [dense] + [setup.bits(magnitude_prune(setup.model, s, scope)) for s in SPARSITIES[1:]]
            for scope in ("layer", "global")}


def structured(setup: Setup, steps: int) -> tuple[list[tuple], list[tuple], dict[float, GPT]]:
    """(rows with recovery, rows of heads or neurons alone, the importance-pruned model of each fraction)."""
    model, config = setup.model, setup.model.config
    batches = RandomWindowBatches(setup.train, 8, config.context_length, seed=0)
    head_scores, neuron_scores = importance(model, (next(batches) for _ in range(IMPORTANCE_BATCHES)))
    _, control = recover(model, setup.tokenizer, setup.train, setup.val, steps)
    rows = [("nothing (control: the same finetune)", "-", model.num_params(), setup.bits(model),
             control["val_bits_per_byte"])]
    pruned = {}
    for fraction in FRACTIONS:
        for how in ("importance", "random"):
            heads, neurons = removal(head_scores, fraction, how, 1), removal(neuron_scores, fraction, how, 2)
            small = prune_structured(model, heads=heads, neurons=neurons)
            _, summary = recover(small, setup.tokenizer, setup.train, setup.val, steps)  # same evaluation
            label = (f"{len(heads[0])} of {config.kv_heads} key/value groups ({small.config.n_heads} of "
                     f"{config.n_heads} heads left), {len(neurons[0])} of {config.hidden_dim} neurons")
            rows.append((label, how, small.num_params(), setup.bits(small), summary["val_bits_per_byte"]))
            if how == "importance":
                pruned[fraction] = small
    alone = []
    for how in ("importance", "random"):
        heads, neurons = removal(head_scores, 0.5, how, 1), removal(neuron_scores, 0.5, how, 2)
        alone.append((f"{len(heads[0])} of {config.kv_heads} key/value groups only", how,
                      setup.bits(prune_structured(model, heads=heads))))
        alone.append((f"{len(neurons[0])} of {config.hidden_dim} neurons only", how,
                      setup.bits(prune_structured(model, neurons=neurons))))
    return rows, alone, pruned


def speeds(setup: Setup, models: dict[str, GPT], rounds: int) -> dict[str, tuple[float, float]]:
    """name: (median greedy decoding tokens/s, median forward tokens/s), the models timed in turn."""
    prompt = torch.tensor([setup.tokenizer.encode("Call me Ishmael. Some years ago")])  # (1, T)
    window = torch.from_numpy(setup.val[: 8 * 256].reshape(8, 256))  # (8, 256)

    def decoding(model: GPT) -> float:
        return NEW_TOKENS / time_once(lambda: generate(model, prompt, NEW_TOKENS, temperature=0.0, use_cache=True))

    @torch.no_grad()
    def forward(model: GPT) -> float:
        return window.numel() / time_once(lambda: model(window))

    decode = round_robin({name: lambda m=m: decoding(m) for name, m in models.items()}, rounds)
    whole = round_robin({name: lambda m=m: forward(m) for name, m in models.items()}, rounds)
    return {name: (median(decode[name]), median(whole[name])) for name in models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a quarter of the held-out text, 20 recovery steps, 2 timing rounds")
    parser.add_argument("--steps", type=int, default=None, help="recovery finetune steps (default 100; --quick 20)")
    add_threads_flag(parser)
    args = parser.parse_args()
    set_threads(parser, args.threads)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    steps = args.steps or (20 if args.quick else 100)
    setup = Setup(0.25 if args.quick else 1.0)
    model = setup.model
    curves = sweep(setup)
    rows, alone, pruned = structured(setup, steps)
    timed = {"unpruned": model, "structured, 25% removed (importance)": pruned[0.25],
             "structured, 50% removed (importance)": pruned[0.5],
             "unstructured, 50% zeros (per layer)": magnitude_prune(model, 0.5)}
    times = speeds(setup, timed, 2 if args.quick else 5)

    print("### Pruning\n")
    command = "python -m benchmarks.bench_prune" + (" --quick" if args.quick else "") + (
        f" --steps {args.steps}" if args.steps else "")
    print(f"`{command}`, {today()}, {machine_description()}; load {load_average()}\n")
    print(f"Bundled llama-mini ({model.num_params():,} parameters), bits per byte on "
          f"{'a quarter of ' if args.quick else ''}the held-out tenth of Moby-Dick ({len(setup.val):,} tokens).\n")
    print("| blocks' weights zeroed (smallest \\|w\\|) | " + " | ".join(f"{s:.0%}" for s in SPARSITIES) + " |")
    print("|---|" + "---:|" * len(SPARSITIES))
    for scope, values in curves.items():
        print(f"| {'per layer' if scope == 'layer' else 'one global threshold'} | "
              + " | ".join(f"{b:.3f}" for b in values) + " |")
    print(f"\nStructured: as many units removed from every block; importance: first-order Taylor scores on "
          f"{IMPORTANCE_BATCHES} batches of 8 x 256 training tokens; recovery: {steps} steps of the Trainer "
          f"(batch 8 x 256, peak lr 3e-4) on the training 90%.\n")
    print(f"| removed from each block | chosen by | parameters | bits per byte | after {steps} recovery steps |")
    print("|---|---|---:|---:|---:|")
    for label, how, params, before, after in rows:
        print(f"| {label} | {how} | {params:,} | {before:.3f} | {after:.3f} |")
    for label, how, before in alone:
        print(f"| {label} | {how} | - | {before:.3f} | - |")
    print(f"\n| model (fp32, dense kernels) | parameters | greedy decoding tokens/s (batch 1, KV cache, "
          f"{NEW_TOKENS} new) | vs unpruned | forward tokens/s (8 x 256) | vs unpruned |")
    print("|---|---:|---:|---:|---:|---:|")
    base_decode, base_forward = times["unpruned"]
    for name, m in timed.items():
        decode, forward = times[name]
        print(f"| {name} | {m.num_params():,} | {decode:.0f} | {decode / base_decode:.2f}x | {forward:,.0f} | "
              f"{forward / base_forward:.2f}x |")


if __name__ == "__main__":
    main()
