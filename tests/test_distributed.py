"""DistributedDataParallel on CPU (gloo): two processes train as one process with their joint batch (to float32 rounding)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from processes import run as run_process
from processes import spawn, torchrun
from tiny_training import PRETRAIN, PRETRAIN_FLAGS, TEXT, JointBatches, losses, make_trainer, tokens
from tolerances import assert_adamw_runs_agree

from llmscratch.device import resolve_device
from llmscratch.model.checkpoint import load_checkpoint
from llmscratch.training import distributed
from llmscratch.training.distributed import DistInfo

# A constant learning rate: a run resumed with a larger max_steps keeps the schedule it had.
SETTINGS = dict(batch_size=2, grad_accum=2, lr=3e-3, min_lr=3e-3, warmup_steps=0, eval_interval=3,
                checkpoint_interval=3, eval_tokens=128, final_eval_tokens=400)
STEPS = 6


def ddp_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """3 steps, a checkpoint, a resume in new Trainers, 3 more steps; each rank writes what it saw."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = train_and_resume(DistInfo(rank=rank, local_rank=rank, world_size=world_size,
                                           device=torch.device("cpu")), out_dir)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        distributed.teardown()  # the Trainers and their DDP wrappers are gone by now: see teardown()


def train_and_resume(info: DistInfo, out_dir: str) -> dict:
    """The run itself, in its own function so that no Trainer outlives it (and the process group)."""
    first = make_trainer(out_dir, dist_info=info, max_steps=STEPS // 2, **SETTINGS)
    first.fit(progress=False)
    second = make_trainer(out_dir, dist_info=info, max_steps=STEPS, **SETTINGS)
    second.fit(resume=True, progress=False)
    return {"losses": losses(first) + losses(second), "val": second.evaluate(400),
            "state": second.model.state_dict(), "peak_flops_all": second.peak_flops_all,
            "tokens_per_step": second.tokens_per_step}


@pytest.mark.timeout(420)
@pytest.mark.slow
def test_two_gloo_processes_match_one_process_with_the_same_global_batch(tmp_path):
    spawn(ddp_worker, (2, str(tmp_path / "store"), str(tmp_path / "run")), nprocs=2, timeout=300)
    ranks = [torch.load(tmp_path / "run" / f"rank{r}.pt", weights_only=True) for r in range(2)]

    single = make_trainer(tmp_path / "single", max_steps=STEPS, **{**SETTINGS, "batch_size": 4})
    single.batches = JointBatches(tokens()[0])
    single_losses = [single.train_step()[0] for _ in range(STEPS)]
    reference = single.model.state_dict()

    for result in ranks:  # both processes hold the weights of the single process, up to float32 rounding
        assert_adamw_runs_agree(result["state"], reference, lr=SETTINGS["lr"], steps=STEPS)
        # The logged loss is the mean over both processes: the loss of the joint batch. Losses of about 5
        # nats agree to float32 rounding of the sums (~1e-6): the weights that rounding can move far
        # (see tolerances.py) are those with near-zero gradients, to which the loss is insensitive.
        assert result["losses"] == pytest.approx(single_losses, abs=1e-5)
        # Evaluation: each process takes every other window; the sums are added up.
        single_val = single.evaluate(400)
        assert result["val"] == pytest.approx(single_val, rel=1e-6)
        # Throughput and MFU count both processes.
        assert result["tokens_per_step"] == 2 * 2 * 2 * 16
        assert result["peak_flops_all"] == 2 * 1e12
    state = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert state["step"] == STEPS and len(state["batches"]) == len(state["rng"]) == 2
    assert [b["rank"] for b in state["batches"]] == [0, 1]


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_torchrun_runs_the_pretraining_script_unchanged(tmp_path):
    """The script under torchrun with 2 CPU processes, then resumed under torchrun to more steps."""
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    flags = ["--data", str(tmp_path / "text.txt"), "--out-dir", str(tmp_path / "run"), *PRETRAIN_FLAGS, "--device",
             "cpu"]
    first = torchrun(PRETRAIN, [*flags, "--max-steps", "3"], timeout=400)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "2 process(es) on cpu" in first.stdout
    assert first.stdout.count("done in") == 1  # only rank 0 reports
    second = torchrun(PRETRAIN, [*flags, "--max-steps", "5", "--resume"], timeout=400)
    assert second.returncode == 0, second.stdout + second.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["tokens_seen"] == 5 * 2 * 2 * 16
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    assert len(load_checkpoint(tmp_path / "run" / "checkpoint.pt")["batches"]) == 2


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_one_torchrun_process_takes_the_parallel_path_and_trains_as_a_plain_process(tmp_path):
    """torchrun --nproc_per_node 1 (a machine with one GPU) wraps and shards as with many processes: --parallel fsdp
    writes the sharded checkpoint folder, and the losses are those of the same run without torchrun."""
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    # float32 on every CPU: with AMX units the default is bfloat16, whose rounding FSDP's other order of sums
    # moves by more than the 1e-5 compared below (seen on an Intel Xeon with AMX).
    flags = ["--data", str(tmp_path / "text.txt"), *PRETRAIN_FLAGS, "--device", "cpu", "--max-steps", "3",
             "--dtype", "float32"]
    for parallel in ("ddp", "fsdp"):
        launched = torchrun(PRETRAIN, [*flags, "--out-dir", str(tmp_path / parallel), "--parallel", parallel],
                            timeout=300, nproc=1)
        assert launched.returncode == 0, launched.stdout + launched.stderr
    assert (tmp_path / "fsdp" / "checkpoint").is_dir() and not (tmp_path / "fsdp" / "checkpoint.pt").exists()
    assert "(fsdp: sharded)" in launched.stdout
    plain = run_process([sys.executable, str(PRETRAIN), *flags, "--out-dir", str(tmp_path / "plain")], timeout=300,
                        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert plain.returncode == 0, plain.stderr
    def run_losses(folder: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]

    for parallel in ("ddp", "fsdp"):
        assert run_losses(tmp_path / parallel) == pytest.approx(run_losses(tmp_path / "plain"), rel=1e-5), parallel


def test_device_names_are_checked():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="not a device name"):
        resolve_device("gpu0")
    with pytest.raises(ValueError, match="cuda:99"):
        resolve_device("cuda:99")
    with pytest.raises(ValueError, match="not supported"):
        resolve_device("meta")
