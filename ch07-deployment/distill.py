"""Distil the bundled model into a small student trained on the teacher's next-token distributions.

    python ch07-deployment/distill.py                  # 2 layers, d_model 128: about 5 minutes on 2 idle CPU cores
    python ch07-deployment/distill.py --alpha 0 --out-dir runs/distill-scratch   # the same student from scratch
    python ch07-deployment/distill.py --test-mode      # a smoke test in seconds

The student keeps the teacher's tokenizer, vocabulary, context and architecture at a smaller shape (the
student flags), and trains on the teacher's own training text, the first 90% of Moby-Dick, with the loss
alpha * T^2 * KL(teacher || student, both at temperature T) + (1 - alpha) * cross-entropy
(llmscratch.deployment.distill; by default T = 1 and alpha = 1, the teacher's distribution alone; the T^2 keeps
the KL's gradient on the cross-entropy's scale only at high T, where softmax(z / T) is nearly flat). Then both are
scored on the held-out tenth: bits per byte, and how close the student came to the teacher (the share of
its drafts a speculative decoder would keep). With --alpha 0 the run is the ordinary pretraining of the
same student, step for step (same weights, data order and schedule). The run folder (--out-dir) gets
model.safetensors (the student: the folder or the file is a --model or --base for the other scripts),
checkpoint.pt, metrics.jsonl, loss.png, summary.json and sample.txt. benchmarks/bench_distill.py compares
distilled and from-scratch students over several seeds.
"""

import argparse
import dataclasses
import time
from pathlib import Path

from llmscratch.assets import PRETRAINED_PATH, read_moby_dick
from llmscratch.cli import (HelpFormatter, add_flags, add_out_dir_flags, build_config, check_device, check_out_dir,
                            refuse, run_folder, run_script, value_errors_exit)
from llmscratch.deployment.distill import (STUDENT_SHAPE, DistillConfig, student_config, teacher_agreement, text_splits,
                                           train_student)
from llmscratch.device import DTYPES, choose_dtype
from llmscratch.files import write_json_atomically
from llmscratch.model.checkpoint import export_model
from llmscratch.model.config import GPTConfig
from llmscratch.model.weights import load_model_and_tokenizer
from llmscratch.training.config import TrainConfig
from llmscratch.training.distributed import DistInfo
from llmscratch.training.evaluation import evaluate, token_byte_lengths
from llmscratch.training.runlog import METRICS_FILE, PLOT_FILE, SAMPLE_FILE, SUMMARY_FILE
from llmscratch.training.train import CHECKPOINT_FILE

DEFAULTS = TrainConfig(max_steps=300, batch_size=8, lr=2e-3, min_lr=2e-4, warmup_steps=30, eval_interval=100,
                       eval_tokens=8192, checkpoint_interval=100, sample_interval=300)
MODEL_FILE = "model.safetensors"
OUTPUTS = (MODEL_FILE, CHECKPOINT_FILE, METRICS_FILE, PLOT_FILE, SUMMARY_FILE, SAMPLE_FILE)
# --test-mode: a tiny student on short windows, two steps, scored on four held-out windows.
TEST_SHAPE = {"n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64, "context_length": 32}
TEST_STEPS, TEST_WINDOWS = 2, 4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                     formatter_class=HelpFormatter)
    parser.add_argument("--teacher", type=Path, default=PRETRAINED_PATH,
                        help="the teacher: a model.safetensors or checkpoint.pt of the course's scripts, or the run "
                             "folder holding one; default: the bundled model of ch04's default run")
    shape = parser.add_argument_group("the student's shape (the rest of its config is the teacher's)")
    add_flags(shape, GPTConfig(**STUDENT_SHAPE), *STUDENT_SHAPE)
    distill = parser.add_argument_group("distillation")
    add_flags(distill, DistillConfig(), "temperature", "alpha")
    training = parser.add_argument_group("training (on the first 90% of Moby-Dick; the learning rate decays to "
                                         "lr / 10)")
    add_flags(training, DEFAULTS, "max_steps", "batch_size", "lr", "warmup_steps", "seed")
    training.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                          help="auto: bfloat16 on GPUs that have it and on CPUs with AMX units, else float32")
    training.add_argument("--device", default="auto",
                          help="auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps")
    add_out_dir_flags(parser, Path("runs/distill"), holds=", ".join(OUTPUTS))
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--test-mode", action="store_true",
                        help=f"a smoke test in seconds: a tiny student (1 layer, d_model 32, windows of "
                             f"{TEST_SHAPE['context_length']} tokens) instead of the shape flags, {TEST_STEPS} steps, "
                             f"scored on {TEST_WINDOWS} held-out windows")
    args = parser.parse_args(argv)
    if not args.teacher.exists():
        parser.error(f"--teacher {args.teacher}: no such file or folder")
    check_out_dir(parser, args.out_dir, starting_model=("--teacher", args.teacher))
    check_device(parser, args)
    try:
        GPTConfig(**{name: getattr(args, name) for name in STUDENT_SHAPE})
    except ValueError as err:  # d_model=100 is not divisible by n_heads=3: the fields are the flags
        parser.error(f"the student's shape: {err}")
    try:  # every config the run makes, refused now (naming the flag) rather than after the teacher loads
        train_config(args)
        build_config(DistillConfig, args)
    except ValueError as err:
        refuse(parser, err)
    return args


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of the flags (--dtype auto settled here); --test-mode's tiny run instead of the step flags."""
    config = dataclasses.replace(DEFAULTS, max_steps=args.max_steps, batch_size=args.batch_size, lr=args.lr,
                                 min_lr=args.lr / 10, warmup_steps=args.warmup_steps, seed=args.seed,
                                 dtype=choose_dtype(args.device) if args.dtype == "auto" else args.dtype)
    if not args.test_mode:
        return config
    held_out = TEST_WINDOWS * TEST_SHAPE["context_length"] + 1  # the windows' tokens and the last one's target
    return dataclasses.replace(config, max_steps=TEST_STEPS, batch_size=2, warmup_steps=1, eval_interval=TEST_STEPS,
                               eval_tokens=held_out, final_eval_tokens=held_out, checkpoint_interval=TEST_STEPS,
                               sample_interval=TEST_STEPS, sample_tokens=4)


