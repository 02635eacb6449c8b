"""The prepared device check: everything that needs a CUDA GPU, in one command of at most 8 minutes.

    python -m benchmarks gpu --out gpu-report             # on a machine with one CUDA GPU
    python -m benchmarks gpu --dry-run --out /tmp/check   # on any machine: the plan, imports, flags, report writer

A GPU is lent to this project now and then, for minutes: this command is ready before one is. It runs five
parts one after the other, each a subprocess with its own time limit (and never past the overall budget):

1. ``cuda_tests``: the CUDA-marked tests (``pytest -m cuda tests/test_cuda.py``; on a CPU machine the marker
   deselects them);
2. ``train``: training tokens/s and MFU of the gpt2-small shape, bf16 and bf16 + torch.compile, beside
   transformers' GPT-2 in the same rounds (``benchmarks.bench_train --device cuda``); ours with its
   vocabulary padded to a multiple of 64 (50,304 rows), as pretrain.py pads it (tokens/s and MFU count the
   real 50,257);
3. ``decode``: greedy decoding tokens/s (eager, compiled, compiled with CUDA graphs) beside transformers'
   ``generate``, with the bandwidth floor measured on the device (``benchmarks.bench_generate --device cuda``);
4. ``main_job``: the main job's default run (``ch04-pretraining/pretrain.py``): wall time and bits per byte;
5. ``torchrun``: ``torchrun --nproc_per_node 1`` of the main job for 300 steps with NCCL, under DDP and
   under FSDP, then the memory planner's prediction against ``torch.cuda.max_memory_allocated`` for one
   step (``benchmarks.gpu_memory``).

``--out`` receives gpu_report.md, gpu_report.json (every number, each part's status, seconds and
limit) and gpu_log.txt (the end of every step's output). A part is "passed", "failed" (non-zero
exit, or a result file missing), "timed out" (killed at its limit) or "skipped" (too little of the
budget left). ``--dry-run`` runs no part: it checks that every step's program imports and accepts
every flag the plan passes (``--help``; pytest collects the test file), that the limits fit the
budget, and writes the report from the statuses it found; CI runs it (tests/test_gpu_check.py).
"""

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
BUDGET_S = 480  # the 8 minutes, compilation included
MIN_START_S = 20  # a part is not started with less of the budget left than this
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]


@dataclass
class Step:
    """One command of a part; "{work}" and "{tokenizer}" in its arguments are filled in when it starts."""

    args: list[str]
    program: list[str] = field(default_factory=list)  # what --help is asked of in a dry run (default: args' head)


@dataclass
class Part:
    name: str
    title: str
    limit_s: int
    steps: list[Step]
    results: list[str]  # files under {work} that a passed part leaves (read into the report)


def plan() -> list[Part]:
    """The five parts, in the order they run; their limits add up to at most BUDGET_S."""
    pretrain = [PY, "ch04-pretraining/pretrain.py"]
    run_flags = ["--device", "cuda", "--no-progress"]
    return [
        Part("cuda_tests", "CUDA-marked tests", 95,
             [Step([PY, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-v", "-m", "cuda",
                    "tests/test_cuda.py", "--junitxml", "{work}/cuda_tests.xml"])],
             ["cuda_tests.xml"]),
        Part("train", "training throughput and MFU, gpt2-small, bf16 and bf16 + compile, vs transformers; "
                      "then compiled with the unpadded 50,257-word vocabulary", 180,
             [Step([PY, "-m", "benchmarks.bench_train", "--device", "cuda", "--configs", "gpt2-small",
                    "--modes", "bf16", "bf16-compiled", "--runs", "5", "--pad-vocab", "64", "--json",
                    "{work}/train.json"]),
              Step([PY, "-m", "benchmarks.bench_train", "--device", "cuda", "--configs", "gpt2-small",
                    "--modes", "bf16-compiled", "--runs", "3", "--pad-vocab", "1", "--no-memory", "--json",
                    "{work}/train_unpadded.json"])],
             ["train.json", "train_unpadded.json"]),
        Part("decode", "decoding tokens/s: eager, compiled, CUDA graphs, vs transformers' generate", 75,
             [Step([PY, "-m", "benchmarks.bench_generate", "--device", "cuda", "--runs", "3", "--candidates",
                    "transformers", "cache", "compiled", "compiled-cuda-graphs", "--json", "{work}/decode.json"])],
             ["decode.json"]),
        Part("main_job", "the main job's default run", 45,
             [Step([*pretrain, "--out-dir", "{work}/main", *run_flags])],
             ["main/summary.json"]),
        Part("torchrun", "torchrun --nproc_per_node 1 (NCCL): DDP and FSDP, 300 steps; the memory planner", 85,
             [Step([*TORCHRUN, *pretrain[1:], "--parallel", parallel, "--max-steps", "300", "--eval-interval",
                    "100", "--tokenizer", "{tokenizer}", "--out-dir", f"{{work}}/{parallel}", *run_flags],
                   program=pretrain) for parallel in ("ddp", "fsdp")]
             + [Step([*TORCHRUN, "-m", "benchmarks.gpu_memory", "--parallel", "fsdp", "--device", "cuda", "--json",
                      "{work}/memory.json"], program=[PY, "-m", "benchmarks.gpu_memory"])],
             ["ddp/summary.json", "fsdp/summary.json", "memory.json"]),
    ]


