"""The memory planner's prediction against what one training step really allocates, per process, under torchrun;
and training MFU at a batch that fills the GPU.

    torchrun --standalone --nproc_per_node 1 -m benchmarks.gpu_memory --parallel fsdp --json memory.json
    python -m benchmarks.gpu_memory --preset gpt2-medium --fill 60 --compile --mfu-steps 6 --json mfu.json

Each process builds the model as pretrain.py does, trains one step with the ``llmscratch.training.train`` Trainer (so
AdamW's state exists), then a second step with the allocator's peak reset before it. On CUDA the measured
peak is ``torch.cuda.max_memory_allocated`` over that step (everything the process holds: weights,
gradients, AdamW, activations, buffers); on a CPU (a check that the script runs) it is the bytes of the
parameters, gradients and AdamW moments plus the step's peak above them (``profiling.peak_memory_bytes``).
Beside it, ``llmscratch.training.memory.plan`` for that rank. Rank 0 writes the JSON; every rank prints its line.

``--fill GIB`` takes the largest power-of-two batch whose planned step fits in GIB (a shape that fills the GPU);
``--mfu-steps N`` then times N more steps and reports tokens/s and MFU by the Trainer's own formula (model
FLOPs per token x tokens/s over the device's peak, ``training.flops.peak_flops``: the GPU's datasheet; none
on a CPU). The vocabulary is the preset's, unpadded.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_parallel_memory import stepped_trainer
from llmscratch.files import write_json_atomically
from llmscratch.model.config import PRESETS, GPTConfig
from llmscratch.profiling import device_description, peak_memory_bytes
from llmscratch.training import distributed
from llmscratch.training.config import TrainConfig
from llmscratch.training.flops import peak_flops
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
    parser.add_argument("--fill", type=float, default=None, metavar="GIB",
                        help="instead of --batch-size, the largest power-of-two batch whose planned step fits in "
                             "GIB gibibytes")
    parser.add_argument("--compile", action="store_true", help="train through torch.compile (one process only)")
    parser.add_argument("--mfu-steps", type=int, default=0,
                        help="time this many more steps and report tokens/s and MFU, medians (default: none)")
    parser.add_argument("--json", type=Path, default=None, help="write the measurements here (rank 0)")
    args = parser.parse_args(argv)
    if args.context_length < 2 or args.batch_size < 1:
        parser.error(f"need --context-length >= 2 and --batch-size >= 1, got {args.context_length} and "
                     f"{args.batch_size}")
    if args.fill is not None and args.fill <= 0:
        parser.error(f"--fill must be a positive number of GiB, got {args.fill}")
    if args.mfu_steps < 0:
        parser.error(f"--mfu-steps must be 0 or more, got {args.mfu_steps}")
    return args


def filling_batch(config: GPTConfig, args: argparse.Namespace, world_size: int, device_type: str) -> int:
    """The largest power-of-two batch whose planned step (``memory.plan``) fits in ``args.fill`` GiB; at least 1."""
    def planned(batch: int) -> int:
        return plan(config, args.parallel, world_size, batch_size=batch, context_length=args.context_length,
                    dtype=args.dtype, device_type=device_type).total

    batch = 1
    while planned(2 * batch) <= args.fill * 2**30:
        batch *= 2
    return batch


def timed_steps(trainer, steps: int, info: distributed.DistInfo, batch_size: int, context_length: int,
                dtype: torch.dtype) -> dict:
    """Tokens/s and MFU over ``steps`` more training steps (their median), as Trainer._speed counts them."""
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step()  # its loss's .item() waits for the GPU
        seconds.append(time.perf_counter() - start)
    tokens_per_s = batch_size * context_length * max(info.world_size, 1) / statistics.median(seconds)
    peak = peak_flops(info.device, dtype) if info.device.type == "cuda" else None
    flops = trainer.model.flops_per_token(context_length)
    return {"step_seconds": seconds, "tokens_per_s": tokens_per_s, "flops_per_token": flops,
            "peak_flops": peak, "mfu": flops * tokens_per_s / (peak * max(info.world_size, 1)) if peak else None}


def measure(args: argparse.Namespace, info: distributed.DistInfo, out: Path) -> dict:
    config = GPTConfig.from_preset(args.preset, context_length=args.context_length)
    world_size = max(info.world_size, 1)
    if args.fill is not None:
        args.batch_size = filling_batch(config, args, world_size, info.device.type)
    train_config = TrainConfig(max_steps=2 + args.mfu_steps, batch_size=args.batch_size, parallel=args.parallel,
                               dtype=args.dtype, compile=args.compile, peak_tflops=1.0)
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
    planned = plan(config, args.parallel, world_size, batch_size=args.batch_size,
                   context_length=args.context_length, dtype=args.dtype, rank=trainer.dp_rank,
                   device_type=info.device.type)
    return {"rank": info.rank, "world_size": info.world_size, "parallel": args.parallel, "preset": args.preset,
            "batch_size": args.batch_size, "context_length": args.context_length, "dtype": args.dtype,
            "parameters": model.num_params(), "measured_bytes": measured, "planned_bytes": planned.total,
            "planned": {k: getattr(planned, k) for k in ("parameters", "gradients", "optimizer", "buffers",
                                                          "activations")},
            "ratio": measured / planned.total, "device": device_description(info.device), "compile": args.compile,
            "fill_gib": args.fill,
            "speed": timed_steps(trainer, args.mfu_steps, info, args.batch_size, args.context_length,
                                 train_config.torch_dtype) if args.mfu_steps else None}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = distributed.setup(args.device)
    try:
        with tempfile.TemporaryDirectory() as out:
            result = measure(args, info, Path(out))
        print(f"rank {info.rank}: {args.preset} under {args.parallel}, batch {args.batch_size}, measured "
              f"{result['measured_bytes'] / 2**30:.2f} GiB, planned {result['planned_bytes'] / 2**30:.2f} GiB "
              f"(ratio {result['ratio']:.2f})")
        if (speed := result["speed"]) is not None:
            mfu = f"MFU {speed['mfu']:.1%}" if speed["mfu"] is not None else "no peak FLOP/s known here"
            print(f"rank {info.rank}: {speed['tokens_per_s']:,.0f} tokens/s over {args.mfu_steps} steps (median), {mfu}")
        if args.json is not None and info.is_main:
            write_json_atomically(args.json, result)
    finally:
        distributed.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
