"""Tensor parallelism on CPU (gloo, 2 processes): the heads and the MLP split across ranks train as one process
with the same batch; each rank holds what the memory planner says; checkpoints resume exactly; bad meshes refused.

fsdp+tp runs here on meshes of 1 x 2 (tp inside, an FSDP dimension of 1) and 2 x 1 (FSDP alone) with the
others, and on a real 2 x 2 mesh of 4 processes in a test of its own. bfloat16: autocast under tp, FSDP's
policy under fsdp+tp.
"""

import copy
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from processes import run, spawn
from tiny_training import DESIGNS, PRETRAIN, TEXT, JointBatches, StopAfter, losses, make_trainer, model_config, tokens
from tolerances import assert_adamw_runs_agree
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from llmscratch.config import ConfigError
from llmscratch.model.checkpoint import model_from_checkpoint
from llmscratch.model.gpt import GPT
from llmscratch.training import distributed, memory
from llmscratch.training.config import TrainConfig
from llmscratch.training.distributed import DistInfo
from llmscratch.training.parallel import fused_qkv_state, local_bytes
from llmscratch.training.train import Trainer

# A constant learning rate: a run resumed with a larger max_steps keeps the schedule it had.
SETTINGS = dict(batch_size=4, grad_accum=2, lr=3e-3, min_lr=3e-3, warmup_steps=0, eval_interval=3,
                checkpoint_interval=3, eval_tokens=128, final_eval_tokens=400, parallel="tp")
STEPS = 5
MESHES = {"fsdp+tp 1x2": dict(parallel="fsdp+tp", tp=2), "fsdp+tp 2x1": dict(parallel="fsdp+tp", tp=1)}
BFLOAT16 = {"tp": dict(dtype="bfloat16"), "fsdp+tp 1x2": dict(parallel="fsdp+tp", tp=2, dtype="bfloat16")}