# --------------------------------------------------------------------------- running
def fill(args: list[str], work: Path) -> list[str]:
    main_tokenizer = work / "main" / "tokenizer.json"  # the main job's: no second tokenizer training
    tokenizer = str(main_tokenizer) if main_tokenizer.is_file() else "bpe:4096"
    return [a.format(work=work, tokenizer=tokenizer) for a in args]


def run_command(command: list[str], timeout: float, log: list[str]) -> tuple[int | None, str]:
    """(exit status or None if killed at ``timeout``, the output); the whole process group dies with it."""
    with subprocess.Popen(command, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
            status = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            status = None
    log.append(f"$ {' '.join(command)}\n{tail(output, 8000)}\n[exit status: {status}]\n")
    return status, output


def tail(text: str, chars: int) -> str:
    return text if len(text) <= chars else "..." + text[-chars:]


def run_part(part: Part, work: Path, remaining: Callable[[], float], log: list[str]) -> dict:
    if remaining() < MIN_START_S:
        return {"status": "skipped", "why": f"{remaining():.0f} s of the budget left", "seconds": 0.0}
    start = time.monotonic()
    deadline = start + min(part.limit_s, remaining())
    for step in part.steps:
        left = deadline - time.monotonic()
        if left <= 0:
            return {"status": "timed out", "why": "its limit was spent before this step",
                    "seconds": time.monotonic() - start}
        status, output = run_command(fill(step.args, work), left, log)
        if status is None:
            return {"status": "timed out", "why": f"killed after {part.limit_s} s", "output": tail(output, 1500),
                    "seconds": time.monotonic() - start}
        if status != 0:
            return {"status": "failed", "why": f"exit status {status}", "output": tail(output, 1500),
                    "seconds": time.monotonic() - start}
    missing = [name for name in part.results if not (work / name).is_file()]
    if missing:
        return {"status": "failed", "why": f"no {', '.join(missing)}", "seconds": time.monotonic() - start}
    return {"status": "passed", "seconds": time.monotonic() - start, "results": read_results(part, work)}


def read_results(part: Part, work: Path) -> dict:
    results = {}
    for name in part.results:
        path = work / name
        results[name] = junit_counts(path) if name.endswith(".xml") else json.loads(path.read_text(encoding="utf-8"))
    return results


def junit_counts(path: Path) -> dict:
    """Passed, failed and skipped tests, and the failures' names, of a pytest --junitxml file."""
    cases = ElementTree.parse(path).getroot().iter("testcase")
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            counts["failures"].append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


# --------------------------------------------------------------------------- the dry run
def dry_check(part: Part, work: Path, log: list[str]) -> dict:
    """Each step's program imports and takes every flag the plan gives it; the test file collects."""
    start, problems = time.monotonic(), []
    for step in part.steps:
        args = fill(step.args, work)
        if "pytest" in args[:3]:
            test_files = [a for a in args if a.startswith("tests/")]
            status, output = run_command([PY, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p",
                                          "no:cacheprovider", *test_files], 120, log)
            if status not in (0, 5):  # 5: nothing selected (the cuda marker deselects every test on a CPU)
                problems.append(f"pytest cannot collect {test_files}: {tail(output, 500)}")
            continue
        program = step.program or (args[:3] if args[1] == "-m" else args[:2])
        status, output = run_command([*program, "--help"], 120, log)
        if status != 0:
            problems.append(f"{' '.join(program[1:])} --help: exit status {status}: {tail(output, 500)}")
            continue
        for flag in (a for a in args if re.fullmatch(r"--[a-z][a-z0-9-]*", a)):
            if not re.search(re.escape(flag) + r"(?![\w-])", output) and not (
                    args[:len(TORCHRUN)] == TORCHRUN and flag in TORCHRUN):
                problems.append(f"{' '.join(program[1:])} has no flag {flag}")
    return {"status": "dry-run ok" if not problems else "dry-run failed", "why": "; ".join(problems),
            "seconds": time.monotonic() - start}


# --------------------------------------------------------------------------- the report
def environment() -> dict:
    import torch

    facts = {"date": datetime.date.today().isoformat(), "python": sys.version.split()[0], "torch": torch.__version__,
             "cuda": torch.version.cuda, "gpu": None, "gpu_memory_gib": None, "commit": commit()}
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        facts.update(gpu=properties.name, gpu_memory_gib=round(properties.total_memory / 2**30, 1))
    try:
        import transformers

        facts["transformers"] = transformers.__version__
    except ImportError:
        facts["transformers"] = None
    return facts


def commit() -> str:
    if shutil.which("git") is None:
        return "unknown"
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown (not a git checkout)"


def summary_of(name: str, outcome: dict) -> str:
    """One line of the part's headline numbers, from its results (tolerant of a missing key)."""
    results = outcome.get("results")
    if not results:
        return outcome.get("why", "")
    try:
        return SUMMARIES[name](results)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
        return f"(results present, summary unreadable: {err!r}; see gpu_report.json)"


def _tests(results: dict) -> str:
    counts = results["cuda_tests.xml"]
    failed = f": {', '.join(counts['failures'])}" if counts["failures"] else ""
    return f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped{failed}"


def _train(results: dict) -> str:
    parts = []
    # The first report (the H200, 2026-11-27) has no unpadded run.
    for file, vocabulary in (("train.json", ""), ("train_unpadded.json", ", unpadded vocabulary")):
        for name, config in results.get(file, {"configs": {}})["configs"].items():
            for mode, m in config["modes"].items():
                ours, theirs = m["peers"]["llmscratch"], m["peers"]["transformers"]
                mfu = (f"MFU {ours['mfu_datasheet']:.0%} / {theirs['mfu_datasheet']:.0%} of the datasheet peak"
                       if ours["mfu_datasheet"] is not None else f"MFU {ours['mfu']:.0%} / {theirs['mfu']:.0%}")
                parts.append(f"{name} {mode}{vocabulary}: {ours['tokens_per_s']:,.0f} vs transformers "
                             f"{theirs['tokens_per_s']:,.0f} tokens/s ({m['ratio']:.2f}x), {mfu}")
    return "; ".join(parts)


def _decode(results: dict) -> str:
    data = results["decode.json"]
    rates = ", ".join(f"{name} {c['tokens_per_s']:,.0f} ({c['vs_transformers']:.2f}x, {c['floor_share']:.0%} of the "
                      f"floor)" for name, c in data["candidates"].items())
    return (f"tokens/s: {rates}; floor {data['floor_tokens_per_s']['fp32']:,.0f} tokens/s at "
            f"{data['bandwidth'] / 1e12:.2f} TB/s")


def _run_summary(summary: dict) -> str:
    return (f"{summary['steps']} steps, val {summary['val_bits_per_byte']:.3f} bits per byte, "
            f"{summary['train_seconds']:.0f} s training, {summary['tokens_per_s']:,.0f} tokens/s")


def _torchrun(results: dict) -> str:
    memory = results["memory.json"]
    return (f"DDP: {_run_summary(results['ddp/summary.json'])}; FSDP: {_run_summary(results['fsdp/summary.json'])}; "
            f"memory of one {memory['preset']} step ({memory['parallel']}, {memory['batch_size']} x "
            f"{memory['context_length']}): measured {memory['measured_bytes'] / 2**30:.2f} GiB, planned "
            f"{memory['planned_bytes'] / 2**30:.2f} GiB ({memory['ratio']:.2f})")


SUMMARIES: dict[str, Callable[[dict], str]] = {
    "cuda_tests": _tests,
    "train": _train,
    "decode": _decode,
    "main_job": lambda r: _run_summary(r["main/summary.json"]),
    "torchrun": _torchrun,
}


def write_report(out: Path, facts: dict, parts: list[Part], outcomes: dict, dry_run: bool, wall: float,
                 log: list[str]) -> str:
    """gpu_report.md, gpu_report.json and gpu_log.txt in ``out``; returns the Markdown."""
    from llmscratch.files import write_json_atomically, write_text_atomically

    out.mkdir(parents=True, exist_ok=True)
    device = f"{facts['gpu']}, {facts['gpu_memory_gib']} GiB" if facts["gpu"] else "no CUDA GPU"
    lines = [f"### GPU check{' (dry run)' if dry_run else ''} ({facts['date']})", "",
             f"Command: `python -m benchmarks gpu{' --dry-run' if dry_run else ''}`  ",
             f"Device: {device}; torch "
             f"{facts['torch']} (CUDA {facts['cuda']}), transformers {facts['transformers']}, Python "
             f"{facts['python']}; commit {facts['commit']}  ",
             f"Wall time {wall:.0f} s of a {sum(p.limit_s for p in parts)} s plan (budget {BUDGET_S} s).", "",
             "| part | what | status | seconds (limit) | result |", "|---|---|---|---:|---|"]
    for part in parts:
        outcome = outcomes.get(part.name, {"status": "not run", "seconds": 0.0})
        result = summary_of(part.name, outcome).replace("|", "/").replace("\n", " ")
        lines.append(f"| {part.name} | {part.title} | {outcome['status']} | {outcome['seconds']:.0f} "
                     f"({part.limit_s}) | {result} |")
    markdown = "\n".join(lines) + "\n"
    write_text_atomically(out / "gpu_report.md", markdown)
    write_json_atomically(out / "gpu_report.json", {
        "environment": facts, "dry_run": dry_run, "wall_seconds": wall, "budget_seconds": BUDGET_S,
        "parts": {p.name: {"title": p.title, "limit_s": p.limit_s, "commands": [s.args for s in p.steps],
                           **outcomes.get(p.name, {"status": "not run"})} for p in parts}})
    write_text_atomically(out / "gpu_log.txt", "\n".join(log))
    return markdown


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks gpu", description=__doc__.splitlines()[0],
                                     epilog="\n".join(__doc__.splitlines()[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-report"),
                        help="where gpu_report.md, gpu_report.json and gpu_log.txt go (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="check the plan and write the report; run no part")
    parser.add_argument("--parts", nargs="+", default=None, metavar="PART",
                        help="run only these parts (default: all, in order)")
    args = parser.parse_args(argv)
    names = [part.name for part in plan()]
    unknown = [name for name in args.parts or [] if name not in names]
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose among {names}")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: a file, not a folder")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = [part for part in plan() if args.parts is None or part.name in args.parts]
    planned = sum(part.limit_s for part in plan())
    if planned > BUDGET_S:  # the plan itself is wrong: found by the dry run in CI, not on the day
        sys.exit(f"error: the parts' limits add up to {planned} s, over the {BUDGET_S} s budget")
    facts = environment()
    if not args.dry_run and facts["gpu"] is None:
        sys.exit("error: no CUDA GPU here; `python -m benchmarks gpu --dry-run` checks the plan on any machine")
    start, log, outcomes = time.monotonic(), [], {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        work = Path(folder)
        for part in parts:
            print(f"== {part.name}: {part.title} (limit {part.limit_s} s)", file=sys.stderr, flush=True)
            if args.dry_run:
                outcomes[part.name] = dry_check(part, work, log)
            else:
                outcomes[part.name] = run_part(part, work,
                                               lambda: BUDGET_S - (time.monotonic() - start), log)
            print(f"   {outcomes[part.name]['status']} in {outcomes[part.name]['seconds']:.0f} s "
                  f"{outcomes[part.name].get('why', '')}", file=sys.stderr, flush=True)
    markdown = write_report(args.out, facts, parts, outcomes, args.dry_run, time.monotonic() - start, log)
    print(markdown)
    good = {"passed", "dry-run ok"}
    return 0 if all(outcome["status"] in good for outcome in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