def main(argv=None) -> int:
    args = parse_args(argv)
    with value_errors_exit(), run_folder(args, OUTPUTS):  # e.g. a --teacher that does not load: a message
        return run(args)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    teacher, tokenizer = load_model_and_tokenizer(args.teacher, map_location=args.device)
    shape = TEST_SHAPE if args.test_mode else {name: getattr(args, name) for name in STUDENT_SHAPE}
    config = student_config(teacher.config, **shape)
    train, val = text_splits(tokenizer, read_moby_dick())
    training, distill = train_config(args), build_config(DistillConfig, args)
    held_out = training.final_eval_tokens  # None: all of it
    token_bytes = token_byte_lengths(tokenizer, teacher.config.vocab_size)
    teacher_tokens = None if held_out is None else max(held_out, teacher.config.context_length + 1)  # a window at least
    teacher_bits = evaluate(teacher, val, token_bytes, training.batch_size, args.device, training.torch_dtype,
                            teacher_tokens)["bits_per_byte"]
    print(f"teacher {args.teacher.name}: {teacher.num_params():,} parameters, held-out {teacher_bits:.3f} bits per "
          f"byte | student: {config.n_layers} layers, d_model {config.d_model} | T = {distill.temperature}, alpha = "
          f"{distill.alpha}{' (from scratch)' if distill.alpha == 0 else ''}")
    student, summary = train_student(config, teacher, tokenizer, train, val, training, distill, args.out_dir,
                                     progress=not args.no_progress, dist_info=DistInfo(device=args.device),
                                     run_info={"teacher": str(args.teacher), **dataclasses.asdict(distill)})
    export_model(student, args.out_dir / MODEL_FILE, tokenizer)
    agreement = teacher_agreement(student, teacher, val, training.batch_size, args.device, held_out)
    summary = {**summary, "teacher": str(args.teacher), "teacher_val_bits_per_byte": teacher_bits,
               "temperature": distill.temperature, "alpha": distill.alpha, "student_config": config.to_dict(),
               **{f"teacher_{name}": value for name, value in agreement.items()}}
    write_json_atomically(args.out_dir / SUMMARY_FILE, summary)
    cheaper = teacher.flops_per_token(training=False) / student.flops_per_token(training=False)
    print(f"student: {summary['parameters']:,} parameters ({cheaper:.1f}x fewer FLOPs per token than the teacher), "
          f"{summary['steps']} steps in {summary['wall_seconds']:.0f} s | "
          f"held-out {summary['val_bits_per_byte']:.3f} bits per byte (teacher {teacher_bits:.3f}) | against the "
          f"teacher: KL {agreement['kl']:.3f} nats per token, drafts accepted {agreement['acceptance']:.1%}, same "
          f"first choice {agreement['top1_agreement']:.1%}")
    print(f"{time.perf_counter() - start:.0f} s in all; saved {args.out_dir}/: {', '.join(OUTPUTS)}")
    return 0


if __name__ == "__main__":
    run_script(main)
