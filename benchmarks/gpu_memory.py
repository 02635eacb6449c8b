"""The memory planner's prediction against what one training step really allocates, per process, under torchrun.

    torchrun --standalone --nproc_per_node 1 -m benchmarks.gpu_memory --parallel fsdp --json memory.json

Each process builds the model as pretrain.py does, trains one step with the ``llmscratch.training.train`` Trainer (so
AdamW's state exists), then a second step with the allocator's peak reset before it. On CUDA the measured
peak is ``torch.cuda.max_memory_allocated`` over that step (everything the process holds: weights,
gradients, AdamW, activations, buffers); on a CPU (a check that the script runs) it is the bytes of the
parameters, gradients and AdamW moments plus the step's peak above them (``profiling.peak_memory_bytes``).
Beside it, ``llmscratch.training.memory.plan`` for that rank. Rank 0 writes the JSON; every rank prints its line.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.bench_parallel_memory import stepped_trainer
from llmscratch.files import write_json_atomically
from llmscratch.model.config import PRESETS, GPTConfig
from llmscratch.profiling import device_description, peak_memory_bytes
from llmscratch.training import distributed
from llmscratch.training.config import TrainConfig
from llmscratch.training.memory import plan
from llmscratch.training.parallel import local_bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-small", choices=sorted(PRESETS),
                        help="model shape (default: %(default)s)")
    parser.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp"], help="strategy (default: %(default)s)")
    parser.add_argument("--context-length", type=int, default=1024, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                        help="compute dtype (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None, help="write the measurements here (rank 0)")
    args = parser.parse_args(argv)
    if args.context_length < 2 or args.batch_size < 1:
        parser.error(f"need --context-length >= 2 and --batch-size >= 1, got {args.context_length} and "
                     f"{args.batch_size}")
    return args


def measure(args: argparse.Namespace, info: distributed.DistInfo, out: Path) -> dict:
    config = GPTConfig.from_preset(args.preset, context_length=args.context_length)
    train_config = TrainConfig(max_steps=2, batch_size=args.batch_size, parallel=args.parallel, dtype=args.dtype,
                               peak_tflops=1.0)
    trainer = stepped_trainer(config, train_config, info, out)
    model = trainer.model
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)
        torch.cuda.reset_peak_memory_stats(info.device)
        trainer.train_step()
        torch.cuda.synchronize(info.device)
        measured = torch.cuda.max_memory_allocated(info.device)
    else:
        resting = sum(local_bytes(trainer.model, trainer.optimizer_step.optimizer).values())
        measured = resting + peak_memory_bytes(trainer.train_step, info.device)
    planned = plan(config, args.parallel, max(info.world_size, 1), batch_size=args.batch_size,
                   context_length=args.context_length, dtype=args.dtype, rank=trainer.dp_rank,
                   device_type=info.device.type)
    return {"rank": info.rank, "world_size": info.world_size, "parallel": args.parallel, "preset": args.preset,
            "batch_size": args.batch_size, "context_length": args.context_length, "dtype": args.dtype,
            "parameters": model.num_params(), "measured_bytes": measured, "planned_bytes": planned.total,
            "planned": {k: getattr(planned, k) for k in ("parameters", "gradients", "optimizer", "buffers",
                                                          "activations")},
            "ratio": measured / planned.total, "device": device_description(info.device)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = distributed.setup(args.device)
    try:
        with tempfile.TemporaryDirectory() as out:
            result = measure(args, info, Path(out))
        print(f"rank {info.rank}: {args.preset} under {args.parallel}, measured {result['measured_bytes'] / 2**30:.2f} "
              f"GiB, planned {result['planned_bytes'] / 2**30:.2f} GiB (ratio {result['ratio']:.2f})")
        if args.json is not None and info.is_main:
            write_json_atomically(args.json, result)
    finally:
        distributed.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
