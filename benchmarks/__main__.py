"""Run the benchmark suite and rewrite its numbers in benchmarks/RESULTS.md.

    python -m benchmarks                      # every benchmark, then RESULTS.md is updated
    python -m benchmarks train generate       # only these
    python -m benchmarks --dry-run train      # print the sections, leave RESULTS.md alone
    python -m benchmarks --threads 1          # steadier timings on a shared machine
    python -m benchmarks gpu [--dry-run]      # the prepared device check (benchmarks/gpu.py; --help there)

Each benchmark prints a Markdown section on stdout (progress bars go to stderr). In RESULTS.md a
benchmark's generated section sits between ``<!-- benchmark:NAME -->`` and
``<!-- /benchmark:NAME -->``; only that part is replaced, so the analysis written around it stays.
A benchmark without markers yet gets them, with its section, at the end of the file.
"""

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import today
from llmscratch.files import write_text_atomically

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
BENCHMARKS = {  # name: the command, run from the repository root
    "tokenizer": ["-m", "benchmarks.bench_tokenizer"],  # one thread by design: no --threads
    "attention": ["ch02-attention/attention_bench.py"],
    "generate": ["-m", "benchmarks.bench_generate"],
    "train": ["-m", "benchmarks.bench_train"],
    "parallel_memory": ["-m", "benchmarks.bench_parallel_memory"],  # 4 gloo processes, one thread each
    "load_checks": ["-m", "benchmarks.bench_load_checks"],
    "qkv": ["-m", "benchmarks.bench_qkv"],
    "quantize": ["-m", "benchmarks.bench_quantize"],
    "distill": ["-m", "benchmarks.bench_distill"],  # 3 seeds x 3 students: about 13 minutes on 2 idle cores
    "speculative": ["-m", "benchmarks.bench_speculative"],
    "prune": ["-m", "benchmarks.bench_prune"],
    "serve": ["-m", "benchmarks.bench_serve"],  # a server subprocess and its clients: 3.6 minutes on 2 idle cores, about 6 on busy ones
    "server_abuse": ["-m", "benchmarks.bench_server_abuse"],  # 200 half-sent connections, 200 MB bodies, a hostile template: 30 s
    "moe": ["-m", "benchmarks.bench_moe"],  # decoding an MoE against the dense main job: about a minute
    "llama_cpp": ["-m", "benchmarks.bench_llama_cpp"],  # needs llama-cpp-python (not a requirement): about 2 minutes
    "paged": ["-m", "benchmarks.bench_paged"],  # issue 52: a 2.4 GB Qwen3-0.6B folder served, and more: 20 minutes
}


def run(name: str, threads: int | None) -> str:
    """The benchmark's stdout; stderr (progress) passes through. Exits on failure."""
    arguments = list(BENCHMARKS[name])
    if threads is not None and name != "tokenizer":
        arguments += ["--threads", str(threads)]
    command = [sys.executable, *arguments]
    shown = " ".join(["python", *arguments])
    print(f"== {name}: {shown}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        sys.exit(f"error: benchmark {name!r} failed (exit status {done.returncode}); RESULTS.md left as it was")
    print(f"== {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    output = done.stdout.strip()
    if not output.startswith("#"):  # a script that prints no heading of its own
        output = f"Command: `{shown}`, run by `python -m benchmarks` on {today()}\n\n{output}"
    return output


def replace_section(text: str, name: str, section: str) -> str:
    """text with the generated section of ``name`` replaced (or appended with its markers)."""
    begin, end = f"<!-- benchmark:{name} -->", f"<!-- /benchmark:{name} -->"
    block = f"{begin}\n{section}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text, count=1)
    return f"{text.rstrip()}\n\n{block}\n"


def main() -> None:
    if sys.argv[1:2] == ["gpu"]:  # the device check: its own flags and report (benchmarks/gpu.py)
        from benchmarks.gpu import main as gpu_check

        sys.exit(gpu_check(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"benchmarks to run, among {', '.join(BENCHMARKS)} (default: all)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for the benchmarks that take --threads (default: torch's own choice; "
                             "1 steadies timings on a machine shared with other work)")
    parser.add_argument("--dry-run", action="store_true", help="print the sections instead of writing RESULTS.md")
    args = parser.parse_args()
    unknown = [name for name in args.names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose among {list(BENCHMARKS)}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be a positive integer, got {args.threads}")
    sections = {name: run(name, args.threads) for name in args.names or BENCHMARKS}
    if args.dry_run:
        print("\n\n".join(sections.values()))
        return
    text = RESULTS.read_text(encoding="utf-8")
    for name, section in sections.items():
        text = replace_section(text, name, section)
    write_text_atomically(RESULTS, text)
    print(f"updated {RESULTS.relative_to(ROOT)}: {', '.join(sections)}", file=sys.stderr)


if __name__ == "__main__":
    main()
