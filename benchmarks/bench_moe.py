"""Decoding a mixture of experts against the dense main job, per token and per active parameter.

    python -m benchmarks.bench_moe                # from the repository root; prints a Markdown section
    python -m benchmarks.bench_moe --preset llama-small    # the same at a wider shape (d_model 512, 8 layers)
    python -m benchmarks.bench_moe --collect-runs runs/speedrun    # the main job's MoE runs, for chapter 4

The models are those ``ch04-pretraining/pretrain.py`` builds: the main job (its ReLU^2 MLP) and its
``--experts`` variants, whose k experts together hold the dense MLP's weights, so a token meets about as many
weights in each. Random weights (the time of a step does not depend on them, only the routing does, and a
random router spreads tokens as a trained one aims to). Greedy decoding with the KV cache, batch 1, a
16-token prompt and 128 new tokens; the candidates run in interleaved rounds in one process, so machine noise
hits them alike; medians are reported. The issue's target: decoding an MoE at least as fast per active
parameter as the dense model (time per token / active parameters no higher).
"""

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import add_threads_flag, load_average, machine_description, median, set_threads, today
from benchmarks.pretrain_quality import pretrain_script
from llmscratch.files import write_text_atomically
from llmscratch.model.generate import generate
from llmscratch.model.gpt import GPT
from llmscratch.profiling import round_robin, time_once

CANDIDATES = {  # name: pretrain.py flags
    "dense": [],
    "8 experts, top 2": ["--experts", "8", "--experts-per-token", "2"],
    "4 experts, top 1": ["--experts", "4", "--experts-per-token", "1"],
}
PROMPT, NEW_TOKENS = 16, 128


RUNS_FILE = Path(__file__).resolve().parent / "moe_main_job.json"


def models(preset: str) -> dict[str, GPT]:
    script = pretrain_script()
    parser = script.build_parser()
    built = {}
    for name, flags in CANDIDATES.items():
        torch.manual_seed(0)
        built[name] = GPT(script.model_config_for(parser.parse_args(["--preset", preset, *flags]), 4096)).eval()
    return built


def collect_runs(runs: Path) -> None:
    """The speedrun folders under ``runs`` (``pretrain_quality speedrun``): each run's validation curve, wall
    time and, for a mixture of experts, its logged expert loads and balancing loss, into ``RUNS_FILE``."""
    collected = {}
    for folder in sorted(path for path in runs.iterdir() if (path / "speedrun.json").exists()):
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        run = {"wall_seconds": json.loads((folder / "speedrun.json").read_text())["wall_seconds"],
               "curve": {r["step"]: r["val_bits_per_byte"] for r in records if "val_bits_per_byte" in r}}
        logged = [r for r in records if "expert_load" in r]
        if logged:
            run.update(steps=[r["step"] for r in logged], expert_load=[r["expert_load"] for r in logged],
                       balance_loss=[r["balance_loss"] for r in logged])
        collected[folder.name] = run
    if not collected:
        raise SystemExit(f"no finished speedrun folders under {runs}")
    write_text_atomically(RUNS_FILE, json.dumps(collected, separators=(",", ":")) + "\n")
    print(f"{len(collected)} runs -> {RUNS_FILE}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds")
    parser.add_argument("--preset", default="llama-mini", help="the dense model's preset (default: the main job's)")
    parser.add_argument("--collect-runs", type=Path, metavar="RUNS",
                        help="instead: gather the finished speedrun folders under RUNS (curves, wall times, expert "
                             "loads) into benchmarks/moe_main_job.json, which chapter 4's appendix plots")
    add_threads_flag(parser)
    args = parser.parse_args()
    if args.collect_runs is not None:
        return collect_runs(args.collect_runs)
    set_threads(parser, args.threads)
    built = models(args.preset)
    prompt = torch.randint(4096, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    steps = {name: (lambda model=model: time_once(lambda: generate(model, prompt, NEW_TOKENS, temperature=0.0),
                                                  prompt.device)) for name, model in built.items()}
    round_robin(steps, 1)  # a round to warm up
    timed = round_robin(steps, args.rounds)
    reference = next(iter(built))
    rows = {}
    for name, model in built.items():
        seconds = median(timed[name]) / NEW_TOKENS
        active = model.num_params(active=True)
        rows[name] = (model.num_params(), active, seconds, seconds / active)
    per_active_ref = rows[reference][3]
    print(f"### Decoding a mixture of experts: {args.preset} ({today()})\n")
    print(f"`python -m benchmarks.bench_moe --preset {args.preset}` on {machine_description()}; load average "
          f"{load_average()}. "
          f"Batch 1, {PROMPT}-token prompt, {NEW_TOKENS} new tokens, greedy with the KV cache, float32; median of "
          f"{args.rounds} interleaved rounds.\n")
    print("| model | parameters | active per token | ms per token | tokens/s | time per active parameter, "
          "against dense |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (total, active, seconds, per_active) in rows.items():
        print(f"| {name} | {total:,} | {active:,} | {seconds * 1e3:.2f} | {1 / seconds:,.0f} | "
              f"{per_active / per_active_ref:.2f}x |")


if __name__ == "__main__":
    main()
