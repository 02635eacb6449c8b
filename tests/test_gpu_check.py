"""The prepared device check (benchmarks/gpu.py, issues 29 and 52) cannot rot between lendings of a GPU.

Its dry run on this CPU machine finds every program of the plan, every flag it passes, and the test file, and
runs the engine, quantized and mfu measurements at tiny shapes; its runner gives each part the status it
earned (passed, failed, timed out, skipped for time), checked here with small stand-in parts; without a GPU a
real run stops at once with a clear message.
"""

import json
import sys
from pathlib import Path

import pytest
from processes import run as run_process

from benchmarks import gpu

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_dry_run_finds_every_program_flag_and_test_file(tmp_path):
    done = run_process([sys.executable, "-m", "benchmarks", "gpu", "--dry-run", "--out", str(tmp_path / "report")],
                       timeout=500, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "report" / "gpu_report.json").read_text())
    assert report["dry_run"] is True
    assert list(report["parts"]) == [part.name for part in gpu.plan()]
    for name, part in report["parts"].items():
        assert part["status"] == "dry-run ok", (name, part.get("why"))
    assert sum(part["limit_s"] for part in report["parts"].values()) <= gpu.BUDGET_S == 480
    markdown = (tmp_path / "report" / "gpu_report.md").read_text()
    assert markdown.count("| dry-run ok |") == len(gpu.plan())
    log = (tmp_path / "report" / "gpu_log.txt").read_text()
    assert "--help" in log and "--tiny" in log
    # Issue 52's parts ran for real on this CPU, tiny, and their report lines read what they measured.
    rows = {line.split(" | ")[0].strip("| "): line for line in markdown.splitlines() if line.startswith("| ")}
    engine = report["parts"]["engine"]["results"]["engine.json"]
    assert engine["streams"] == 16 and engine["tiny"] and engine["concurrent_tokens_per_s"] > 0
    assert f"16 streams {engine['concurrent_tokens_per_s']:,.0f} tokens/s" in rows["engine"]
    variants = report["parts"]["quantized"]["results"]["quantized.json"]["variants"]
    assert list(variants) == ["fp32", "bf16", "int8", "int4"]
    assert all(0.0 <= v["agreement"] <= 1.0 and v["tokens_per_s"] > 0 for v in variants.values())
    assert "int4" in rows["quantized"] and "of greedy tokens as fp32" in rows["quantized"]
    speed = report["parts"]["mfu"]["results"]["mfu.json"]["speed"]
    assert speed["tokens_per_s"] > 0 and len(speed["step_seconds"]) == 2
    assert "llama-tiny" in rows["mfu"] and "measured" in rows["mfu"]


def test_the_plan_measures_issue_52s_parts_on_the_gpu_and_tiny_on_a_cpu():
    parts = {part.name: part for part in gpu.plan()}
    assert {"engine", "quantized", "mfu"} <= set(parts)
    assert sum(part.limit_s for part in parts.values()) <= gpu.BUDGET_S
    for name in ("engine", "quantized", "mfu"):
        (step,) = parts[name].steps
        assert step.args[step.args.index("--device") + 1] == "cuda"
        assert step.dry_args[step.dry_args.index("--device") + 1] == "cpu"
    mfu = parts["mfu"].steps[0].args
    assert mfu[mfu.index("--preset") + 1] == "gpt2-medium" and "--compile" in mfu and "--fill" in mfu
    assert "--compiled" in parts["quantized"].steps[0].args and "--compiled" not in parts["quantized"].steps[0].dry_args


def test_the_dry_run_fails_a_part_whose_tiny_run_fails_or_leaves_results_its_summary_cannot_read(tmp_path):
    crashes = gpu.Part("engine", "a tiny run that crashes", 10,
                       [gpu.Step([sys.executable, "-m", "benchmarks.gpu_memory"],
                                 dry_args=[sys.executable, "-c", "import sys; print('engine broke'); sys.exit(2)"])],
                       ["engine.json"])
    outcome = gpu.dry_check(crashes, tmp_path, log=[])
    assert outcome["status"] == "dry-run failed" and "exit status 2" in outcome["why"]
    assert "engine broke" in outcome["why"]

    writes = "import json, pathlib; pathlib.Path('{work}/engine.json').write_text(json.dumps(dict(streams=16)))"
    unreadable = gpu.Part("engine", "a tiny run whose results lack the summary's keys", 10,
                          [gpu.Step([sys.executable, "-m", "benchmarks.gpu_memory"],
                                    dry_args=[sys.executable, "-c", writes])], ["engine.json"])
    outcome = gpu.dry_check(unreadable, tmp_path, log=[])
    assert outcome["status"] == "dry-run failed" and "summary" in outcome["why"], outcome

    (tmp_path / "engine.json").unlink()
    silent = gpu.Part("engine", "a tiny run that writes nothing", 10,
                      [gpu.Step([sys.executable, "-m", "benchmarks.gpu_memory"], dry_args=[sys.executable, "-c", "0"])],
                      ["engine.json"])
    outcome = gpu.dry_check(silent, tmp_path, log=[])
    assert outcome["status"] == "dry-run failed" and "left no engine.json" in outcome["why"]


def test_the_dry_run_names_a_flag_a_program_does_not_take(tmp_path, monkeypatch):
    part = gpu.Part("made_up", "a step with a flag no program has", 10,
                    [gpu.Step([sys.executable, "-m", "benchmarks.gpu_memory", "--no-such-flag", "1"])], [])
    outcome = gpu.dry_check(part, tmp_path, log=[])
    assert outcome["status"] == "dry-run failed" and "--no-such-flag" in outcome["why"]


def stand_in(name: str, code: str, limit_s: int = 60, results: tuple[str, ...] = ("r.json",)) -> gpu.Part:
    """A part of one Python step running ``code`` ("{work}" is the work folder)."""
    return gpu.Part(name, name, limit_s, [gpu.Step([sys.executable, "-c", code])], list(results))


def test_each_part_gets_the_status_it_earned(tmp_path, monkeypatch):
    work, log = tmp_path / "work", []
    work.mkdir()
    plenty = lambda: 400.0
    writes = "import json, pathlib; pathlib.Path('{work}/r.json').write_text(json.dumps({{'x': 1}}))"
    passed = gpu.run_part(stand_in("ok", writes), work, plenty, log)
    assert passed["status"] == "passed" and passed["results"] == {"r.json": {"x": 1}}

    failed = gpu.run_part(stand_in("bad", "import sys; print('boom'); sys.exit(3)"), work, plenty, log)
    assert failed["status"] == "failed" and failed["why"] == "exit status 3" and "boom" in failed["output"]

    (work / "r.json").unlink()
    silent = gpu.run_part(stand_in("silent", "pass"), work, plenty, log)  # exit 0, no result file
    assert silent["status"] == "failed" and "r.json" in silent["why"]

    slow = gpu.run_part(stand_in("slow", "import time; time.sleep(60)", limit_s=2), work, plenty, log)
    assert slow["status"] == "timed out" and slow["seconds"] < 30

    # The overall budget caps a part's own limit, and a part is not started with too little of it left.
    monkeypatch.setattr(gpu, "MIN_START_S", 1)
    capped = gpu.run_part(stand_in("capped", "import time; time.sleep(60)", limit_s=300), work,
                          lambda: 3.0, log)
    assert capped["status"] == "timed out" and capped["seconds"] < 20
    skipped = gpu.run_part(stand_in("late", writes), work, lambda: 0.5, log)
    assert skipped["status"] == "skipped" and not (work / "r.json").exists()
    assert len(log) == 5  # every started command's output is kept for gpu_log.txt


def test_the_report_says_what_ran_failed_and_was_skipped(tmp_path):
    parts = gpu.plan()
    facts = {"date": "2026-11-27", "python": "3.12", "torch": "2.11", "cuda": "13.0", "gpu": "NVIDIA H100",
             "gpu_memory_gib": 79.2, "commit": "abc", "transformers": "5.17"}
    junit = tmp_path / "cuda_tests.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="tests.test_cuda" name="test_a"/>'
                     '<testcase classname="tests.test_cuda" name="test_b"><failure message="x"/></testcase>'
                     '</testsuite></testsuites>')
    run_summary = {"steps": 800, "val_bits_per_byte": 1.97, "train_seconds": 41.0, "tokens_per_s": 400000.0}
    outcomes = {"cuda_tests": {"status": "passed", "seconds": 50.0,
                               "results": {"cuda_tests.xml": gpu.junit_counts(junit)}},
                "train": {"status": "failed", "seconds": 12.0, "why": "exit status 1", "output": "Traceback"},
                "decode": {"status": "timed out", "seconds": 80.0, "why": "killed after 80 s"},
                "main_job": {"status": "passed", "seconds": 60.0, "results": {"main/summary.json": run_summary}},
                "torchrun": {"status": "skipped", "seconds": 0.0, "why": "12 s of the budget left"}}
    markdown = gpu.write_report(tmp_path / "out", facts, parts, outcomes, dry_run=False, wall=202.0, log=["$ x"])
    rows = {line.split(" | ")[0].strip("| "): line for line in markdown.splitlines() if line.startswith("| ")}
    assert "| passed |" in rows["cuda_tests"] and "1 passed, 1 failed" in rows["cuda_tests"]
    assert "tests.test_cuda::test_b" in rows["cuda_tests"]
    assert "| failed |" in rows["train"] and "exit status 1" in rows["train"]
    assert "| timed out |" in rows["decode"] and "| skipped |" in rows["torchrun"]
    assert "800 steps, val 1.970 bits per byte" in rows["main_job"]
    assert "NVIDIA H100, 79.2 GiB" in markdown and "Wall time 202 s" in markdown
    saved = json.loads((tmp_path / "out" / "gpu_report.json").read_text())
    assert saved["parts"]["train"]["output"] == "Traceback" and saved["parts"]["torchrun"]["status"] == "skipped"
    assert saved["parts"]["decode"]["limit_s"] == next(p.limit_s for p in parts if p.name == "decode")


