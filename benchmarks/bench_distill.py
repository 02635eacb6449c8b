"""Knowledge distillation (llmscratch.deployment.distill): distilled students against the same students from scratch.

    python -m benchmarks.bench_distill                 # 3 seeds: about 13 minutes on 2 idle cores (estimated)
    python -m benchmarks.bench_distill --seeds 5 --save-student runs/draft
    python -m benchmarks.bench_distill --test-mode     # a smoke test in seconds

For each seed, three students of one shape (ch07-deployment/distill.py's default) train on the first 90%
of Moby-Dick: distilled from the bundled teacher; from scratch for the same steps (the same initial
weights and windows, so the loss is the only difference); and from scratch for the distilled run's
training time, which buys it more steps, since the teacher's forward pass makes each distilled step
dearer (the ratio of their step times is measured first, round robin; its schedule is stretched to the
steps). Each student is scored on the held-out tenth (bits per byte) and against the teacher (KL, and the
share of its drafts that speculative sampling would accept).
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import add_threads_flag, load_average, machine_description, set_threads, today
from llmscratch.assets import PRETRAINED_PATH, read_moby_dick
from llmscratch.deployment.distill import (DistillationTrainer, DistillConfig, student_config, teacher_agreement,
                                           text_splits, train_student)
from llmscratch.files import write_json_atomically
from llmscratch.model.checkpoint import export_model, model_from_checkpoint, tokenizer_from_checkpoint
from llmscratch.model.gpt import GPT
from llmscratch.profiling import time_steps
from llmscratch.runfolder import file_problem, folder_problem
from llmscratch.training.config import TrainConfig
from llmscratch.training.evaluation import evaluate, token_byte_lengths

ARMS = ("distilled", "scratch, same steps", "scratch, same time")
TEST_SHAPE = {"n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64, "context_length": 32}
AGREEMENT_WINDOWS = 64  # the first 64 held-out windows (4 with --test-mode): all of them would cost more time


def agreement_tokens(args, context_length: int) -> int:
    return (4 if args.test_mode else AGREEMENT_WINDOWS) * context_length


def train_config(steps: int, seed: int, lr: float, final_eval_tokens: int | None) -> TrainConfig:
    """One run of the benchmark: the main job's batch, a tenth of the steps as warmup, cosine to lr / 10."""
    return TrainConfig(max_steps=steps, batch_size=8, lr=lr, min_lr=lr / 10, warmup_steps=max(1, steps // 10),
                       eval_interval=steps, final_eval_tokens=final_eval_tokens, checkpoint_interval=steps,
                       sample_interval=steps, sample_tokens=8, log_interval=steps, seed=seed)


def step_cost(args, shape, teacher, tokenizer, splits, folder: Path, rounds: int) -> dict[str, float]:
    """Median seconds of a distilled and of a from-scratch training step, timed round robin (``rounds`` each),
    so that a busy spell of a shared machine slows both alike."""
    trainers = {}
    for name, alpha in (("distilled", args.alpha), ("scratch", 0.0)):
        config = train_config(rounds + 1, 0, args.lr, None)
        trainers[name] = DistillationTrainer(GPT(shape), teacher, config, *splits, folder / f"timing-{name}", tokenizer,
                                             DistillConfig(args.temperature, alpha))
        trainers[name].model.train()
    return {name: median for name, (_, median) in time_steps({n: t.train_step for n, t in trainers.items()},
                                                             rounds).items()}


def run_seed(seed: int, args, shape, matched_steps: int, teacher, tokenizer, splits, folder: Path):
    """{arm: scores} of one seed's three students, and the distilled student."""
    final_eval = 4 * shape.context_length + 1 if args.test_mode else None
    results, students = {}, {}
    for arm, steps, alpha in zip(ARMS, (args.steps, args.steps, matched_steps), (args.alpha, 0.0, 0.0)):
        training = train_config(steps, seed, args.lr, final_eval)
        student, summary = train_student(shape, teacher, tokenizer, *splits, training,
                                         DistillConfig(args.temperature, alpha), folder / f"{arm}-{seed}")
        agreement = teacher_agreement(student, teacher, splits[1],
                                      max_tokens=agreement_tokens(args, shape.context_length))
        results[arm] = {"steps": steps, "bits_per_byte": summary["val_bits_per_byte"],
                        "train_seconds": summary["train_seconds"], **agreement}
        students[arm] = student
        print(f"seed {seed}, {arm}: {steps} steps, {summary['train_seconds']:.0f} s, held-out "
              f"{summary['val_bits_per_byte']:.4f} bits per byte, drafts accepted {agreement['acceptance']:.1%}",
              file=sys.stderr, flush=True)
    return results, students[ARMS[0]]


def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min and max."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def comparison(distilled: list[float], scratch: list[float]) -> dict:
    """How much lower the distilled students' bits per byte are (scratch minus distilled: positive is better),
    beside the spread over seeds: the wider of the two arms' min-max ranges. Seeds are paired (same index)."""
    difference = statistics.fmean(scratch) - statistics.fmean(distilled)
    widest = max(max(distilled) - min(distilled), max(scratch) - min(scratch))
    return {"difference": difference, "per_seed": [s - d for d, s in zip(distilled, scratch)], "spread": widest,
            "exceeds": difference > widest, "ranges_apart": max(distilled) < min(scratch)}


def markdown(args, results: list[dict], teacher, teacher_bits: float, shape, load_before: str,
             cost: dict[str, float]) -> str:
    """The section for RESULTS.md: the setting, a row per arm (each seed, mean, std, min-max), the comparisons."""
    student = shape.n_layers, shape.d_model, shape.n_heads, shape.kv_heads, shape.hidden_dim
    with torch.device("meta"):  # the student's size, counted without making its weights
        model = GPT(shape)
    params, flops = model.num_params(), model.flops_per_token(training=False)
    lines = [
        "### Knowledge distillation\n",
        f"`python -m benchmarks.bench_distill --seeds {args.seeds} --steps {args.steps}"
        f"{' --test-mode' if args.test_mode else ''}`, {today()}, {machine_description()}; load {load_before} "
        f"before, {load_average()} after\n",
        f"Teacher: the bundled llama-mini ({teacher.num_params():,} parameters), held-out {teacher_bits:.4f} bits per "
        f"byte. Student: {student[0]} layer{'s' * (student[0] != 1)}, d_model {student[1]}, {student[2]} heads "
        f"({student[3]} key/value), "
        f"d_ff {student[4]}, the teacher's vocabulary and context: {params:,} parameters, "
        f"{teacher.flops_per_token(training=False) / flops:.1f}x fewer FLOPs per token. Every run: batch 8 x "
        f"{shape.context_length} tokens, AdamW at lr {args.lr:g} with a tenth of the steps as warmup, cosine to "
        f"lr / 10. Distilled at T = {args.temperature:g}, alpha = {args.alpha:g}. One training step takes "
        f"{cost['distilled']:.3f} s distilled (the teacher's forward pass included) and {cost['scratch']:.3f} s from "
        f"scratch ({cost['distilled'] / cost['scratch']:.2f}x; medians of steps timed round robin, so that the "
        f"machine's load weighs on both alike): the same-time students take that many times the steps, each on "
        f"a schedule of its own length. KL (nats per token) and drafts "
        f"accepted (the mean of sum min(p, q)) are measured against the teacher at temperature 1 on the first "
        f"{agreement_tokens(args, shape.context_length) // shape.context_length} held-out windows.\n",
        f"| student | steps | held-out bits per byte, seed {' / '.join(map(str, range(args.seeds)))} | mean | std "
        f"| min-max | training s (mean) | KL to teacher | drafts accepted |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for arm in ARMS:
        runs = [seed_results[arm] for seed_results in results]
        bits, steps = spread([r["bits_per_byte"] for r in runs]), [r["steps"] for r in runs]
        per_seed = " / ".join(f"{r['bits_per_byte']:.4f}" for r in runs)
        seconds, kl, accepted = (statistics.fmean(r[key] for r in runs)
                                 for key in ("train_seconds", "kl", "acceptance"))
        lines.append(f"| {arm} | {' / '.join(map(str, steps)) if len(set(steps)) > 1 else steps[0]} | {per_seed} | "
                     f"{bits['mean']:.4f} | {bits['std']:.4f} | {bits['min']:.4f}-{bits['max']:.4f} | {seconds:.0f} | "
                     f"{kl:.3f} | {accepted:.1%} |")
    lines.append("")
    distilled = [r[ARMS[0]]["bits_per_byte"] for r in results]
    for arm in ARMS[1:]:
        c = comparison(distilled, [r[arm]["bits_per_byte"] for r in results])
        better = "lower (better)" if c["difference"] > 0 else "higher (worse)"
        if c["exceeds"]:
            verdict = "the distilled students are better by more than it"
        elif -c["difference"] > c["spread"]:
            verdict = "the students from scratch are better by more than it"
        else:
            verdict = "the difference is within it"
        lines.append(f"- Distilled against {arm}: the distilled students score {abs(c['difference']):.4f} bits per "
                     f"byte {better} on average (from scratch minus distilled, per seed: "
                     f"{', '.join(f'{d:+.4f}' for d in c['per_seed'])}); the wider min-max spread over seeds is "
                     f"{c['spread']:.4f}: {verdict}{'; the ranges do not overlap' if c['ranges_apart'] else ''}.")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1, three students each (default 3)")
    parser.add_argument("--steps", type=int, default=120,
                        help="steps of the distilled and same-steps runs (default 120)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of every run (default 2e-3)")
    parser.add_argument("--temperature", type=float, default=DistillConfig.temperature,
                        help=f"distillation temperature (default {DistillConfig.temperature})")
    parser.add_argument("--alpha", type=float, default=DistillConfig.alpha,
                        help=f"weight of the teacher's KL term (default {DistillConfig.alpha})")
    parser.add_argument("--save-student", type=Path, default=None, metavar="FOLDER",
                        help="write seed 0's distilled student to FOLDER/model.safetensors (a --model for the "
                             "course's scripts, e.g. the draft model of speculative decoding)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write every run's numbers (steps, bits per byte, seconds, KL, acceptance) here")
    parser.add_argument("--test-mode", action="store_true",
                        help="a smoke test in seconds: 2 seeds, 2 steps, a tiny student on 32-token windows")
    add_threads_flag(parser)
    args = parser.parse_args(argv)
    set_threads(parser, args.threads)
    if args.test_mode:
        args.seeds, args.steps = 2, 2
    if args.seeds < 2:
        parser.error(f"--seeds must be at least 2 (a spread needs two), got {args.seeds}")
    if args.save_student is not None and (problem := folder_problem(args.save_student)):
        parser.error(f"--save-student {args.save_student}: {problem}")
    if args.json is not None and (problem := file_problem(args.json)):
        parser.error(f"--json {args.json}: {problem}")
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    try:
        DistillConfig(args.temperature, args.alpha)
        train_config(args.steps, 0, args.lr, None)
    except ValueError as err:
        parser.error(str(err))
    load_before = load_average()
    teacher, tokenizer = model_from_checkpoint(PRETRAINED_PATH).eval(), tokenizer_from_checkpoint(PRETRAINED_PATH)
    splits = text_splits(tokenizer, read_moby_dick())
    shape = student_config(teacher.config, **(TEST_SHAPE if args.test_mode else {}))
    teacher_bits = evaluate(teacher, splits[1], token_byte_lengths(tokenizer, teacher.config.vocab_size), 8,
                            torch.device("cpu"),
                            max_tokens=teacher.config.context_length + 1 if args.test_mode else None)["bits_per_byte"]
    results = []
    with tempfile.TemporaryDirectory() as folder:
        cost = step_cost(args, shape, teacher, tokenizer, splits, Path(folder), rounds=2 if args.test_mode else 8)
        matched_steps = max(1, round(args.steps * cost["distilled"] / cost["scratch"]))
        print(f"one step: distilled {cost['distilled']:.3f} s, from scratch {cost['scratch']:.3f} s (medians, round "
              f"robin): {matched_steps} steps from scratch take the time of {args.steps} distilled", file=sys.stderr)
        for seed in range(args.seeds):
            seed_results, distilled = run_seed(seed, args, shape, matched_steps, teacher, tokenizer, splits,
                                               Path(folder))
            results.append(seed_results)
            if seed == 0 and args.save_student is not None:
                args.save_student.mkdir(parents=True, exist_ok=True)
                export_model(distilled, args.save_student / "model.safetensors", tokenizer)
    if args.json is not None:
        write_json_atomically(args.json, {"teacher_bits_per_byte": teacher_bits, "student": shape.to_dict(),
                                          "temperature": args.temperature, "alpha": args.alpha, "lr": args.lr,
                                          "step_seconds": cost, "runs": results})
    print(markdown(args, results, teacher, teacher_bits, shape, load_before, cost))


if __name__ == "__main__":
    main()
