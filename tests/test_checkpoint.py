"""Checkpoints: atomic saves that survive a kill, clear errors for files that do not fit, portable keys."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from tiny_training import model_config, tokenizer
from torch import nn

from llmscratch.model.checkpoint import (clean_state_dict, export_model, load_checkpoint, load_model_state,
                                         model_from_checkpoint, save_checkpoint, tokenizer_from_checkpoint)
from llmscratch.model.gpt import GPT, unwrap
from llmscratch.training.resume import check_model_config


def tiny_model(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(model_config(**overrides))


def checkpoint_of(model: GPT, step: int = 0) -> dict:
    return {"model": model.state_dict(), "model_config": model.config.to_dict(), "step": step,
            "tokenizer": tokenizer().to_json()}


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_round_trip_with_weights_only(tmp_path):
    model = tiny_model()
    save_checkpoint(tmp_path / "c.pt", checkpoint_of(model, step=7))
    torch.load(tmp_path / "c.pt", weights_only=True)  # no pickled code inside
    assert load_checkpoint(tmp_path / "c.pt")["step"] == 7
    assert_same_weights(model_from_checkpoint(tmp_path / "c.pt"), model)
    assert tokenizer_from_checkpoint(tmp_path / "c.pt").merges == tokenizer().merges
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary file left behind
    (tmp_path / "plain").write_bytes(b"")
    assert (tmp_path / "c.pt").stat().st_mode == (tmp_path / "plain").stat().st_mode  # usual permissions


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    old, new = tiny_model(), tiny_model(d_model=64)
    save_checkpoint(tmp_path / "c.pt", checkpoint_of(old, step=1))

    def half_a_save(obj, f):
        with open(f, "wb") as out:
            out.write(b"PK\x03\x04 half a zip file")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", half_a_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path / "c.pt", checkpoint_of(new, step=2))
    assert load_checkpoint(tmp_path / "c.pt")["step"] == 1
    assert_same_weights(model_from_checkpoint(tmp_path / "c.pt"), old)
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # the half-written temporary was removed


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    """A real SIGKILL in the middle of torch.save: the old file still loads, the new one never appears."""
    model = tiny_model()
    save_checkpoint(tmp_path / "c.pt", checkpoint_of(model, step=1))
    script = textwrap.dedent(f"""
        import os, signal, torch
        from llmscratch.model.checkpoint import save_checkpoint
        real_save = torch.save
        def save_then_die(obj, f):
            real_save(obj, f)
            with open(f, "r+b") as out:
                out.truncate(os.path.getsize(f) // 2)  # half of it is on disk ...
            os.kill(os.getpid(), signal.SIGKILL)  # ... when the process is killed
        torch.save = save_then_die
        state = {{"model": {{"w": torch.ones(1000)}}, "model_config": {{}}, "step": 2}}
        save_checkpoint({str(tmp_path / "c.pt")!r}, state)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == -9, result.stderr
    assert load_checkpoint(tmp_path / "c.pt")["step"] == 1
    assert_same_weights(model_from_checkpoint(tmp_path / "c.pt"), model)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "c.pt"]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp")  # the half-written temporary, never renamed


@pytest.mark.parametrize(("overrides", "message"), [
    ({"d_model": 64},
     r"different shapes: blocks.0.attn.out_proj.weight: checkpoint \(32, 32\) vs model \(64, 64\), .* and \d+ more"),
    ({"n_layers": 3}, r"missing from the checkpoint: blocks\.2\."),
    ({"n_layers": 1}, r"not in the model: blocks\.1\."),
    ({"norm": "layernorm", "mlp": "gelu", "position": "learned", "bias": True, "qkv_bias": True},
     r"missing from the checkpoint: blocks\.0\.attn\.out_proj\.bias, .*not in the model: blocks\.0\.mlp\.down\.weight"),
])
def test_a_checkpoint_that_does_not_fit_names_what_differs(tmp_path, overrides, message):
    save_checkpoint(tmp_path / "c.pt", checkpoint_of(tiny_model()))
    other = tiny_model(**overrides)
    with pytest.raises(ValueError, match=message):
        load_model_state(other, load_checkpoint(tmp_path / "c.pt")["model"])
    with pytest.raises(ValueError) as raised:
        check_model_config(load_checkpoint(tmp_path / "c.pt")["model_config"], other.config)
    assert all(f"{field}: model " in str(raised.value) for field in overrides), raised.value  # each field named


