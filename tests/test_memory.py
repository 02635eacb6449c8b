"""The memory planner (llmscratch/training/memory.py) against real tensors: FSDP's local shards on 2 gloo processes, a
single process's parameters, gradients and AdamW state, and the bytes autograd saves for backward."""

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from processes import run, spawn
from torch import nn

from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.training.memory import STRATEGIES, activation_bytes, check_mesh, format_bytes, main, plan, shard_rows

ROOT = Path(__file__).resolve().parents[1]
_LLAMA = {"norm": "rmsnorm", "mlp": "swiglu", "position": "rope", "qkv_bias": False, "bias": False}
# Odd sizes on purpose: rows that 2 ranks cannot split evenly (vocabulary, d_ff, context length).
CONFIGS = {
    "gpt2-style": GPTConfig(vocab_size=101, context_length=17, d_model=32, n_layers=2, n_heads=4, d_ff=47),
    "llama-gqa": GPTConfig(vocab_size=99, context_length=32, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2,
                           d_ff=75, tie_embeddings=False, **_LLAMA),
    "llama-mqa-tied": GPTConfig(vocab_size=257, context_length=16, d_model=40, n_layers=3, n_heads=5, n_kv_heads=1,
                                d_ff=33, **_LLAMA),
    # 5 experts for 2 ranks, a shared expert, a dense layer among the MoE ones
    "moe": GPTConfig(vocab_size=99, context_length=16, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=45,
                     n_experts=5, experts_per_token=2, d_expert=21, shared_experts=1, dense_layers=(1,), **_LLAMA),
}


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this process's own tensors: parameters, gradients, AdamW state (a DTensor's local shard)."""
    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(model.parameters())  # a tied weight once
    state = [value for p in params for value in optimizer.state[p].values()]  # exp_avg, exp_avg_sq, step
    return {"parameters": sum(nbytes(p) for p in params), "gradients": sum(nbytes(p.grad) for p in params),
            "optimizer": sum(nbytes(v) for v in state)}


def one_step(model: GPT) -> torch.optim.AdamW:
    """A forward, backward and AdamW step, so that gradients and optimizer state exist."""
    config = model.config
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (2, config.context_length), generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(idx, targets=idx.roll(-1, dims=1)).backward()
    optimizer.step()
    return optimizer


def fsdp_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """fully_shard each block, then the root (as the Trainer does); record each config's local bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        measured = {}
        for name, config in CONFIGS.items():
            torch.manual_seed(0)
            model = GPT(config)
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            measured[name] = local_bytes(model, one_step(model))
        torch.save(measured, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_fsdp_plan_equals_each_ranks_local_shards(tmp_path):
    """Exact: FSDP2 splits every parameter along dim 0 as torch.chunk does (rank 1 gets fewer rows of an odd
    dimension), its gradient and AdamW moments follow it, and each parameter has a float32 step counter."""
    spawn(fsdp_worker, (2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, timeout=240)
    for rank in range(2):
        measured = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for name, config in CONFIGS.items():
            expected = plan(config, "fsdp", gpus=2, rank=rank)
            for kind in ("parameters", "gradients", "optimizer"):
                assert getattr(expected, kind) == measured[name][kind], (name, rank, kind)
    # The odd sizes make the ranks differ, so the test sees which rank the formula describes.
    assert plan(CONFIGS["gpt2-style"], "fsdp", 2, rank=0).parameters > plan(CONFIGS["gpt2-style"], "fsdp", 2,
                                                                              rank=1).parameters


@pytest.mark.parametrize("name", CONFIGS)
def test_ddp_plan_equals_a_whole_models_tensors(name):
    torch.manual_seed(0)
    model = GPT(CONFIGS[name])
    measured = local_bytes(model, one_step(model))
    expected = plan(CONFIGS[name], "ddp", gpus=4)
    assert measured == {k: getattr(expected, k) for k in measured}
    assert expected.parameters == 4 * model.num_params()  # float32 masters, the tied matrix once


def test_shard_rows_follows_torch_chunk():
    for rows in range(1, 12):
        for shards in range(1, 6):
            pieces = [len(c) for c in torch.arange(rows).chunk(shards)]
            pieces += [0] * (shards - len(pieces))  # torch.chunk returns fewer pieces when rows run out
            assert [shard_rows(rows, shards, r) for r in range(shards)] == pieces, (rows, shards)


# --------------------------------------------------------------------------- activations
def saved_for_backward(model: GPT, batch_size: int, seq_len: int) -> int:
    """Bytes of the tensors autograd saves in one forward (with the loss), each storage once.

    Method: a ``saved_tensors_hooks`` pack hook sees every tensor an op (or the loss's autograd.Function)
    saves for backward; tensors are grouped by their storage's data_ptr, so views (q, k and v of one qkv
    output, a reshape) count once, and the storages of parameters and buffers (weights a Linear saves,
    RoPE tables) are left out: they are not activations. The storages are kept alive until counted.
    """
    config = model.config
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=generator)
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in owned:
            storages[storage.data_ptr()] = storage
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(idx, targets=idx.roll(-1, dims=1))
    loss.backward()
    return sum(s.nbytes() for s in storages.values())


ACTIVATION_CASES = [  # config, batch, context, dtype
    (CONFIGS["gpt2-style"], 2, 17, torch.float32),
    (GPTConfig(vocab_size=300, context_length=64, d_model=64, n_layers=3, n_heads=4, d_ff=200), 3, 48,
     torch.float32),
    (CONFIGS["llama-gqa"], 4, 32, torch.float32),
    (GPTConfig(vocab_size=512, context_length=128, d_model=64, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=160,
               **_LLAMA), 1, 128, torch.float32),
    (CONFIGS["llama-gqa"], 2, 24, torch.bfloat16),
    (CONFIGS["gpt2-style"], 3, 16, torch.bfloat16),
    (CONFIGS["moe"], 3, 13, torch.float32),
    (CONFIGS["moe"], 2, 16, torch.bfloat16),
    # Gemma 3's choices (QK-norm aside): sliding layers shorter than the sequence, post-norms, GeGLU
    (GPTConfig(vocab_size=101, context_length=32, d_model=40, n_layers=3, n_heads=4, n_kv_heads=2, head_size=12,
               norm="rmsnorm", mlp="geglu", position="rope", qkv_bias=False, bias=False, post_norms=True,
               scale_embeddings=True, sliding_window=5, layer_types=("sliding", "full", "sliding"),
               rope_local_theta=10_000.0), 3, 20, torch.float32),
]


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "explicit"])
@pytest.mark.parametrize("config,batch_size,seq_len,dtype", ACTIVATION_CASES)
def test_activation_estimate_matches_the_saved_tensors(config, batch_size, seq_len, dtype, fused):
    """The issue asks for 25%; on this CPU the count is exact in float32, and in bfloat16 (all weights cast, as
    FSDP's mixed-precision policy does) off by LayerNorm's statistics only, so the test holds it to 2%."""
    config = GPTConfig(**{**config.to_dict(), "fused_attention": fused})
    torch.manual_seed(0)
    model = GPT(config).to(dtype)
    measured = saved_for_backward(model, batch_size, seq_len)
    estimate = activation_bytes(config, batch_size, seq_len, act=2 if dtype == torch.bfloat16 else 4)
    assert estimate == pytest.approx(measured, rel=0.02)


