"""FSDP2 on CPU (gloo): two sharded processes train as one process with their joint batch; sharded
checkpoints resume exactly, and across 2 -> 1 and 1 -> 2 processes; activation checkpointing changes nothing."""

import contextlib
import copy
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from processes import spawn, torchrun
from tiny_training import (
    DESIGNS,
    PRETRAIN,
    PRETRAIN_FLAGS,
    TEXT,
    JointBatches,
    StopAfter,
    losses,
    make_trainer,
    model_config,
    pretrain_with_hook,
    tokenizer,
    tokens,
    train_config,
)
from tolerances import assert_adamw_runs_agree
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from llmscratch.config import ConfigError
from llmscratch.model.checkpoint import model_from_checkpoint
from llmscratch.model.gpt import GPT
from llmscratch.training import distributed
from llmscratch.training.config import TrainConfig
from llmscratch.training.distributed import DistInfo
from llmscratch.training.parallel import checkpoint_activations, is_sharded, local_bytes
from llmscratch.training.resume import read_meta
from llmscratch.training.train import Trainer

# A constant learning rate: a run resumed with a larger max_steps keeps the schedule it had.
SETTINGS = dict(batch_size=2, grad_accum=2, lr=3e-3, min_lr=3e-3, warmup_steps=0, eval_interval=3,
                checkpoint_interval=3, eval_tokens=128, final_eval_tokens=400, parallel="fsdp")
STEPS = 6


def full_states(trainer: Trainer) -> tuple[dict, dict]:
    """A copy of the whole (unsharded) weights and optimizer state, on rank 0 (empty on the others)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return copy.deepcopy((get_model_state_dict(trainer.model, options=options),  # (the step counts are live)
                          get_optimizer_state_dict(trainer.model, trainer.optimizer_step.optimizer, options=options)))


def fsdp_worker(rank: int, world_size: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = train_sharded(DistInfo(rank=rank, local_rank=rank, world_size=world_size,
                                        device=torch.device("cpu")), Path(out))
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        distributed.teardown()


def train_sharded(info: DistInfo, out: Path) -> dict:
    """Per design: a straight run, one stopped at step 3 and resumed, and a resume of a 1-process checkpoint."""
    result = {}
    for name, overrides in DESIGNS.items():
        straight = make_trainer(out / name / "straight", overrides, info, max_steps=STEPS, **SETTINGS)
        assert is_sharded(straight.model)
        before = local_bytes(straight.model)
        straight.fit(progress=False)
        straight.export(out / name / "model.safetensors")
        model_state, optimizer_state = full_states(straight)

        stopped = make_trainer(out / name / "stopped", overrides, info, max_steps=STEPS, **SETTINGS)
        stopped.__class__ = StopAfter
        try:
            stopped.fit(progress=False)
        except Exception as err:  # TrainingStopped
            assert type(err).__name__ == "TrainingStopped", err
        resumed = make_trainer(out / name / "stopped", overrides, info, max_steps=STEPS, **SETTINGS)
        resumed.fit(resume=True, progress=False)

        from_one = make_trainer(out / name / "from_one", overrides, info, max_steps=5, **SETTINGS)
        from_one.load()
        loaded_model, loaded_optimizer = full_states(from_one)
        from_one.fit(resume=True, progress=False)

        result[name] = {
            "losses": losses(straight), "grad_norms": [r["grad_norm"] for r in straight.history],
            "val": straight.evaluate(400), "sample": straight.history[-1].get("sample"),
            "model": model_state, "optimizer": optimizer_state,
            "bytes_before": before, "bytes_after": local_bytes(straight.model, straight.optimizer_step.optimizer),
            "tied": straight.model.lm_head.weight is straight.model.token_embedding.weight,
            "stopped_losses": losses(stopped) + losses(resumed), "resumed_model": full_states(resumed)[0],
            "from_one_model": loaded_model, "from_one_optimizer": loaded_optimizer,
            "from_one_steps": [r["step"] for r in from_one.history],
        }
    # Rank 1 builds its GPT on the meta device (no memory, no values): its shards come from rank 0's weights.
    with torch.device("meta") if info.rank else contextlib.nullcontext():
        torch.manual_seed(info.rank)  # rank 0 as make_trainer (seed 0); rank 1's values (none here) would not count
        model = GPT(model_config(**DESIGNS["llama"]))
    meta = Trainer(model, train_config(max_steps=3, **SETTINGS), *tokens(), out / "meta", tokenizer(), info)
    meta.fit(progress=False)
    result["meta"] = {"losses": losses(meta), "on_meta": any(p.is_meta for p in model.parameters())}
    # FSDP's bfloat16 policy (what runs on GPUs): the weights gathered as bfloat16, the shards stay float32.
    mixed = make_trainer(out / "bfloat16", DESIGNS["llama"], info, max_steps=3, **{**SETTINGS, "dtype": "bfloat16"})
    mixed.fit(progress=False)
    result["bfloat16"] = {"losses": losses(mixed), "dtypes": {p.dtype for p in mixed.model.parameters()}}
    return result


def optimizer_tensors(state: dict) -> dict[str, torch.Tensor]:
    """The optimizer state's tensors by "param.key" (a state dict keyed by names, as DCP's helpers give)."""
    return {f"{name}.{key}": value for name, entries in state["state"].items()
            for key, value in entries.items()}


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Both designs trained by 2 FSDP processes; first a 1-process run writes the checkpoint they resume."""
    out = tmp_path_factory.mktemp("fsdp")
    for name, overrides in DESIGNS.items():  # one process, parallel="fsdp": the same format, unsharded
        one = make_trainer(out / name / "from_one", overrides, max_steps=3, **SETTINGS)
        one.fit(progress=False)
        assert not is_sharded(one.model) and (out / name / "from_one" / "checkpoint" / "meta.pt").is_file()
        torch.save({"model": one.model.state_dict(), "optimizer": get_optimizer_state_dict(
            one.model, one.optimizer_step.optimizer)}, out / name / "one.pt")  # (saved: a copy)
    spawn(fsdp_worker, (2, str(out / "store"), str(out)), nprocs=2, timeout=400)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(DESIGNS))
