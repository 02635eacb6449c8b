"""The prepared device check: everything that needs a CUDA GPU, in one command of at most 8 minutes.

    python -m benchmarks gpu --out gpu-report             # on a machine with one CUDA GPU
    python -m benchmarks gpu --dry-run --out /tmp/check   # on any machine: the plan, imports, flags, report writer

A GPU is lent to this project now and then, for minutes: this command is ready before one is. It runs eight
parts one after the other, each a subprocess with its own time limit (and never past the overall budget):

1. ``cuda_tests``: the CUDA-marked tests (``pytest -m cuda tests/test_cuda.py``; on a CPU machine the marker
   deselects them);
2. ``train``: training tokens/s and MFU of the gpt2-small shape, bf16 + torch.compile, beside
   transformers' GPT-2 in the same rounds (``benchmarks.bench_train --device cuda``); ours with its
   vocabulary padded to a multiple of 64 (50,304 rows), as pretrain.py pads it (tokens/s and MFU count the
   real 50,257);
3. ``decode``: greedy decoding tokens/s (eager, compiled, compiled with CUDA graphs) beside transformers'
   ``generate``, with the bandwidth floor measured on the device (``benchmarks.bench_generate --device cuda``);
4. ``main_job``: the main job's default run (``ch04-pretraining/pretrain.py``): wall time and bits per byte;
5. ``torchrun``: ``torchrun --nproc_per_node 1`` of the main job for 300 steps with NCCL under FSDP, then
   the memory planner's prediction against ``torch.cuda.max_memory_allocated`` for one step
   (``benchmarks.gpu_memory``);
6. ``engine``: the serving engine (``deployment.engine.Engine``, 16 slots) with 16 streams at once against one
   at a time, greedy, on the gpt2-small shape: tokens/s and their ratio (``--measure engine`` below);
7. ``quantized``: ``generate`` tokens/s of the gpt2-small shape in fp32, bf16, int8 and int4
   (``model.quantize``), eager and compiled, and how often the quantized models' greedy token is the float
   model's (``--measure quantized``);
8. ``mfu``: training MFU of gpt2-medium, bf16 + torch.compile, at the largest batch planned to fit 60 GiB
   (``benchmarks.gpu_memory --fill``), beside gpt2-small's in ``train``.

The engine and quantized parts are measured here, ``python -m benchmarks.gpu --measure engine|quantized``:
interleaved rounds after a warm-up, medians; ``--tiny`` on a CPU is the same code on a 2-layer model.

``--out`` receives gpu_report.md, gpu_report.json (every number, each part's status, seconds and
limit) and gpu_log.txt (the end of every step's output). A part is "passed", "failed" (non-zero
exit, or a result file missing), "timed out" (killed at its limit) or "skipped" (too little of the
budget left). ``--dry-run`` runs no part: it checks that every step's program imports and accepts
every flag the plan passes (``--help``; pytest collects the test file), that the limits fit the
budget, and writes the report from the statuses it found; the engine, quantized and mfu parts also run once,
on this CPU at tiny shapes, and their summaries must read. CI runs it (tests/test_gpu_check.py).
"""

import argparse
import copy
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
BUDGET_S = 480  # the 8 minutes, compilation included
MIN_START_S = 20  # a part is not started with less of the budget left than this
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
DRY_RUN_S = 240  # a tiny CPU run of one step in the dry run
STREAMS = 16  # the engine's slots, and the streams measured at once
REQUEST_TIMEOUT_S = 120.0


@dataclass
class Step:
    """One command of a part; "{work}" and "{tokenizer}" in its arguments are filled in when it starts."""

    args: list[str]
    program: list[str] = field(default_factory=list)  # what --help is asked of in a dry run (default: args' head)
    dry_args: list[str] | None = None  # also run in a dry run: the same measurement on this CPU at tiny shapes


@dataclass
class Part:
    name: str
    title: str
    limit_s: int
    steps: list[Step]
    results: list[str]  # files under {work} that a passed part leaves (read into the report)


def measured_here(name: str, cuda_flags: tuple[str, ...] = ()) -> Step:
    """A step of ``--measure name`` (below) on CUDA; in a dry run, on this CPU with ``--tiny`` and no cuda_flags."""
    head = [PY, "-m", "benchmarks.gpu", "--measure", name]
    return Step([*head, *cuda_flags, "--device", "cuda", "--json", f"{{work}}/{name}.json"],
                dry_args=[*head, "--device", "cpu", "--tiny", "--json", f"{{work}}/{name}.json"])