def test_activation_checkpointing_keeps_block_inputs_and_one_block():
    """On paper: checkpointing replaces n_layers blocks' saved tensors by their inputs and one block's."""
    config = CONFIGS["llama-gqa"]
    one_layer = GPTConfig(**{**config.to_dict(), "n_layers": 1})
    block = activation_bytes(config, 2, 32, 4) - activation_bytes(one_layer, 2, 32, 4)  # one block's saved bytes
    inputs = config.n_layers * 2 * 32 * config.d_model * 4
    outside = activation_bytes(one_layer, 2, 32, 4) - block
    assert activation_bytes(config, 2, 32, 4, checkpointing=True) == outside + inputs + block
    assert activation_bytes(config, 2, 32, 4, checkpointing=True) < activation_bytes(config, 2, 32, 4)


# --------------------------------------------------------------------------- tensor parallelism, on paper
def test_tensor_parallel_splits_the_blocks_matrices_only():
    """tp=2: attention and MLP weights (and the biases of the row-split layers qkv, fc) halve; the rest stays."""
    config = GPTConfig(vocab_size=301, context_length=16, d_model=64, n_layers=2, n_heads=4, d_ff=200)
    model = GPT(config)
    split = sum(p.numel() for name, p in model.named_parameters()
                if (".attn." in name or ".mlp." in name) and not name.endswith(("out_proj.bias", "mlp.proj.bias")))
    whole = model.num_params()
    assert plan(config, "tp", gpus=2, tp=2).parameters == 4 * (whole - split + split // 2)
    two_d = plan(config, "fsdp+tp", gpus=4, tp=2)  # the tp shard, split again over dp=2 by rows
    assert (two_d.dp, two_d.tp) == (2, 2)
    assert two_d.parameters < plan(config, "tp", gpus=4, tp=2).parameters


def test_tensor_parallel_activations_split_inside_attention_and_mlp():
    config = ACTIVATION_CASES[3][0]  # 8 heads, 2 kv heads of 8 dimensions, d_ff 160
    nh, nkv, hs, ff, tokens = config.n_heads, config.kv_heads, config.head_dim, config.hidden_dim, 2 * 32
    # Per token, float32: the qkv output, the rotated q and k, the heads' output, the 4 MLP tensors, logsumexp.
    # tp=2 halves each of them; the residual stream and the norms (d_model wide) are not split.
    inside = 4 * ((nh + 2 * nkv) * hs + (nh + nkv) * hs + nh * hs + 4 * ff) + 4 * nh
    halved = inside // 2 * tokens * config.n_layers
    assert activation_bytes(config, 2, 32, 4, tp=1) - activation_bytes(config, 2, 32, 4, tp=2) == halved


# --------------------------------------------------------------------------- mesh checks and the command line
def test_check_mesh_returns_dp_and_tp_and_names_what_does_not_divide():
    config = GPTConfig.from_preset("tinyllama-1.1b")  # 32 heads, 4 kv heads, d_ff 5632
    assert check_mesh(config, "fsdp", 8, 1) == (8, 1)
    assert check_mesh(config, "fsdp+tp", 64, 4) == (16, 4)
    for strategy, world_size, tp, message in [
        ("fsdp+tp", 64, 8, "n_kv_heads=4"), ("tp", 6, 3, "n_heads=32"), ("tp", 8, 3, "world_size=8"),
        ("fsdp", 0, 1, "positive integer"), ("ddp", 4, 2, "tp must be 1"), ("zero", 4, 1, "unknown"),
        ("tp", 4, 0, "positive integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_mesh(config, strategy, world_size, tp)
    odd_mlp = GPTConfig.from_preset("llama-tiny", d_ff=385)  # 4 heads, 2 kv heads
    with pytest.raises(ValueError, match="d_ff=385"):
        check_mesh(odd_mlp, "tp", 4, 2)


@pytest.mark.parametrize("argv,flag", [
    (["--gpus", "0"], "--gpus"), (["--gpus", "2", "--tp", "3"], "--tp 3"),
    (["--preset", "tinyllama-1.1b", "--gpus", "8", "--tp", "8"], "n_kv_heads"),
    (["--batch-size", "0"], "--batch-size"), (["--gpu-memory", "-1"], "--gpu-memory"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "llama-mini", *argv])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_command_line_table_has_every_strategy_with_the_plans_numbers():
    result = run([sys.executable, "-m", "llmscratch.training.memory", "--preset", "llama-mini", "--gpus", "2"],
                 timeout=90, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.split()[:1] in [[s] for s in STRATEGIES]}
    assert set(rows) == set(STRATEGIES)
    config = GPTConfig.from_preset("llama-mini")
    for strategy, line in rows.items():
        expected = plan(config, strategy, 2, 2 if "tp" in strategy else 1, dtype="bfloat16")
        cells = re.findall(r"\d+\.\d+ [GM]iB", line)
        assert cells == [format_bytes(getattr(expected, c)) for c in
                         ("parameters", "gradients", "optimizer", "buffers", "activations", "total")]
        assert line.split()[-1] == ("yes" if expected.fits else "NO")


def test_a_mixture_of_experts_is_planned_without_tensor_parallelism_and_with_its_active_count(capsys):
    main(["--preset", "qwen3-30b-a3b", "--gpus", "8"])
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.split()[:1] in [[s] for s in STRATEGIES]]
    assert rows == ["ddp", "fsdp"]  # tensor parallelism does not split experts
    with torch.device("meta"):
        model = GPT(GPTConfig.from_preset("qwen3-30b-a3b"))
    assert f"{model.num_params() / 1e6:,.1f}M parameters ({model.num_params(active=True) / 1e6:,.1f}M active" in out
    with pytest.raises(ValueError, match="does not support a mixture of experts"):
        check_mesh(GPTConfig.from_preset("qwen3-30b-a3b"), "tp", 8, 2)
