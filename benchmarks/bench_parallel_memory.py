"""Per-rank memory of one training step under DDP, FSDP, tensor parallelism and FSDP + TP, measured on CPU.

    python -m benchmarks.bench_parallel_memory                 # llama-small, 4 processes (gloo), batch 4 x 256
    python -m benchmarks.bench_parallel_memory --processes 2 --preset llama-mini

Each strategy runs in fresh processes (the Trainer of ``llmscratch.training.train``, float32): one optimizer
step (so AdamW's state exists), then one more forward and backward (so gradients exist). Per rank it
records the bytes of its own parameters, gradients and AdamW moments (``parallel.local_bytes``: a
DTensor's local shard), the bytes autograd saved for backward in that forward (each storage once; the
weights FSDP gathers for a moment are freed again by then and count 0), and the growth of the
process's peak resident memory since before the model was built (everything: gathered weights,
communication buffers, the allocator's slack). Next to them, what ``python -m llmscratch.training.memory``
plans for that rank. Prints a Markdown section.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import machine_description, today
from llmscratch.model.config import PRESETS, GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.profiling import peak_memory_bytes
from llmscratch.text.tokenizer import BPETokenizer
from llmscratch.training.config import TrainConfig
from llmscratch.training.distributed import DistInfo
from llmscratch.training.memory import format_bytes, plan
from llmscratch.training.parallel import local_bytes
from llmscratch.training.train import Trainer

STRATEGIES = ("ddp", "fsdp", "tp", "fsdp+tp")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def saved_bytes(trainer: Trainer) -> int:
    """Bytes of the storages autograd saves in one forward of a micro-batch (each once; then backward runs)."""
    owned = {_local(p).untyped_storage().data_ptr() for p in trainer.model.parameters()}
    storages = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = _local(tensor).untyped_storage()
        if storage.data_ptr() not in owned:
            storages[storage.data_ptr()] = storage
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = trainer._loss(next(trainer.batches))
    loss.backward()
    return sum(s.nbytes() for s in storages.values())  # FSDP's gathered weights are freed again: 0 bytes


def stepped_trainer(config: GPTConfig, train_config: TrainConfig, info: DistInfo, out: Path) -> Trainer:
    """A Trainer of ``config`` on random tokens, built as pretrain.py builds it (sharded: rank 0 alone holds the
    whole model), after one step: AdamW's state exists."""
    torch.manual_seed(0)
    sharded = train_config.parallel != "ddp" and info.enabled
    with torch.device("meta") if sharded and not info.is_main else torch.device("cpu"):
        model = GPT(config)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 200_000).astype(np.uint16)
    tokenizer = BPETokenizer.train("Call me Ishmael. " * 20, 260, name="bench")  # (its byte lengths only)
    trainer = Trainer(model, train_config, tokens, tokens[:4096], out, tokenizer, info)
    trainer.train_step()
    return trainer


def worker(rank: int, world_size: int, init_file: str, out: str, settings: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        info = DistInfo(rank=rank, local_rank=rank, world_size=world_size, device=torch.device("cpu"))
        train_config = TrainConfig(max_steps=2, batch_size=settings["batch_size"], parallel=settings["parallel"],
                                   tp=settings["tp"], peak_tflops=1.0)
        trainer = stepped_trainer(model_config(settings), train_config, info, Path(out) / "run")
        step_peak = peak_memory_bytes(trainer.train_step, "cpu")  # a whole step, above the resting state
        activations = saved_bytes(trainer)  # one more forward and backward: the gradients exist now
        result = {**local_bytes(trainer.model, trainer.optimizer_step.optimizer), "activations": activations,
                  "step_peak": step_peak, "mesh": (trainer.dp, trainer.tp), "dp_rank": trainer.dp_rank}
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def model_config(settings: dict) -> GPTConfig:
    return GPTConfig.from_preset(settings["preset"], context_length=settings["context_length"])


def measure(settings: dict) -> list[dict]:
    """Every rank's measurements for one strategy, from fresh processes."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(settings["processes"], f"{out}/store", out, settings),
                           nprocs=settings["processes"], start_method="spawn")
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(settings["processes"])]


def section(args: argparse.Namespace) -> str:
    config = model_config(vars(args))
    lines = [f"### Per-rank memory of a training step ({today()})", "",
             f"Command: `python -m benchmarks.bench_parallel_memory --preset {args.preset} --processes "
             f"{args.processes} --tp {args.tp} --context-length {args.context_length} --batch-size {args.batch_size}`  ",
             f"Machine: {machine_description()}; {args.processes} gloo processes, 1 thread each, float32.  ",
             f"Model: {args.preset} ({GPT(config).num_params():,} parameters), micro-batch {args.batch_size} x "
             f"{args.context_length} tokens per rank.", "",
             "Measured per rank: its own parameters, gradients and AdamW moments (a DTensor's local shard), the "
             "bytes autograd saved in one forward, and the peak a whole step allocated above the resting state "
             "(PyTorch's CPU allocations replayed from the profiler). Planned: "
             "`python -m llmscratch.training.memory` for "
             "that rank (its optimizer column also counts AdamW's step counters; its activations add the loss's "
             "chunk buffers; its buffers are what FSDP gathers or DDP buckets).", "",
             "| strategy | dp x tp | rank | parameters | gradients | AdamW | saved activations | step peak "
             "| planned parameters / gradients / AdamW / buffers / activations |",
             "|---|---|---|---|---|---|---|---|---|"]
    for strategy in STRATEGIES:
        tp = {"ddp": 1, "fsdp": 1, "tp": args.processes, "fsdp+tp": args.tp}[strategy]
        ranks = measure({**vars(args), "parallel": strategy, "tp": tp if strategy == "fsdp+tp" else 1})
        for rank, r in enumerate(ranks):
            planned = plan(config, strategy, args.processes, tp=tp, batch_size=args.batch_size,
                           context_length=args.context_length, rank=r["dp_rank"], device_type="cpu")
            planned_text = " / ".join(format_bytes(getattr(planned, k)) for k in
                                      ("parameters", "gradients", "optimizer", "buffers", "activations"))
            lines.append(f"| {strategy} | {r['mesh'][0]} x {r['mesh'][1]} | {rank} | {format_bytes(r['parameters'])} "
                         f"| {format_bytes(r['gradients'])} | {format_bytes(r['optimizer'])} "
                         f"| {format_bytes(r['activations'])} | {format_bytes(r['step_peak'])} | {planned_text} |")
        print(f"{strategy}: done", file=sys.stderr)
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-small", choices=sorted(PRESETS), help="model shape (default: %(default)s)")
    parser.add_argument("--processes", type=int, default=4, help="gloo processes on this CPU (default: %(default)s)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel group size under fsdp+tp (default: %(default)s)")
    parser.add_argument("--context-length", type=int, default=256, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch per rank (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="accepted for `python -m benchmarks`; each process uses 1")
    return parser.parse_args(argv)


if __name__ == "__main__":
    print(section(parse_args()))