def test_the_report_lines_read_the_recorded_gpu_run():
    """The H200 run of 2026-11-27 (benchmarks/gpu_reports/), its results summarised as the report writes them."""
    report = json.loads((ROOT / "benchmarks" / "gpu_reports" / "2026-11-27-h200.json").read_text())
    lines = {name: gpu.summary_of(name, part) for name, part in report["parts"].items()}
    assert all(line and "unreadable" not in line for line in lines.values()), lines
    assert lines["cuda_tests"] == "22 passed, 0 failed, 0 skipped"
    assert "gpt2-small bf16-compiled: 184,948 vs transformers 381,637 tokens/s (0.48x)" in lines["train"]
    assert "compiled-cuda-graphs 1,081 (6.17x, 15% of the floor)" in lines["decode"]
    assert "measured 4.35 GiB, planned 4.88 GiB (0.89)" in lines["torchrun"]
    # Later checks add a compiled run with the unpadded vocabulary, summarised after the padded ones.
    train = report["parts"]["train"]
    train["results"]["train_unpadded.json"] = train["results"]["train.json"]
    line = gpu.summary_of("train", train)
    assert line.index("bf16-compiled: 184,948") < line.index("bf16-compiled, unpadded vocabulary: 184,948")


def test_the_report_lines_read_issue_52s_parts():
    results = {
        "engine": {"engine.json": {"streams": 16, "concurrent_tokens_per_s": 4800.0, "single_tokens_per_s": 400.0,
                                   "ratio": 11.5}},
        "quantized": {"quantized.json": {"variants": {
            "fp32": {"agreement": 1.0, "tokens_per_s": 240.0, "compiled_tokens_per_s": 900.0},
            "int8": {"agreement": 0.97, "tokens_per_s": 200.0, "compiled_tokens_per_s": None}}}},
        "mfu": {"mfu.json": {"preset": "gpt2-medium", "parallel": "ddp", "batch_size": 32, "context_length": 1024,
                             "measured_bytes": 40 * 2**30, "planned_bytes": 50 * 2**30, "ratio": 0.8,
                             "speed": {"tokens_per_s": 150_000.0, "mfu": 0.41}}},
    }
    lines = {name: gpu.summary_of(name, {"results": r}) for name, r in results.items()}
    assert lines["engine"] == "16 streams 4,800 tokens/s, one at a time 400 (11.50x)"
    assert lines["quantized"] == ("tokens/s: fp32 240, compiled 900; int8 200, compiled: no time left, 97% of greedy "
                                  "tokens as fp32")
    assert lines["mfu"].startswith("gpt2-medium: 150,000 tokens/s, MFU 41% of the datasheet peak; memory of one "
                                   "gpt2-medium step (ddp, 32 x 1024): measured 40.00 GiB, planned 50.00 GiB")


def test_the_filling_batch_is_the_largest_power_of_two_the_planner_fits():
    from benchmarks import gpu_memory
    from llmscratch.model.config import GPTConfig
    from llmscratch.training.memory import plan

    config = GPTConfig.from_preset("gpt2-medium")
    for fill in (8.0, 30.0, 60.0):
        args = gpu_memory.parse_args(["--preset", "gpt2-medium", "--fill", str(fill)])
        batch = gpu_memory.filling_batch(config, args, 1, "cuda")
        planned = [plan(config, "ddp", 1, batch_size=b, dtype="bfloat16").total for b in (batch, 2 * batch)]
        assert batch & (batch - 1) == 0 and planned[0] <= fill * 2**30 < planned[1], (fill, batch, planned)


def test_a_real_run_without_a_gpu_stops_at_once_with_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "environment", lambda: {"gpu": None})  # as on CI's machines, whatever this one has
    monkeypatch.setattr(gpu, "run_part", lambda *args: pytest.fail("a part started without a GPU"))
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--out", str(tmp_path / "report")])
    assert "no CUDA GPU here" in str(exit_info.value.code) and "--dry-run" in str(exit_info.value.code)
    assert not (tmp_path / "report").exists()