def plan() -> list[Part]:
    """The eight parts, in the order they run; their limits add up to at most BUDGET_S."""
    pretrain = [PY, "ch04-pretraining/pretrain.py"]
    run_flags = ["--device", "cuda", "--no-progress"]
    memory = [PY, "-m", "benchmarks.gpu_memory"]
    return [
        Part("cuda_tests", "CUDA-marked tests", 85,
             [Step([PY, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-v", "-m", "cuda",
                    "tests/test_cuda.py", "--junitxml", "{work}/cuda_tests.xml"])],
             ["cuda_tests.xml"]),
        Part("train", "training throughput and MFU, gpt2-small, bf16 + compile, vs transformers", 75,
             [Step([PY, "-m", "benchmarks.bench_train", "--device", "cuda", "--configs", "gpt2-small",
                    "--modes", "bf16-compiled", "--runs", "3", "--pad-vocab", "64", "--no-memory", "--json",
                    "{work}/train.json"])],
             ["train.json"]),
        Part("decode", "decoding tokens/s: eager, compiled, CUDA graphs, vs transformers' generate", 70,
             [Step([PY, "-m", "benchmarks.bench_generate", "--device", "cuda", "--runs", "3", "--candidates",
                    "transformers", "cache", "compiled", "compiled-cuda-graphs", "--json", "{work}/decode.json"])],
             ["decode.json"]),
        Part("main_job", "the main job's default run", 45,
             [Step([*pretrain, "--out-dir", "{work}/main", *run_flags])],
             ["main/summary.json"]),
        Part("torchrun", "torchrun --nproc_per_node 1 (NCCL): FSDP, 300 steps; the memory planner", 50,
             [Step([*TORCHRUN, *pretrain[1:], "--parallel", "fsdp", "--max-steps", "300", "--eval-interval",
                    "100", "--tokenizer", "{tokenizer}", "--out-dir", "{work}/fsdp", *run_flags], program=pretrain),
              Step([*TORCHRUN, "-m", "benchmarks.gpu_memory", "--parallel", "fsdp", "--device", "cuda", "--json",
                    "{work}/memory.json"], program=memory)],
             ["fsdp/summary.json", "memory.json"]),
        Part("engine", f"the serving engine, {STREAMS} streams at once vs one at a time, gpt2-small shape", 35,
             [measured_here("engine")], ["engine.json"]),
        Part("quantized", "generate tokens/s, gpt2-small shape: fp32, bf16, int8, int4, eager and compiled", 55,
             [measured_here("quantized", ("--compiled", "bf16", "int8", "int4", "--max-seconds", "40"))],
             ["quantized.json"]),
        Part("mfu", "training MFU of gpt2-medium, bf16 + compile, the batch planned to fill 60 GiB", 65,
             [Step([*memory, "--preset", "gpt2-medium", "--fill", "60", "--compile", "--mfu-steps", "6", "--device",
                    "cuda", "--json", "{work}/mfu.json"],
                   dry_args=[*memory, "--preset", "llama-tiny", "--context-length", "64", "--fill", "0.05",
                             "--mfu-steps", "2", "--dtype", "float32", "--device", "cpu", "--json",
                             "{work}/mfu.json"])],
             ["mfu.json"]),
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
        if step.dry_args is not None and not problems:
            status, output = run_command(fill(step.dry_args, work), DRY_RUN_S, log)
            if status != 0:
                problems.append(f"{' '.join(step.dry_args[1:4])} on this CPU: exit status {status}: {tail(output, 800)}")
    outcome = {}
    if not problems and part.steps and all(step.dry_args is not None for step in part.steps):
        problems += tiny_results_problems(part, work)
        outcome = {} if problems else {"results": read_results(part, work)}  # the tiny numbers, in the report
    return {"status": "dry-run ok" if not problems else "dry-run failed", "why": "; ".join(problems),
            "seconds": time.monotonic() - start, **outcome}


def tiny_results_problems(part: Part, work: Path) -> list[str]:
    """What is wrong with the results a part's tiny CPU run left: a missing file or a summary that cannot read it."""
    missing = [name for name in part.results if not (work / name).is_file()]
    if missing:
        return [f"the tiny run left no {', '.join(missing)}"]
    line = summary_of(part.name, {"results": read_results(part, work)})
    return [f"the tiny run's summary: {line}"] if "unreadable" in line else []


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
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=False)
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


def _memory(memory: dict) -> str:
    return (f"memory of one {memory['preset']} step ({memory['parallel']}, {memory['batch_size']} x "
            f"{memory['context_length']}): measured {memory['measured_bytes'] / 2**30:.2f} GiB, planned "
            f"{memory['planned_bytes'] / 2**30:.2f} GiB ({memory['ratio']:.2f})")


def _torchrun(results: dict) -> str:
    # The reports before issue 52 also ran DDP.
    ddp = f"DDP: {_run_summary(results['ddp/summary.json'])}; " if "ddp/summary.json" in results else ""
    return f"{ddp}FSDP: {_run_summary(results['fsdp/summary.json'])}; {_memory(results['memory.json'])}"


