"""The report card: score any set of models on the chapter's offline benchmarks, side by side.

    python ch06-alignment/evaluate.py                                  # the bundled base model
    python ch06-alignment/evaluate.py --model base --model instructions --model dpo --model classifier
    python ch06-alignment/evaluate.py --model runs/pretrain --model mine=path/to/model.safetensors

Each --model is a name (base, instructions, dpo, classifier: the default place of each), a run
folder or a model file, optionally as LABEL=PATH to name its column. Language models get bits
per byte on the held-out tenth of Moby-Dick, exact match per instruction family, the share of
well-formed answers and the ROUGE-L of the answers on the instruction test split, and accuracy
on the instruction multiple-choice set and the Moby-Dick cloze (llmscratch.report). A spam
classifier (a classifier.pt of ch05-finetuning/finetune_classifier.py) gets accuracy and F1 on
its test split. A benchmark that does not apply shows "-". The run folder (--out-dir) gets
report.md (the table), report.png (a chart) and report.json (every number, with timings).
"""

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from llmscratch.assets import (
    INSTRUCTION_CHOICES_PATH,
    MOBY_CLOZE_PATH,
    PRETRAINED_PATH,
    read_instructions,
)
from llmscratch.checkpoint import load_checkpoint
from llmscratch.classify import Classifier, spam_splits
from llmscratch.cli import run_folder, value_errors_exit
from llmscratch.config import FinetuneConfig
from llmscratch.data import input_problem
from llmscratch.device import resolve_device
from llmscratch.evaluation import check_choice_items
from llmscratch.finetune import load_base
from llmscratch.instruct import read_json_records
from llmscratch.report import (
    Benchmarks,
    classifier_scores,
    held_out_moby_dick,
    language_model_scores,
    markdown_table,
    write_report,
)
from llmscratch.runfolder import folder_problem, save_or_rescue

# name -> (default location, the command that makes it)
DEFAULT_MODELS = {
    "base": (PRETRAINED_PATH,
             "python ch04-pretraining/pretrain.py --export-dtype bfloat16 --dtype bfloat16 (bundled with llmscratch)"),
    "instructions": (Path("runs/instructions/model.safetensors"), "python ch05-finetuning/finetune_instructions.py"),
    "dpo": (Path("runs/preferences/model.safetensors"), "python ch06-alignment/finetune_preferences.py"),
    "classifier": (Path("runs/classifier/classifier.pt"), "python ch05-finetuning/finetune_classifier.py"),
}
TEST_MODE_ITEMS = 8  # per benchmark with --test-mode (and 2 windows of held-out text)


def resolve_model(spec: str) -> tuple[str, Path]:
    """(column name, path) of one --model value; ValueError naming it when there is no such model."""
    label, sep, value = spec.partition("=")
    if not sep or Path(spec).exists():  # a path may hold "=" itself
        label, value = "", spec
    if not value:
        raise ValueError(f"--model {spec}: no model after {label!r}= (expected LABEL=PATH, or a path or name alone)")
    if value in DEFAULT_MODELS:
        path, command = DEFAULT_MODELS[value]
        if not path.exists():
            raise ValueError(f"--model {value}: {path} does not exist; make it with: {command}")
        return label or value, path
    path = Path(value)
    if not path.exists():
        raise ValueError(f"--model {value}: no such file or folder (expected a run folder, a model file, or one of "
                         f"{', '.join(DEFAULT_MODELS)})")
    if path.is_dir() and (path / "classifier.pt").is_file():
        path = path / "classifier.pt"
    return label or (path.parent.name if path.is_file() else path.name) or str(path), path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", metavar="[LABEL=]MODEL",
                        help="a model to score (repeat for several): base, instructions, dpo, classifier, a run "
                             "folder or a model file (.safetensors, checkpoint .pt, classifier.pt); default: base")
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
            setattr(args, name, read_items(path))
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
    try:
        args.device = resolve_device(args.device)
    except ValueError as err:
        parser.error(f"--device: {err}")
    return args


def read_items(path: Path) -> list[dict]:
    """The multiple-choice items of a JSON list (checked), or [] (with a note) when the bundled file is not there."""
    if not path.is_file():
        print(f"note: {path} is not there; its benchmark is skipped")
        return []
    items = read_json_records(path)
    try:
        check_choice_items(items)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return items


def benchmarks_for(args: argparse.Namespace) -> Benchmarks:
    """The data of every benchmark, cut to --limit (or the --test-mode size)."""
    limit = TEST_MODE_ITEMS if args.test_mode else args.limit
    tests = [r for r in read_instructions() if r["split"] == "test"]
    if limit is not None:  # every family keeps some: the records are listed family by family
        tests = tests[:: max(1, len(tests) // limit)][:limit]
    cut = slice(None, limit)
    return Benchmarks(held_out=held_out_moby_dick(), max_windows=2 if args.test_mode else args.limit,
                      instructions=tests, choices=args.choices[cut], cloze=args.cloze[cut])


def spam_test_split(path: Path, limit: int | None) -> list[tuple[str, int]]:
    """The test messages of the classifier's own run: split with the seed its metrics.json records."""
    metrics = path.parent / "metrics.json"
    seed = FinetuneConfig().seed
    if not metrics.is_file():
        print(f"note: no metrics.json beside {path}: its test split is drawn with the default seed {seed}, which "
              f"holds out other messages than its own run did if that run had another --seed")
    else:
        try:
            seed = json.loads(metrics.read_text(encoding="utf-8"))["config"]["seed"]
        except (ValueError, TypeError, KeyError) as err:  # not JSON, or not the script's metrics
            raise ValueError(f"{metrics}, beside the classifier, should be the metrics.json its run wrote, with "
                             f"config.seed (the seed of its test split); it is not ({type(err).__name__}: {err})"
                             ) from None
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{metrics}: config.seed should be an integer, got {seed!r}")
    return spam_splits(seed=seed)["test"][:limit]


def score_model(label: str, path: Path, benchmarks: Benchmarks, args: argparse.Namespace) -> dict:
    """{"source", "kind", "scores", "seconds"} of one model."""
    start = time.perf_counter()
    try:
        if path.suffix == ".pt" and "labels" in load_checkpoint(path):  # a classifier: spam only
            classifier = Classifier.load(path, args.device)
            limit = TEST_MODE_ITEMS if args.test_mode else args.limit
            kind, scores = "spam classifier", classifier_scores(classifier, spam_test_split(path, limit))
        else:
            model, tokenizer = load_base(path, args.device)
            kind = "language model"
            scores = language_model_scores(model, tokenizer, benchmarks, args.device, progress=not args.no_progress)
    except ValueError as err:
        raise ValueError(f"--model {label} ({path}): {err}") from None
    seconds = time.perf_counter() - start
    print(f"{label}: {kind} from {path}, scored in {seconds:.0f} s")
    return {"source": str(path), "kind": kind, "scores": scores, "seconds": seconds}


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    # A model file that does not load, a malformed benchmark, a report that cannot be written: a message.
    with value_errors_exit(), run_folder(args, outputs=()):
        benchmarks = benchmarks_for(args)
        results = {label: score_model(label, path, benchmarks, args) for label, path in args.models}
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
