"""The report card: score any set of models on the chapter's offline benchmarks, side by side.

    python ch06-alignment/evaluate.py                                  # the bundled base model
    python ch06-alignment/evaluate.py --model base --model instructions --model dpo --model classifier
    python ch06-alignment/evaluate.py --model runs/pretrain --model mine=path/to/model.safetensors
    python ch06-alignment/evaluate.py --model instructions \
        --model instructions-int4=runs/quantized/instructions-int4.safetensors

Each --model is a name (base, instructions, dpo, dpo-style, rl, classifier: the default place of each), a run
folder or a model file (a quantized one of ch07-deployment/quantize.py too), optionally as
LABEL=PATH to name its column. The first row says how each model's weights are held as it is
scored (float32, int8, int4 and its group size) and their megabytes. Language models get bits
per byte on the held-out tenth of Moby-Dick, exact match per instruction family, the share of
well-formed answers and the ROUGE-L of the answers on the instruction test split, and accuracy
on the instruction multiple-choice set and the Moby-Dick cloze (llmscratch.alignment.report). A spam
classifier (a classifier.pt of ch05-finetuning/finetune_classifier.py) gets accuracy and F1 on
its test split. A benchmark that does not apply shows "-". The run folder (--out-dir) gets
report.md (the table), report.png (a chart) and report.json (every number, with timings).
"""

import argparse
import shlex
import sys
import time
from pathlib import Path

from llmscratch.alignment.report import (TEST_MODE_ITEMS, Benchmarks, load_benchmarks, markdown_table,
                                         read_choice_items, score_model, write_report)
from llmscratch.assets import INSTRUCTION_CHOICES_PATH, MOBY_CLOZE_PATH
from llmscratch.cli import check_device, resolve_model, run_folder, value_errors_exit
from llmscratch.files import input_problem
from llmscratch.runfolder import folder_problem, save_or_rescue


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", metavar="[LABEL=]MODEL",
                        help="a model to score (repeat for several): base, instructions, dpo, dpo-style, rl, "
                             "classifier, a run folder or a model file (.safetensors, checkpoint .pt, classifier.pt); "
                             "default: base")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/report"),
                        help="where report.md, report.png and report.json go, replacing an earlier report there "
                             "(default: runs/report)")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="score only the first N items of each benchmark (N windows of held-out text), "
                             "for a quick look (default: all)")
    parser.add_argument("--test-mode", action="store_true",
                        help=f"a smoke test in seconds: {TEST_MODE_ITEMS} items per benchmark, 2 windows of text")
    parser.add_argument("--choices", type=Path, default=INSTRUCTION_CHOICES_PATH,
                        help="the instruction multiple-choice set, a JSON list of {context, choices, answer} "
                             "(default: the bundled one; skipped with a note if it is not there)")
    parser.add_argument("--cloze", type=Path, default=MOBY_CLOZE_PATH,
                        help="the Moby-Dick cloze set (default: the bundled one, ch06-alignment/make_cloze_data.py)")
    parser.add_argument("--device", default="cpu", help="where to run the models: cpu, cuda, mps (default: cpu)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be at least 1, got {args.limit}")
    for flag, name in (("--choices", "choices"), ("--cloze", "cloze")):
        path = getattr(args, name)
        if path not in (INSTRUCTION_CHOICES_PATH, MOBY_CLOZE_PATH) and (problem := input_problem(path)):
            parser.error(f"{flag} {path}: {problem}")
        try:  # read and checked now: not found wrong after minutes of scoring
            setattr(args, name, read_choice_items(path))
        except ValueError as err:
            parser.error(f"{flag} {err}")
    try:
        args.models = [resolve_model(spec) for spec in args.model or ["base"]]
    except ValueError as err:
        parser.error(str(err))
    labels = [label for label, _ in args.models]
    if len(set(labels)) < len(labels):
        parser.error(f"two --model columns share a name ({', '.join(labels)}); name them with LABEL=PATH")
    if problem := folder_problem(args.out_dir):
        parser.error(f"--out-dir {args.out_dir}: {problem}")
    check_device(parser, args)
    args.items = TEST_MODE_ITEMS if args.test_mode else args.limit  # per benchmark
    args.windows = 2 if args.test_mode else args.limit  # of held-out text
    return args


def score(label: str, path: Path, benchmarks: Benchmarks, args: argparse.Namespace) -> dict:
    """score_model of one --model, its errors naming the flag; prints what it was and how long it took."""
    try:
        result = score_model(path, benchmarks, args.device, args.items, progress=not args.no_progress)
    except ValueError as err:
        raise ValueError(f"--model {label} ({path}): {err}") from None
    print(f"{label}: {result['kind']} from {path}, scored in {result['seconds']:.0f} s")
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    # A model file that does not load, a malformed benchmark, a report that cannot be written: a message.
    with value_errors_exit(), run_folder(args, outputs=()):
        benchmarks = load_benchmarks(args.choices, args.cloze, args.items, args.windows)
        results = {label: score(label, path, benchmarks, args) for label, path in args.models}
        summary = {"benchmarks": {"held_out_characters": len(benchmarks.held_out or ""),
                                  "max_windows": benchmarks.max_windows,
                                  "instruction_tests": len(benchmarks.instructions),
                                  "choices": len(benchmarks.choices), "cloze": len(benchmarks.cloze)},
                   "seconds": time.perf_counter() - start,
                   "command": shlex.join(["python", "ch06-alignment/evaluate.py",
                                          *(sys.argv[1:] if argv is None else argv)])}
        print(markdown_table(results))
        save_or_rescue(args.out_dir, lambda folder: write_report(results, folder, summary), "the report")
    print(f"{summary['seconds']:.0f} s in all; saved {args.out_dir}/: report.md, report.png, report.json")


if __name__ == "__main__":
    main()