def _engine(results: dict) -> str:
    data = results["engine.json"]
    return (f"{data['streams']} streams {data['concurrent_tokens_per_s']:,.0f} tokens/s, one at a time "
            f"{data['single_tokens_per_s']:,.0f} ({data['ratio']:.2f}x)")


def _quantized(results: dict) -> str:
    variants = results["quantized.json"]["variants"]
    parts = []
    for name, v in variants.items():
        compiled = ""
        if "compiled_tokens_per_s" in v:
            rate = v["compiled_tokens_per_s"]
            compiled = f", compiled {rate:,.0f}" if rate is not None else ", compiled: no time left"
        agrees = f", {v['agreement']:.0%} of greedy tokens as fp32" if name != "fp32" else ""
        parts.append(f"{name} {v['tokens_per_s']:,.0f}{compiled}{agrees}")
    return "tokens/s: " + "; ".join(parts)


def _mfu(results: dict) -> str:
    data = results["mfu.json"]
    speed = data["speed"]
    mfu = f"MFU {speed['mfu']:.0%} of the datasheet peak" if speed["mfu"] is not None else "no peak known"
    return f"{data['preset']}: {speed['tokens_per_s']:,.0f} tokens/s, {mfu}; {_memory(data)}"


SUMMARIES: dict[str, Callable[[dict], str]] = {
    "cuda_tests": _tests,
    "train": _train,
    "decode": _decode,
    "main_job": lambda r: _run_summary(r["main/summary.json"]),
    "torchrun": _torchrun,
    "engine": _engine,
    "quantized": _quantized,
    "mfu": _mfu,
}


