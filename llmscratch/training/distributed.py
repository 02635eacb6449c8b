"""Distributed data parallel with torch.distributed: who am I, which device, how to talk.

``torchrun --nproc_per_node=N script.py`` sets RANK, LOCAL_RANK and WORLD_SIZE for each
process; without them everything here degrades to a single process, and every collective
below is a no-op that returns its input.
"""

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmscratch.device import resolve_device


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    launched: bool = False  # started by torchrun, in a process group (also as its only process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """In a process group: DDP wraps and FSDP shards, also over one process (torchrun --nproc_per_node 1,
        as on a machine with one GPU: the same code path as on eight)."""
        return self.world_size > 1 or self.launched


def setup(device_name: str = "auto") -> DistInfo:
    """Join the process group when launched by torchrun (NCCL on CUDA, gloo on CPU).

    Each process drives one GPU, the one numbered by its LOCAL_RANK on its node.
    """
    device = resolve_device(device_name)
    if "RANK" not in os.environ:
        return DistInfo(device=device)
    try:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError) as err:
        raise ValueError(f"RANK is set but the torchrun environment is incomplete or wrong: {err!r}") from None
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPU(s); "
                             f"use --nproc_per_node of at most that")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    elif device.type == "mps" and world_size > 1:
        raise ValueError("several processes on MPS are not supported by torch.distributed; use cpu or cuda")
    if not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group(backend="nccl", device_id=device)
        else:
            dist.init_process_group(backend="gloo")
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device, launched=True)


def teardown() -> None:
    """Leave the process group. Call it after every DDP wrapper (and Trainer holding one) is gone.

    Order matters: a DDP reducer that outlives ``destroy_process_group`` is freed later, at exit,
    and freeing it frees the gloo group, whose destructor joins gloo's worker thread while holding
    the GIL; if that thread is waiting for the GIL to drop a Python object, the process hangs.
    So collect what is already garbage first, then destroy the group while nothing else holds it.
    """
    if dist.is_initialized():
        gc.collect()  # wrappers kept alive only by reference cycles go now, not at interpreter exit
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all processes in place (a no-op for one process); returns it."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Average ``tensor`` over all processes in place; returns it."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= dist.get_world_size()
    return tensor


def any_process(flag: bool, device: torch.device) -> bool:
    """True on every process if ``flag`` is true on at least one (so all stop together)."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


# What gloo and NCCL say when the process at the other end of a collective is gone.
_LOST_PEER = ("closed by peer", "reset by peer", "Broken pipe", "Connection refused", "communicator was aborted")


def lost_peer(err: BaseException) -> bool:
    """True when ``err`` is a collective failing because another process of the run has died."""
    return dist.is_initialized() and isinstance(err, RuntimeError) and any(text in str(err) for text in _LOST_PEER)


def all_gather_objects(obj: object) -> list[object]:
    """Every process's ``obj``, in rank order (a one-element list for one process)."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj: object) -> object:
    """Rank 0's ``obj`` on every process (whatever the others passed)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