@pytest.mark.slow
def test_fsdp_matches_one_process_with_the_same_global_batch(sharded_runs, name):
    out, ranks = sharded_runs
    result = ranks[0][name]
    single = make_trainer(out / name / "single", DESIGNS[name], max_steps=STEPS, **{**SETTINGS, "batch_size": 4})
    single.batches = JointBatches(tokens()[0])
    steps = [single.train_step() for _ in range(STEPS)]
    # Gradients are equal in exact arithmetic but summed in another order: float32 rounding (tolerances.py).
    assert_adamw_runs_agree(result["model"], single.model.state_dict(), lr=SETTINGS["lr"], steps=STEPS)
    assert result["losses"] == pytest.approx([loss for loss, _ in steps], abs=1e-5)
    # clip_grad_norm_ over DTensor gradients: the global norm, as one process computes it.
    assert result["grad_norms"] == pytest.approx([norm for _, norm in steps], rel=1e-5)
    assert result["val"] == pytest.approx(single.evaluate(400), rel=1e-6)
    assert ranks[1][name]["losses"] == result["losses"]  # every rank logs the global loss
    assert result["sample"] and ranks[1][name]["sample"] is None  # all ranks generate, rank 0 records
    assert result["tied"] == DESIGNS[name]["tie_embeddings"]
    # model.safetensors: one ordinary file with the full weights.
    exported = model_from_checkpoint(out / name / "model.safetensors").state_dict()
    assert exported.keys() == result["model"].keys()
    assert all(torch.equal(exported[k], result["model"][k]) for k in exported)


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_ranks_that_build_the_model_on_the_meta_device_get_rank_0s_weights(sharded_runs):
    _, ranks = sharded_runs
    assert ranks[0]["meta"]["losses"] == ranks[0]["llama"]["losses"][:3]  # bit for bit: rank 0's initial weights
    assert ranks[1]["meta"]["losses"] == ranks[0]["meta"]["losses"]
    assert not ranks[0]["meta"]["on_meta"] and not ranks[1]["meta"]["on_meta"]  # every shard has memory


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_fsdp_bfloat16_policy_trains_close_to_float32(sharded_runs):
    _, ranks = sharded_runs
    mixed = ranks[0]["bfloat16"]
    assert mixed["dtypes"] == {torch.float32}  # what AdamW updates
    # bfloat16 keeps 8 bits of mantissa: a loss of ~5.7 is rounded by up to ~0.02 in each matmul's output.
    assert mixed["losses"] == pytest.approx(ranks[0]["llama"]["losses"][:3], abs=0.05)


