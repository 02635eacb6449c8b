"""The native kernel's cache (llmscratch.native) under damage, planted files and broken compilers (issue 50).

Each case runs in a process of its own with a temporary $XDG_CACHE_HOME, as a user's next process would: a file
that crashed ``dlopen`` would end that process, not the test run. Every case must end in a working kernel (rebuilt,
with a warning) or in PyTorch's arithmetic with a warning: never in a crash or in other arithmetic.
"""

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from processes import run

from llmscratch import native

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)

# A process that quantizes two layers (int8 and int4) and compares their products with PyTorch's.
QUANTIZED_LAYERS = """
import json, os, warnings, torch
from torch import nn
from llmscratch import native
native.COMPILE_SECONDS = float(os.environ.get("COMPILE_SECONDS", native.COMPILE_SECONDS))
from llmscratch.model.quantize import QuantizedLinear, word_product
torch.manual_seed(0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    layers = [QuantizedLinear(nn.Linear(128, 16), "int8"), QuantizedLinear(nn.Linear(128, 16), "int4", 32)]
x = torch.randn(1, 128)
with torch.no_grad():
    same = all(torch.allclose(layer(x), word_product(x, layer.qweight, layer.scales, layer.scheme) + layer.bias,
                              rtol=1e-5, atol=1e-6) for layer in layers)
print(json.dumps({"native": [layer.native for layer in layers], "same": same,
                  "warnings": [str(w.message) for w in caught]}))
"""


def quantize_in_a_process(cache: Path, compile_seconds: float | None = None, **environment: str) -> dict:
    env = {key: value for key, value in os.environ.items() if key not in ("CC", "LLMSCRATCH_NO_NATIVE")}
    env.update(XDG_CACHE_HOME=str(cache), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **environment)
    if compile_seconds is not None:
        env["COMPILE_SECONDS"] = str(compile_seconds)
    done = run([sys.executable, "-c", QUANTIZED_LAYERS], timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, f"exit status {done.returncode} (a crash is what the checks prevent): {done.stderr}"
    return json.loads(done.stdout)


def built_library(cache: Path) -> Path:
    """Build the kernel into ``cache`` in a process of its own; the library's path."""
    seen = quantize_in_a_process(cache)
    assert seen["native"] == [True, True] and seen["same"] and seen["warnings"] == [], seen
    (library,) = (cache / "llmscratch" / "kernels").glob("*.so")
    return library


PRODUCTS = ("y[r * out_features + o] = ", 2)  # where the int8 and int4 products are written, and how often
DEQUANTIZED = ("v8f scaled = ", 2)  # where the int8 and int4 dequantized weights are


def plant(library: Path, factor: str = "1.001f", where: tuple[str, int] = PRODUCTS) -> None:
    """Compile the kernel's own source, with ``factor *`` inserted ``where`` it writes its results, into ``library``."""
    source = (native.SOURCES / "word_product.c").read_text()
    text, count = where
    assert source.count(text) == count
    planted_source = library.parent / "planted.c"
    planted_source.write_text(source.replace(text, f"{text}{factor} * "))
    done = run([shutil.which("cc") or "gcc", "-O2", "-shared", "-fPIC", str(planted_source), "-o", str(library)],
               timeout=120)
    assert done.returncode == 0, done.stderr
    planted_source.unlink()


def assert_rebuilt(seen: dict, library: Path, said: str) -> None:
    assert seen["native"] == [True, True] and seen["same"], seen
    assert len(seen["warnings"]) == 1 and str(library) in seen["warnings"][0] and said in seen["warnings"][0], seen
    assert "built again" in seen["warnings"][0]
    assert native._checksum_problem(library) is None  # the rebuilt file and its recorded checksum agree


# --------------------------------------------------------------------------- damaged and planted files
@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_a_damaged_library_in_the_cache_is_rebuilt_never_loaded(tmp_path, damage):
    library = built_library(tmp_path)
    data = library.read_bytes()
    library.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbage": os.urandom(len(data))}[damage])
    seen = quantize_in_a_process(tmp_path)  # a truncated file loaded would be SIGBUS: exit status -7
    assert_rebuilt(seen, library, "does not match the checksum")
    assert not [p for p in library.parent.iterdir() if p.suffix == ".so" and p != library]  # none built beside it


def test_a_folder_where_the_library_belongs_is_replaced_by_the_library(tmp_path):
    library = built_library(tmp_path)
    library.unlink()
    (library / "inside").mkdir(parents=True)
    assert_rebuilt(quantize_in_a_process(tmp_path), library, "is not a file")
    assert not [p for p in library.parent.iterdir() if p.suffix == ".so" and p != library]  # none built beside it


def test_a_library_without_its_recorded_checksum_is_rebuilt(tmp_path):
    library = built_library(tmp_path)
    native._checksum_file(library).unlink()  # a cache from before checksums, or a file copied in alone
    assert_rebuilt(quantize_in_a_process(tmp_path), library, "no checksum")


@pytest.mark.parametrize("factor", ["1.001f", "-1.0f"])
def test_a_planted_library_with_other_arithmetic_is_rebuilt(tmp_path, factor):
    library = built_library(tmp_path)
    plant(library, factor)  # with the checksum the real build recorded: refused before it is loaded
    assert_rebuilt(quantize_in_a_process(tmp_path), library, "does not match the checksum")


@pytest.mark.parametrize("where", [PRODUCTS, DEQUANTIZED])
def test_a_planted_library_with_its_own_checksum_fails_the_known_answer_check_and_is_rebuilt(tmp_path, where):
    library = built_library(tmp_path)
    plant(library, "1.001f", where)
    native._checksum_file(library).write_text(native._sha256(library))  # whoever planted it also wrote its checksum
    assert_rebuilt(quantize_in_a_process(tmp_path), library, "fails its known-answer check")


# --------------------------------------------------------------------------- compilers that fail or hang
def fake_compiler(tmp_path: Path, body: str) -> tuple[Path, Path]:
    """A shell script standing in for the compiler, which logs each call; (script, log)."""
    log, script = tmp_path / "calls.log", tmp_path / "bin" / "fakecc"
    script.parent.mkdir(exist_ok=True)
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n{body}\n")
    script.chmod(0o755)
    return script, log


def calls(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_compiler_that_hangs_is_tried_once_and_remembered(tmp_path):
    script, log = fake_compiler(tmp_path, "sleep 1000")
    seen = quantize_in_a_process(tmp_path / "cache", compile_seconds=1, CC=str(script))
    assert seen["native"] == [False, False] and seen["same"], seen  # PyTorch's arithmetic
    assert calls(log) == 1  # a compiler that hangs would hang with the other flag sets too
    assert len(seen["warnings"]) == 1 and "did not finish within 1 s" in seen["warnings"][0], seen
    again = quantize_in_a_process(tmp_path / "cache", compile_seconds=1, CC=str(script))
    assert calls(log) == 1 and again["native"] == [False, False] and again["same"], again  # not tried again
    assert len(again["warnings"]) == 1 and "not tried again" in again["warnings"][0], again
    assert "did not finish within 1 s" in again["warnings"][0]  # the failure remembered says what it was


def test_a_failing_compiler_is_remembered_for_a_while_then_tried_again(tmp_path):
    script, log = fake_compiler(tmp_path, "echo 'fakecc: error: no such thing' >&2\nexit 1")
    seen = quantize_in_a_process(tmp_path / "cache", CC=str(script))
    assert seen["native"] == [False, False] and seen["same"] and calls(log) == len(native.FLAG_SETS), seen
    assert "no such thing" in seen["warnings"][0]
    again = quantize_in_a_process(tmp_path / "cache", CC=str(script))
    assert calls(log) == len(native.FLAG_SETS) and "no such thing" in again["warnings"][0], again
    (failed,) = (tmp_path / "cache" / "llmscratch" / "kernels").glob("*.failed")
    record = json.loads(failed.read_text())
    failed.write_text(json.dumps({**record, "time": time.time() - native.FAILURE_SECONDS - 60}))  # an hour ago
    quantize_in_a_process(tmp_path / "cache", CC=str(script))
    assert calls(log) == 2 * len(native.FLAG_SETS)


# --------------------------------------------------------------------------- $CC
def test_a_cc_with_flags_is_used_as_a_shell_would_split_it(tmp_path):
    real = shutil.which("cc") or shutil.which("gcc")
    script, log = fake_compiler(tmp_path, f'exec {real} "$@"')
    seen = quantize_in_a_process(tmp_path / "cache", CC=f"{script} -DLLMSCRATCH_TEST=1")
    assert seen["native"] == [True, True] and seen["same"] and seen["warnings"] == [], seen
    assert calls(log) == 1 and log.read_text().startswith("-DLLMSCRATCH_TEST=1 -O3")


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "no-such-compiler-here -O2", "'unmatched quote"])
def test_a_cc_that_names_no_program_is_said_and_the_usual_compiler_builds(tmp_path, cc):
    seen = quantize_in_a_process(tmp_path, CC=cc)
    assert seen["native"] == [True, True] and seen["same"], seen
    assert len(seen["warnings"]) == 1 and f"$CC={cc!r}" in seen["warnings"][0], seen
    assert "does not name a program" in seen["warnings"][0] and "instead" in seen["warnings"][0]


def test_a_cc_that_names_no_program_with_no_compiler_to_fall_back_on_is_one_warning_naming_it(tmp_path):
    seen = quantize_in_a_process(tmp_path, CC="/nonexistent/cc -O2", PATH="")
    assert seen["native"] == [False, False] and seen["same"], seen  # PyTorch's arithmetic
    assert len(seen["warnings"]) == 1 and "no C compiler found" in seen["warnings"][0], seen
    assert "$CC='/nonexistent/cc -O2'" in seen["warnings"][0]