def write_report(out: Path, facts: dict, parts: list[Part], outcomes: dict, dry_run: bool, wall: float,
                 log: list[str]) -> str:
    """gpu_report.md, gpu_report.json and gpu_log.txt in ``out``; returns the Markdown."""
    from llmscratch.files import write_json_atomically, write_text_atomically

    out.mkdir(parents=True, exist_ok=True)
    device = f"{facts['gpu']}, {facts['gpu_memory_gib']} GiB" if facts["gpu"] else "no CUDA GPU"
    lines = [f"### GPU check{' (dry run)' if dry_run else ''} ({facts['date']})", "",
             f"Command: `python -m benchmarks gpu{' --dry-run' if dry_run else ''}`  ",
             (f"Device: {device}; torch {facts['torch']} (CUDA {facts['cuda']}), transformers "
              f"{facts['transformers']}, Python {facts['python']}; commit {facts['commit']}  "),
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


# --------------------------------------------------------------------------- measured here: engine, quantized
def decoding_model(device: str, tiny: bool):
    """The gpt2-small shape with seeded random weights on ``device`` (tiny: 2 layers of width 64, 128 positions),
    and GPT-2's tokenizer."""
    import torch

    from llmscratch.model.config import GPTConfig
    from llmscratch.model.gpt import GPT
    from llmscratch.text.tokenizer import BPETokenizer

    torch.manual_seed(0)
    shrink = {"context_length": 128, "d_model": 64, "n_layers": 2, "n_heads": 4} if tiny else {}
    return GPT(GPTConfig.from_preset("gpt2-small", **shrink)).to(device).eval(), BPETokenizer.gpt2()


def random_prompts(count: int, length: int, vocab_size: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randint(vocab_size - 1, (count, length), generator=generator).tolist()  # no end-of-text id


def measure_engine(device: str, tiny: bool, rounds: int) -> dict:
    """Tokens/s of STREAMS requests at once, and of requests one after another, through one Engine; greedy."""
    from llmscratch.deployment.engine import Engine, SamplingParams
    from llmscratch.profiling import round_robin

    model, tokenizer = decoding_model(device, tiny)
    max_tokens, prompt_tokens = (8, 8) if tiny else (64, 16)
    prompts = random_prompts(STREAMS, prompt_tokens, model.config.vocab_size)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)

    def tokens_of(request) -> int:
        event = request.result(REQUEST_TIMEOUT_S)
        if event.finish_reason not in ("stop", "length"):
            raise SystemExit(f"error: a request ended with {event.finish_reason!r}: {event.error}")
        return len(event.token_ids)

    def at_once() -> float:
        start = time.perf_counter()
        tokens = sum(tokens_of(request) for request in [engine.submit(p, params) for p in prompts])
        return tokens / (time.perf_counter() - start)

    def one_at_a_time() -> float:  # a quarter of the prompts: the rate of one stream needs no more
        start = time.perf_counter()
        tokens = sum(tokens_of(engine.submit(p, params)) for p in prompts[:STREAMS // 4])
        return tokens / (time.perf_counter() - start)

    with Engine(model, tokenizer, max_slots=STREAMS) as engine:  # its cache as the engine sizes it by default
        one_at_a_time(), at_once()  # warm-up
        rates = round_robin({"single": one_at_a_time, "concurrent": at_once}, rounds)
    ratios = sorted(c / s for s, c in zip(rates["single"], rates["concurrent"]))
    return {"streams": STREAMS, "max_tokens": max_tokens, "prompt_tokens": prompt_tokens, "rounds": rounds,
            "single_tokens_per_s": statistics.median(rates["single"]),
            "concurrent_tokens_per_s": statistics.median(rates["concurrent"]),
            "ratio": statistics.median(ratios), "rates": rates}


def measure_quantized(device: str, tiny: bool, rounds: int, compiled: list[str], max_seconds: float) -> dict:
    """``generate`` tokens/s (batch 1, greedy) of the float and quantized models, and the share of positions where
    each one's greedy token, teacher-forced on the fp32 model's continuation, is the fp32 model's."""
    import torch

    from llmscratch.model.generate import generate
    from llmscratch.model.quantize import quantize
    from llmscratch.profiling import round_robin, time_once

    start = time.monotonic()
    model, _ = decoding_model(device, tiny)
    new_tokens, prompt_tokens = (8, 8) if tiny else (128, 32)
    prompt = torch.tensor(random_prompts(1, prompt_tokens, model.config.vocab_size), device=device)  # (1, T)
    variants = {"fp32": model, "bf16": copy.deepcopy(model).to(torch.bfloat16),
                "int8": quantize(model, "int8"), "int4": quantize(model, "int4")}
    reference = generate(model, prompt, new_tokens)  # (1, T + n)
    results = {}
    for name, variant in variants.items():
        with torch.no_grad():
            chosen = variant(reference)[0, prompt_tokens - 1:-1].argmax(-1)  # (n,)
        results[name] = {"agreement": (chosen == reference[0, prompt_tokens:]).float().mean().item()}
        generate(variant, prompt, new_tokens)  # warm-up
    seconds = round_robin({name: lambda v=variant: time_once(lambda: generate(v, prompt, new_tokens), device)
                           for name, variant in variants.items()}, rounds)
    for name in variants:
        results[name]["tokens_per_s"] = new_tokens / statistics.median(seconds[name])
    for name in compiled:  # one at a time: a compilation each, while the time allows
        if time.monotonic() - start > max_seconds:
            results[name]["compiled_tokens_per_s"] = None
            continue
        run = lambda v=variants[name]: generate(v, prompt, new_tokens, compile=True)
        run()  # compiles
        results[name]["compiled_tokens_per_s"] = new_tokens / statistics.median(
            [time_once(run, device) for _ in range(rounds)])
    return {"new_tokens": new_tokens, "prompt_tokens": prompt_tokens, "rounds": rounds, "variants": results}


def measure(args: argparse.Namespace) -> int:
    """The hidden side of --measure: one measurement, its JSON written to --json."""
    from llmscratch.files import write_json_atomically

    if args.measure == "engine":
        result = measure_engine(args.device, args.tiny, args.rounds)
    else:
        result = measure_quantized(args.device, args.tiny, args.rounds, args.compiled, args.max_seconds)
    result.update(device=args.device, tiny=args.tiny)
    write_json_atomically(args.json, result)
    print(json.dumps(result, indent=1))
    return 0


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
    measured = parser.add_argument_group("one measurement of a part, as the check runs it (not the check itself)")
    measured.add_argument("--measure", choices=["engine", "quantized"], default=None,
                          help="measure this and write --json instead of running the check")
    measured.add_argument("--device", default="cuda", help="where to measure (default: %(default)s)")
    measured.add_argument("--json", type=Path, default=None, help="the measurement's file (needed with --measure)")
    measured.add_argument("--tiny", action="store_true", help="a 2-layer model of width 64: the code on a CPU")
    measured.add_argument("--rounds", type=int, default=3, help="timed rounds after a warm-up (default: %(default)s)")
    measured.add_argument("--compiled", nargs="*", default=[], choices=["fp32", "bf16", "int8", "int4"],
                          help="quantized: also time these through generate(compile=True)")
    measured.add_argument("--max-seconds", type=float, default=40.0,
                          help="quantized: no compilation starts after this many seconds (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.measure is not None and args.json is None:
        parser.error("--measure needs --json, the file to write")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    names = [part.name for part in plan()]
    unknown = [name for name in args.parts or [] if name not in names]
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose among {names}")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: a file, not a folder")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.measure is not None:
        return measure(args)
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