def test_check_model_config_lists_each_field():
    with pytest.raises(ValueError, match=r"d_model: model 64 vs checkpoint 32, .*n_layers: model 3 vs checkpoint 2"):
        check_model_config(model_config().to_dict(), model_config(d_model=64, n_layers=3))
    check_model_config(model_config().to_dict(), model_config())  # equal: no error


def test_files_that_are_not_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(ValueError, match="not a readable llmscratch checkpoint"):
        load_checkpoint(tmp_path / "text.pt")
    torch.save({"weights": torch.ones(2)}, tmp_path / "foreign.pt")
    with pytest.raises(ValueError, match="not an llmscratch checkpoint"):
        model_from_checkpoint(tmp_path / "foreign.pt")
    state = checkpoint_of(tiny_model())
    state["model_config"]["attention_sinks"] = 8
    save_checkpoint(tmp_path / "future.pt", state)
    with pytest.raises(ValueError, match=r"does not know: \['attention_sinks'\]"):
        model_from_checkpoint(tmp_path / "future.pt")
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        model_from_checkpoint(tmp_path / "bad.safetensors")


def test_compiled_and_ddp_wrapped_models_save_plain_loadable_weights(tmp_path):
    model = tiny_model()
    compiled = torch.compile(model)  # compiles lazily: nothing is built until it is called
    assert all(key.startswith("_orig_mod.") for key in compiled.state_dict())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = nn.parallel.DistributedDataParallel(compiled)
        keys = list(wrapped.state_dict())
        assert all(key.startswith("module._orig_mod.") for key in keys)
        assert unwrap(wrapped) is model
        for source in (compiled, wrapped):
            save_checkpoint(tmp_path / "c.pt", {"model": source.state_dict(), "model_config": model.config.to_dict()})
            assert_same_weights(model_from_checkpoint(tmp_path / "c.pt"), model)
        plain = tiny_model(n_layers=2)
        nn.init.zeros_(plain.lm_head.weight)
        load_model_state(plain, wrapped.state_dict())  # into a plain model, and into a wrapped one:
        assert_same_weights(plain, model)
        load_model_state(wrapped, {f"module.{k}": v for k, v in model.state_dict().items()})
    finally:
        dist.destroy_process_group()
    assert clean_state_dict({"module._orig_mod.a.b": 1, "_orig_mod.module.c": 2, "d": 3}) == {"a.b": 1, "c": 2, "d": 3}


@pytest.mark.parametrize("tied", [True, False])
def test_safetensors_export_round_trip(tmp_path, tied):
    model = tiny_model(tie_embeddings=tied)
    export_model(torch.compile(model), tmp_path / "model.safetensors", tokenizer())
    loaded = model_from_checkpoint(tmp_path / "model.safetensors")
    assert loaded.config == model.config
    assert_same_weights(loaded, model)
    assert (loaded.lm_head.weight is loaded.token_embedding.weight) == tied
    assert tokenizer_from_checkpoint(tmp_path / "model.safetensors").to_json() == tokenizer().to_json()
    from safetensors.torch import load_file

    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) != tied  # a tied matrix is stored once


def test_a_bfloat16_export_is_half_the_size_and_loads_as_float32(tmp_path):
    model = tiny_model()
    export_model(model, tmp_path / "fp32.safetensors")
    export_model(model, tmp_path / "bf16.safetensors", dtype=torch.bfloat16)
    assert (tmp_path / "bf16.safetensors").stat().st_size < 0.55 * (tmp_path / "fp32.safetensors").stat().st_size
    loaded = model_from_checkpoint(tmp_path / "bf16.safetensors")
    for name, tensor in model.state_dict().items():
        assert loaded.state_dict()[name].dtype == torch.float32
        assert torch.equal(loaded.state_dict()[name], tensor.bfloat16().float()), name
    with pytest.raises(ValueError, match="saved without a tokenizer"):
        tokenizer_from_checkpoint(tmp_path / "bf16.safetensors")