# After logging step {kill_at}, rank 1 SIGKILLs torchrun, every worker and itself (each worker has a session of
# its own, so through /proc: Linux): all die at once, rank 0 wherever it is (in the next step, or writing the
# checkpoint of this one).
KILL_ALL_AFTER = """
def parent(pid):
    return int(Path(f"/proc/{{pid}}/stat").read_text().rpartition(")")[2].split()[1])

if self.step == {kill_at} and self.dist.rank == 1:
    metrics = self.out_dir / "metrics.jsonl"  # rank 0 writes it: on a loaded machine it may lag behind
    for _ in range(600):  # (at most 60 s) so that the kill lands after step {kill_at}'s line, as asserted
        if metrics.exists() and metrics.read_text().count("\\n") >= {kill_at}:
            break
        time.sleep(0.1)
    launcher = os.getppid()
    workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid() and parent(p) == launcher]
    for pid in [launcher, *workers, os.getpid()]:
        os.kill(pid, signal.SIGKILL)
"""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("parallel", ["fsdp", "tp"])
@pytest.mark.slow
def test_a_sharded_run_killed_with_sigkill_resumes_to_the_same_losses(tmp_path, parallel):
    """pretrain.py under torchrun, killed after step 15, when its checkpoint is due (every 5 steps): --resume
    restarts from step 10 and gives the losses and the final validation loss of a run never interrupted, bit for
    bit (float32 on CPU, 1 thread); FSDP with activation checkpointing, and the export is one ordinary file."""
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    killing = pretrain_with_hook(tmp_path / "killing.py", KILL_ALL_AFTER.format(kill_at=15))
    recompute = ["--activation-checkpointing"] if parallel == "fsdp" else []

    def flags(out_dir, *extra):
        return ["--data", str(tmp_path / "text.txt"), "--out-dir", str(out_dir), *PRETRAIN_FLAGS, "--device", "cpu",
                "--parallel", parallel, "--max-steps", "20", "--checkpoint-interval", "5", "--eval-interval", "10",
                "--sample-interval", "1000", *recompute, *extra]

    killed, straight = tmp_path / "killed", tmp_path / "straight"
    died = torchrun(killing, flags(killed), timeout=400)
    assert died.returncode == -signal.SIGKILL, died.stdout + died.stderr
    assert (killed / "metrics.jsonl").read_text().count("\n") == 15
    assert read_meta(killed / "checkpoint")["step"] == 10  # not a half-written step 15

    resumed = torchrun(PRETRAIN, flags(killed, "--resume"), timeout=400)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"({parallel}: " in resumed.stdout and (killed / "checkpoint" / ".metadata").is_file()
    assert model_from_checkpoint(killed / "model.safetensors").num_params() > 0  # one ordinary file
    uninterrupted = torchrun(PRETRAIN, flags(straight), timeout=400)
    assert uninterrupted.returncode == 0, uninterrupted.stdout + uninterrupted.stderr

    def records(folder):
        return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]

    assert [r["step"] for r in records(killed)] == list(range(1, 21))
    assert [r["loss"] for r in records(killed)] == [r["loss"] for r in records(straight)]  # exact float equality
    assert ([r["val_loss"] for r in records(killed) if "val_loss" in r]
            == [r["val_loss"] for r in records(straight) if "val_loss" in r])
    assert (json.loads((killed / "summary.json").read_text())["val_loss"]
            == json.loads((straight / "summary.json").read_text())["val_loss"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(DESIGNS))
@pytest.mark.slow
def test_each_rank_holds_about_half_of_the_parameters_and_optimizer_state(sharded_runs, name):
    _, ranks = sharded_runs
    torch.manual_seed(0)
    model = GPT(model_config(**DESIGNS[name]))
    total = local_bytes(model)["parameters"]  # a tied matrix once
    for key, whole in (("parameters", total), ("optimizer", 2 * total)):  # AdamW: two moments per weight
        shards = [ranks[r][name]["bytes_after"][key] for r in range(2)]
        assert sum(shards) == whole  # rows split between the ranks, none twice
        # Not exactly half: a matrix of an odd number of rows leaves rank 1 one row fewer.
        assert all(abs(shard - whole / 2) <= 0.05 * whole for shard in shards), shards
    assert ranks[0][name]["bytes_before"]["parameters"] == ranks[0][name]["bytes_after"]["parameters"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(DESIGNS))
@pytest.mark.slow
def test_sharded_checkpoints_resume_exactly_and_across_process_counts(sharded_runs, name):
    out, ranks = sharded_runs
    result = ranks[0][name]
    # Stopped at step 3 (a checkpoint of it) and resumed: the same losses and weights, bit for bit.
    assert result["stopped_losses"] == result["losses"]
    assert all(torch.equal(result["resumed_model"][k], v) for k, v in result["model"].items())

    # 1 -> 2: what two processes loaded is exactly what one process saved.
    one = torch.load(out / name / "one.pt", weights_only=True)
    assert all(torch.equal(result["from_one_model"][k], v) for k, v in one["model"].items())
    saved, loaded = optimizer_tensors(one["optimizer"]), optimizer_tensors(result["from_one_optimizer"])
    assert saved.keys() == loaded.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert result["from_one_steps"] == [4, 5]  # and training went on

    # 2 -> 1: one unsharded process loads the 2-process checkpoint of step 6 and trains on.
    folder = out / name / "two_to_one"
    shutil.copytree(out / name / "straight", folder)
    alone = make_trainer(folder, DESIGNS[name], max_steps=8, **SETTINGS)
    with pytest.warns(UserWarning, match="written by 2 process"):
        alone.load()
    assert alone.step == STEPS
    assert all(torch.equal(alone.model.state_dict()[k], v) for k, v in result["model"].items())
    reloaded = optimizer_tensors(copy.deepcopy(get_optimizer_state_dict(alone.model, alone.optimizer_step.optimizer)))
    expected = optimizer_tensors(result["optimizer"])
    assert reloaded.keys() == expected.keys() and all(torch.equal(reloaded[k], expected[k]) for k in expected)
    with pytest.warns(UserWarning, match="data streams"):
        alone.fit(resume=True, progress=False)
    assert [r["step"] for r in alone.history] == [7, 8]


def test_a_wrong_or_missing_sharded_checkpoint_is_a_clear_error(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2, **SETTINGS)
    with pytest.raises(ValueError, match="no sharded checkpoint at"):
        trainer.fit(resume=True, progress=False)
    make_trainer(tmp_path, max_steps=2, **{**SETTINGS, "parallel": "ddp"}).fit(progress=False)  # checkpoint.pt
    with pytest.raises(ValueError, match="holds checkpoint.pt instead.*parallel=ddp"):
        make_trainer(tmp_path, max_steps=3, **SETTINGS).fit(resume=True, progress=False)
    make_trainer(tmp_path / "b", max_steps=2, **SETTINGS).fit(progress=False)
    other = make_trainer(tmp_path / "b", {"n_layers": 3}, max_steps=3, **SETTINGS)
    with pytest.raises(ValueError, match="n_layers"):
        other.fit(resume=True, progress=False)
    (tmp_path / "b" / "checkpoint" / "meta.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="meta.pt is not readable"):
        make_trainer(tmp_path / "b", max_steps=3, **SETTINGS).fit(resume=True, progress=False)


def test_a_save_that_crashed_midway_leaves_the_last_checkpoint(tmp_path):
    first = make_trainer(tmp_path, max_steps=2, **SETTINGS)
    first.fit(progress=False)
    state = first.model.state_dict()
    (tmp_path / "checkpoint.tmp-3").mkdir()  # a save of step 3 killed before it finished
    (tmp_path / "checkpoint.tmp-3" / "__0_0.distcp").write_bytes(b"half")
    resumed = make_trainer(tmp_path, max_steps=3, **SETTINGS)
    resumed.load()
    assert all(torch.equal(resumed.model.state_dict()[k], v) for k, v in state.items())
    resumed.fit(resume=True, progress=False)
    assert not (tmp_path / "checkpoint.tmp-3").exists()  # the next save of step 3 replaced it


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(dropout):
    def loss_and_grads(checkpointed: bool):
        torch.manual_seed(0)
        model = GPT(model_config(dropout=dropout))
        if checkpointed:
            checkpoint_activations(model)
        x = torch.randint(0, 320, (2, 16))
        loss = model(x, targets=x.roll(-1, 1))
        loss.backward()
        return loss, {name: p.grad for name, p in model.named_parameters()}

    plain_loss, plain = loss_and_grads(False)
    loss, grads = loss_and_grads(True)
    # The recomputation runs the same kernels on the same inputs (and the same dropout masks): float32 equal.
    assert torch.equal(loss, plain_loss)
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_bad_parallel_settings_are_refused_before_training():
    with pytest.raises(ConfigError, match=r"parallel .*got 'zero'"):
        TrainConfig(parallel="zero")
    with pytest.raises(ConfigError, match="cannot be fsdp with compile"):
        TrainConfig(parallel="fsdp", compile=True)
    with pytest.raises(ConfigError, match="cannot be fsdp with dtype float16"):
        TrainConfig(parallel="fsdp", dtype="float16")
    for flags, message in ((["--parallel", "fsdp", "--compile"], "--parallel cannot be fsdp with compile"),
                           (["--parallel", "zero"], "invalid choice: 'zero'")):
        done = subprocess.run([sys.executable, str(PRETRAIN), "--device", "cpu", *flags], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr
