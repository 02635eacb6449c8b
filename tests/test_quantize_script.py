"""ch07-deployment/quantize.py run whole: usage errors for a group size or a model it cannot take, and a file that
loads whenever it writes one."""

from pathlib import Path

import pytest
import torch
from scripts import run_script
from tiny_training import model_config, tokenizer

from llmscratch.model.checkpoint import export_model, model_from_checkpoint
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.model.quantize import quantize
from tests.model_fixtures import LATER_SHAPES

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]
SIZES = "choose one of 2, 4, 8, 16, 32, 64"  # the even divisors of 64 (attention) and 128 (the MLP's down)


def run(*argv) -> int | str:
    """The script as ``python quantize.py ARGV...`` runs it, in this process: its exit status (or error text)."""
    return run_script("quantize", list(argv))


@pytest.fixture(scope="module")
def float_model(tmp_path_factory) -> Path:
    """A two-layer float model of 64 dimensions with its tokenizer: layer inputs of 64 and 128."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("float") / "model.safetensors"
    export_model(GPT(model_config(d_model=64, d_ff=128)), path, tokenizer())
    return path


@pytest.mark.parametrize("group_size", ["0", "3", "-64", "96", str(10**9), "1", "48", "128"])
def test_a_group_size_that_does_not_fit_is_a_usage_error_listing_those_that_do(float_model, tmp_path, capsys,
                                                                               group_size):
    out = tmp_path / "q.safetensors"
    status = run("--model", float_model, "--scheme", "int4", "--group-size", group_size, "--out", out)
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"error: --group-size {group_size} does not fit {float_model}" in err and SIZES in err
    assert "Traceback" not in err and not out.exists()


def test_the_default_group_size_is_checked_too_and_int8_takes_none(tmp_path, capsys):
    narrow = tmp_path / "narrow.safetensors"
    export_model(GPT(model_config(d_model=32, d_ff=96)), narrow, tokenizer())  # inputs of 32 and 96: 64 fits neither
    assert run("--model", narrow, "--scheme", "int4", "--out", tmp_path / "q.safetensors") == 2
    assert "error: the default --group-size 64 does not fit" in capsys.readouterr().err
    assert run("--model", narrow, "--scheme", "int8", "--group-size", "32", "--out", tmp_path / "q.safetensors") == 2
    assert "error: --group-size applies to --scheme int4 only" in capsys.readouterr().err


@pytest.mark.parametrize("first, second", [("int8", "int4"), ("int8", "int8"), ("int4", "int8"), ("int4", "int4")])
def test_a_quantized_file_is_refused_naming_its_scheme(float_model, tmp_path, capsys, first, second):
    # It used to exit 0 having changed nothing, and wrote a file that could not be loaded.
    quantized = tmp_path / f"{first}.safetensors"
    export_model(quantize(model_from_checkpoint(float_model), first, group_size=16), quantized, tokenizer())
    out = tmp_path / "again.safetensors"
    status = run("--model", quantized, "--scheme", second, "--out", out)
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"error: --model {quantized}: the model is already quantized ({first} weights" in err
    assert "quantize the float model it was made from" in err and not out.exists()


def test_a_mixture_of_experts_has_its_experts_quantized_and_says_so(tmp_path, capsys):
    # Its experts once stayed float32 while the file said int8.
    moe = tmp_path / "moe.safetensors"
    export_model(GPT(GPTConfig(**{**LATER_SHAPES["moe"], "vocab_size": 320, "context_length": 16})), moe, tokenizer())
    out = tmp_path / "q.safetensors"
    assert run("--model", moe, "--out", out, "--test-mode") == 0
    assert "int8 weights (99.6% of the matrix weights)" in capsys.readouterr().out  # all but the router: 240 of 59,376
    loaded = model_from_checkpoint(out)
    assert loaded.blocks[0].mlp.down.qweight.shape == (5, 48, 24) and loaded.blocks[0].mlp.down.scheme == "int8"


def test_a_group_size_that_fits_writes_a_file_that_loads_as_it_says(float_model, tmp_path, capsys):
    out = tmp_path / "q.safetensors"
    assert run("--model", float_model, "--scheme", "int4", "--group-size", "32", "--out", out, "--test-mode") == 0
    assert "int4 weights (group 32, int8 head, 100.0% of the matrix weights)" in capsys.readouterr().out
    loaded = model_from_checkpoint(out)
    assert loaded.quantization == {"scheme": "int4", "group_size": 32, "head": True}
    assert loaded.blocks[1].mlp.down.group_size == 32
