"""The training and decoding benchmarks as the GPU check runs them: --json holds every number it reads.

Each script runs as a program with its smallest settings, on the CPU; ``benchmarks/gpu.py`` runs the
same flags with ``--device cuda`` on a lent GPU, where nothing can be fixed mid-run. A device this
machine lacks is refused before any work, with a message and exit status 2, never a traceback.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import run

from benchmarks import gpu

ROOT = Path(__file__).resolve().parents[1]


def bench(name: str, *argv: str, timeout: float) -> subprocess.CompletedProcess:
    """``python -m benchmarks.NAME ARGV...`` from the repository root, as benchmarks/gpu.py starts it."""
    return run([sys.executable, "-m", f"benchmarks.{name}", *argv], timeout=timeout, cwd=ROOT,
               env={**os.environ, "PYTHONPATH": str(ROOT)})


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow  # about 40 s on 2 busy cores
@pytest.mark.timeout(300)
def test_bench_train_writes_every_number_to_json(tmp_path):
    path = tmp_path / "train.json"
    done = bench("bench_train", "--configs", "6x384", "--modes", "fp32", "--runs", "1", "--batch-size", "1",
                 "--no-memory", "--matmul-size", "128", "--json", str(path), timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("### Training throughput") and "\n| fp32 | " in done.stdout
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["benchmark"] == "train" and data["device"] == "cpu" and "--json" in data["command"]
    assert data["torch"] == torch.__version__ and data["transformers"] and data["machine"] and data["device_name"]
    assert data["matmul_size"] == 128
    mode = data["configs"]["6x384"]["modes"]["fp32"]
    assert (mode["batch"], mode["runs"], mode["tokens_per_step"]) == (1, 1, 256)
    assert positive(mode["ratio"]) and all(positive(r) for r in mode["ratio_range"])
    assert positive(mode["ceiling_flops"]["fp32"]) and positive(mode["ceiling_flops"]["bf16"])
    assert mode["datasheet_peak_flops"] is None  # a GPU's, from its datasheet
    for peer in ("llmscratch", "transformers"):
        numbers = mode["peers"][peer]
        for key in ("tokens_per_s", "first_step_s", "mfu", "bf16_ceiling_share"):
            assert positive(numbers[key]), (peer, key, numbers[key])
        assert len(numbers["seconds"]) == 1 and positive(numbers["seconds"][0])
        assert numbers["mfu_datasheet"] is None and numbers["peak_mib"] is None  # CPU; --no-memory
    assert "6x384 fp32: " in gpu.SUMMARIES["train"]({"train.json": data})  # the GPU report's line reads it


@pytest.mark.slow  # about 45 s on 2 busy cores
@pytest.mark.timeout(300)
def test_bench_generate_writes_every_number_to_json(tmp_path):
    path = tmp_path / "decode.json"
    done = bench("bench_generate", "--runs", "1", "--new-tokens", "4", "--prompt-tokens", "4", "--candidates",
                 "transformers", "cache", "--json", str(path), timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("### Decoding") and "| llmscratch `generate`, KV cache, fp32 | 1 |" in done.stdout
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["benchmark"] == "generate" and data["device"] == "cpu" and data["torch"] == torch.__version__
    assert (data["prompt_tokens"], data["new_tokens"], data["runs"]) == (4, 4, 1)
    assert data["tokens_asserted"] is True  # on a CPU the fp32 tokens are asserted equal to transformers'
    assert positive(data["bandwidth"]) and all(positive(b) for b in data["bandwidth_range"])
    for precision in ("fp32", "bf16"):
        assert positive(data["bytes_per_token"][precision]) and positive(data["floor_tokens_per_s"][precision])
    assert list(data["candidates"]) == ["transformers", "cache"]
    for name, numbers in data["candidates"].items():
        for key in ("tokens_per_s", "median_s", "vs_transformers", "floor_share"):
            assert positive(numbers[key]), (name, key, numbers[key])
        assert all(positive(r) for r in numbers["tokens_per_s_range"]) and numbers["runs"] == 1
        assert numbers["agreement"] == 4 and numbers["precision"] == "fp32"
    assert positive(data["kernels"]["fp32 F.linear"])
    assert "cache " in gpu.SUMMARIES["decode"]({"decode.json": data})  # the GPU report's line reads it


no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: --device cuda would run")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, argv, message", [
    pytest.param("bench_train", ["--device", "cuda"], "--device: device 'cuda' was asked for, but this torch sees "
                 "no CUDA GPU", marks=no_gpu, id="train-cuda"),
    pytest.param("bench_generate", ["--device", "cuda:0"], "--device: device 'cuda:0' was asked for, but this torch "
                 "sees no CUDA GPU", marks=no_gpu, id="generate-cuda"),
    pytest.param("bench_generate", ["--candidates", "transformers", "compiled-cuda-graphs"],
                 "--candidates compiled-cuda-graphs needs --device cuda", id="generate-graphs-on-cpu"),
])
def test_a_device_or_candidate_that_cannot_run_here_is_refused_at_once(name, argv, message):
    done = bench(name, *argv, timeout=90)
    assert done.returncode == 2, done.stderr[-4000:]
    assert message in done.stderr and "Traceback" not in done.stderr