def full_model(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The whole weights as one process names them (q, k, v fused back into qkv), on every rank."""
    state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    return copy.deepcopy(fused_qkv_state(state))


def full_optimizer(trainer: Trainer) -> dict[str, torch.Tensor]:
    """AdamW's whole state as "parameter.kind" (q, k, v fused back into qkv), on every rank."""
    state = get_optimizer_state_dict(trainer.model, trainer.optimizer_step.optimizer,
                                     options=StateDictOptions(full_state_dict=True))["state"]
    kinds = {kind for entries in state.values() for kind in entries}
    fused = {kind: fused_qkv_state({name: entries[kind] for name, entries in state.items()}) for kind in kinds}
    return copy.deepcopy({f"{name}.{kind}": value for kind, tensors in fused.items()
                          for name, value in tensors.items()})


def tp_worker(rank: int, world_size: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        info = DistInfo(rank=rank, local_rank=rank, world_size=world_size, device=torch.device("cpu"))
        torch.save(train_parallel(info, Path(out)), Path(out) / f"rank{rank}.pt")
    finally:
        distributed.teardown()


def train_parallel(info: DistInfo, out: Path) -> dict:
    """Per design under tp: a straight run (exported), one stopped at step 3 and resumed; then the fsdp+tp meshes."""
    result = {}
    for name, overrides in DESIGNS.items():
        straight = make_trainer(out / name / "straight", overrides, info, max_steps=STEPS, **SETTINGS)
        before = local_bytes(straight.model)
        straight.fit(progress=False)
        straight.export(out / name / "model.safetensors")
        stopped = make_trainer(out / name / "stopped", overrides, info, max_steps=STEPS, **SETTINGS)
        stopped.__class__ = StopAfter
        with pytest.raises(Exception, match="stopped at step 3"):  # TrainingStopped
            stopped.fit(progress=False)
        resumed = make_trainer(out / name / "stopped", overrides, info, max_steps=STEPS, **SETTINGS)
        resumed.fit(resume=True, progress=False)
        from_one = make_trainer(out / name / "from_one", overrides, info, max_steps=5, **SETTINGS)
        from_one.load()  # written by one process (qkv fused) before these two started
        loaded_model, loaded_optimizer = full_model(from_one), full_optimizer(from_one)
        from_one.fit(resume=True, progress=False)
        result[name] = {
            "losses": losses(straight), "grad_norms": [r["grad_norm"] for r in straight.history],
            "val": straight.evaluate(400), "sample": straight.history[-1].get("sample"),
            "model": full_model(straight), "optimizer": full_optimizer(straight), "bytes_before": before,
            "bytes_after": local_bytes(straight.model, straight.optimizer_step.optimizer),
            "all_dtensors": all(isinstance(p, DTensor) for p in straight.model.parameters()),
            "tied": straight.model.lm_head.weight is straight.model.token_embedding.weight,
            "stopped_losses": losses(stopped) + losses(resumed), "resumed_model": full_model(resumed),
            "from_one_model": loaded_model, "from_one_optimizer": loaded_optimizer,
            "from_one_steps": [r["step"] for r in from_one.history],
        }
    for mesh, settings in MESHES.items():
        trainer = make_trainer(out / mesh, DESIGNS["llama"], info, max_steps=3, **{**SETTINGS, **settings})
        trainer.fit(progress=False)
        result[mesh] = {"losses": losses(trainer), "model": full_model(trainer), "dp": trainer.dp, "tp": trainer.tp}
    for mesh, settings in BFLOAT16.items():
        trainer = make_trainer(out / "bfloat16" / mesh, DESIGNS["llama"], info, max_steps=3, **{**SETTINGS, **settings})
        trainer.fit(progress=False)
        result[f"{mesh} bfloat16"] = {"losses": losses(trainer), "dtypes": {p.dtype for p in trainer.model.parameters()}}
    return result


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("tp")
    for name, overrides in DESIGNS.items():  # one process, parallel="tp": the same sharded format, qkv fused
        one = make_trainer(out / name / "from_one", overrides, max_steps=3, **SETTINGS)
        one.fit(progress=False)
        torch.save({"model": one.model.state_dict(), "optimizer": full_optimizer(one)}, out / name / "one.pt")
    spawn(tp_worker, (2, str(out / "store"), str(out)), nprocs=2, timeout=500)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def single_run(out: Path, name: str, steps: int, **settings) -> Trainer:
    """One process, the same batch: under tp (dp = 1) every rank reads the stream of data rank 0."""
    trainer = make_trainer(out / name / "single", DESIGNS[name], max_steps=steps, **{**SETTINGS, **settings})
    trainer.fit(progress=False)
    return trainer


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", list(DESIGNS))
@pytest.mark.slow
def test_tp_matches_one_process_with_the_same_batch(tp_runs, name):
    out, ranks = tp_runs
    result = ranks[0][name]
    single = single_run(out, name, STEPS)
    # Equal in exact arithmetic; the split matmuls and the all-reduce sum in another order: float32 rounding.
    assert_adamw_runs_agree(result["model"], single.model.state_dict(), lr=SETTINGS["lr"], steps=STEPS)
    assert result["losses"] == pytest.approx(losses(single), abs=1e-5)
    assert result["grad_norms"] == pytest.approx([r["grad_norm"] for r in single.history], rel=1e-5)
    assert result["val"] == pytest.approx(single.evaluate(400), rel=1e-5)
    assert ranks[1][name]["losses"] == result["losses"]  # both ranks computed the same loss
    assert all(torch.equal(ranks[1][name]["model"][k], v) for k, v in result["model"].items())
    assert result["sample"] and ranks[1][name]["sample"] is None  # all ranks generate, rank 0 records
    assert result["all_dtensors"] and result["tied"] == DESIGNS[name]["tie_embeddings"]
    # model.safetensors: one ordinary file, the gathered weights with the fused qkv of one process.
    exported = model_from_checkpoint(out / name / "model.safetensors").state_dict()
    assert exported.keys() == single.model.state_dict().keys()
    assert all(torch.equal(exported[k], result["model"][k]) for k in exported)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.slow
def test_fsdp_tp_matches_one_process(tp_runs, mesh):
    out, ranks = tp_runs
    result = ranks[0][mesh]
    assert (result["dp"], result["tp"]) == ((1, 2) if mesh.endswith("1x2") else (2, 1))
    # 1 x 2: one batch stream, as one process with the same batch_size; 2 x 1: two streams, read as one batch.
    reference = make_trainer(out / mesh / "single", DESIGNS["llama"], max_steps=3,
                             **{**SETTINGS, "batch_size": SETTINGS["batch_size"] * result["dp"]})
    if result["dp"] == 2:
        reference.batches = JointBatches(tokens()[0], SETTINGS["batch_size"], reference.config.seed)
    steps = [reference.train_step() for _ in range(3)]
    assert result["losses"] == pytest.approx([loss for loss, _ in steps], abs=1e-5)
    assert_adamw_runs_agree(result["model"], reference.model.state_dict(), lr=SETTINGS["lr"], steps=3)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("mesh", list(BFLOAT16))
@pytest.mark.slow
def test_bfloat16_under_tensor_parallelism_trains_close_to_float32(tp_runs, mesh):
    _, ranks = tp_runs
    mixed, exact = ranks[0][f"{mesh} bfloat16"]["losses"], ranks[0]["llama"]["losses"][:3]
    assert ranks[0][f"{mesh} bfloat16"]["dtypes"] == {torch.float32}  # the weights AdamW updates stay float32
    # bfloat16 keeps 8 bits of mantissa: a loss of ~5.7 is rounded by up to ~0.02 in each matmul's output.
    assert mixed == pytest.approx(exact, abs=0.05)
    assert mixed != pytest.approx(exact, abs=1e-5)  # and it did compute in bfloat16
    assert ranks[1][f"{mesh} bfloat16"]["losses"] == mixed


def mesh_worker(rank: int, world_size: int, init_file: str, out: str) -> None:
    """fsdp+tp on a 2 x 2 mesh: 3 steps; the whole weights and this rank's shard sizes saved."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        info = DistInfo(rank=rank, local_rank=rank, world_size=world_size, device=torch.device("cpu"))
        trainer = make_trainer(Path(out) / "run", DESIGNS["llama"], info, max_steps=3,
                               **{**SETTINGS, "parallel": "fsdp+tp", "tp": 2})
        trainer.fit(progress=False)
        result = {"losses": losses(trainer), "model": full_model(trainer), "mesh": (trainer.dp, trainer.tp),
                  "bytes": local_bytes(trainer.model, trainer.optimizer_step.optimizer)}
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        distributed.teardown()


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_fsdp_tp_on_a_2x2_mesh_matches_one_process(tmp_path):
    """4 processes: tp groups {0, 1} and {2, 3} each split the heads; FSDP shards both halves over the 2 groups."""
    spawn(mesh_worker, (4, str(tmp_path / "store"), str(tmp_path)), nprocs=4, timeout=400)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    assert [r["mesh"] for r in ranks] == [(2, 2)] * 4
    reference = make_trainer(tmp_path / "single", DESIGNS["llama"], max_steps=3,
                             **{**SETTINGS, "batch_size": 2 * SETTINGS["batch_size"]})
    reference.batches = JointBatches(tokens()[0], SETTINGS["batch_size"], reference.config.seed)
    steps = [reference.train_step() for _ in range(3)]
    assert ranks[0]["losses"] == pytest.approx([loss for loss, _ in steps], abs=1e-5)
    assert_adamw_runs_agree(ranks[0]["model"], reference.model.state_dict(), lr=SETTINGS["lr"], steps=3)
    whole = local_bytes(reference.model)["parameters"]
    for rank, result in enumerate(ranks):
        assert result["losses"] == ranks[0]["losses"]
        # What the planner says this rank holds (its FSDP shard: rank // tp), to the byte.
        planned = memory.plan(model_config(**DESIGNS["llama"]), "fsdp+tp", gpus=4, tp=2, rank=rank // 2)
        assert result["bytes"]["parameters"] == planned.parameters
        assert result["bytes"]["optimizer"] == 2 * planned.parameters
        assert whole / 4 < result["bytes"]["parameters"] < whole / 2  # replicated embeddings and norms: above 1/4


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", list(DESIGNS))
@pytest.mark.slow
def test_each_rank_holds_what_the_planner_says(tp_runs, name):
    _, ranks = tp_runs
    config = model_config(**DESIGNS[name])
    planned = memory.plan(config, "tp", gpus=2, tp=2)
    whole = local_bytes(GPT(config))["parameters"]
    for r in range(2):
        held = ranks[r][name]["bytes_after"]
        assert ranks[r][name]["bytes_before"]["parameters"] == planned.parameters
        assert held["parameters"] == planned.parameters  # (the gradients are freed after the step)
        # AdamW's two moments; the planner also counts a float32 step counter per tensor (local_bytes does not).
        assert held["optimizer"] == 2 * planned.parameters
        assert whole / 2 < held["parameters"] < whole  # the replicated embeddings and norms keep it above half


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", list(DESIGNS))
@pytest.mark.slow
def test_tp_checkpoints_resume_exactly(tp_runs, name):
    out, ranks = tp_runs
    result = ranks[0][name]
    assert result["stopped_losses"] == result["losses"]  # bit for bit
    assert all(torch.equal(result["resumed_model"][k], v) for k, v in result["model"].items())
    # 1 -> 2: what two tp processes loaded (q, k, v split) is exactly what one process saved (qkv fused).
    one = torch.load(out / name / "one.pt", weights_only=True)
    assert all(torch.equal(result["from_one_model"][k], v) for k, v in one["model"].items())
    assert result["from_one_optimizer"].keys() == one["optimizer"].keys()
    assert all(torch.equal(result["from_one_optimizer"][k], v) for k, v in one["optimizer"].items())
    assert result["from_one_steps"] == [4, 5]  # and training went on
    # 2 -> 1: one process (qkv fused) loads the tp checkpoint of the last step and trains on.
    folder = out / name / "two_to_one"
    shutil.copytree(out / name / "straight", folder)
    alone = make_trainer(folder, DESIGNS[name], max_steps=STEPS + 2, **SETTINGS)
    with pytest.warns(UserWarning, match="dp x tp = 1 x 2"):
        alone.load()
    assert alone.step == STEPS
    assert all(torch.equal(alone.model.state_dict()[k], v) for k, v in result["model"].items())
    expected = result["optimizer"]
    assert full_optimizer(alone).keys() == expected.keys()
    assert all(torch.equal(full_optimizer(alone)[k], v) for k, v in expected.items())
    with pytest.warns(UserWarning, match="data streams"):
        alone.fit(resume=True, progress=False)
    assert [r["step"] for r in alone.history] == [STEPS + 1, STEPS + 2]


def fake_processes(world_size: int) -> DistInfo:
    """What a Trainer is told under torchrun, without a process group: the mesh is checked before one is used."""
    return DistInfo(rank=0, local_rank=0, world_size=world_size, device=torch.device("cpu"))


@pytest.mark.parametrize("model, settings, world_size, message", [
    (dict(n_heads=4, n_kv_heads=2), dict(parallel="tp"), 3, "tp=3 does not divide n_heads=4"),
    (dict(n_heads=4, n_kv_heads=1), dict(parallel="tp"), 2, "tp=2 does not divide n_kv_heads=1"),
    (dict(d_ff=66, n_heads=4, n_kv_heads=2), dict(parallel="tp"), 4, "tp=4 does not divide n_kv_heads=2"),
    (dict(d_ff=65), dict(parallel="tp"), 2, "tp=2 does not divide d_ff=65"),
    (dict(), dict(parallel="fsdp+tp", tp=2), 3, "tp=2 does not divide world_size=3"),
    (dict(), dict(parallel="fsdp+tp", tp=2), 1, "tp=2 does not divide world_size=1"),
])
def test_a_mesh_that_does_not_divide_the_model_is_refused_before_training(tmp_path, model, settings, world_size,
                                                                          message):
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, model, fake_processes(world_size) if world_size > 1 else None, **settings)
    assert not any(tmp_path.iterdir())  # nothing written


def test_tp_settings_are_checked_in_the_config():
    with pytest.raises(ConfigError, match=r"tp .*--parallel fsdp\+tp.* 1"):
        TrainConfig(parallel="fsdp", tp=2)
    with pytest.raises(ConfigError, match="tp must be a positive integer"):
        TrainConfig(parallel="fsdp+tp", tp=0)
    with pytest.raises(ConfigError, match="cannot be tp with dtype float16"):
        TrainConfig(parallel="tp", dtype="float16")


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_script_refuses_a_bad_mesh_before_training(tmp_path):
    (tmp_path / "text.txt").write_text(TEXT[:5000], encoding="utf-8")
    result = run([sys.executable, str(PRETRAIN), "--data", str(tmp_path / "text.txt"), "--tokenizer", "bpe:300",
                  "--preset", "llama-tiny", "--context-length", "16", "--device", "cpu", "--out-dir",
                  str(tmp_path / "run"), "--parallel", "fsdp+tp", "--tp", "2", "--no-progress"], timeout=240)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "tp=2 does not divide world_size=1" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "checkpoint").exists()
