"""Distributed data parallel with torch.distributed: who am I, which device, how to reduce.

``torchrun --nproc_per_node=N script.py`` sets RANK, LOCAL_RANK and WORLD_SIZE for each
process; without them everything here degrades to a single process.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' is CUDA when available, else CPU; anything else must exist on this machine."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for, but this torch sees no CUDA GPU")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name!r} was asked for, but MPS is not available here")
    return device


def setup(device_name: str = "auto") -> DistInfo:
    """Join the process group when launched by torchrun (NCCL on CUDA, gloo on CPU)."""
    if "RANK" not in os.environ:
        return DistInfo(device=resolve_device(device_name))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = resolve_device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)  # one GPU per process
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all processes in place (a no-op for one process); returns it."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_objects(obj: object) -> list[object]:
    """Every process's ``obj``, in rank order (a one-element list for one process)."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
