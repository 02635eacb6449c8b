"""The report card: the same benchmarks for any set of models, as one table, a chart and JSON.

Each benchmark ships with the package and runs offline (ch06-alignment/evaluate.py runs them):
bits per byte on the held-out tenth of Moby-Dick, spam accuracy and F1 (a model with a
classification head), exact match per instruction family and ROUGE-L of the free answers on
the instruction test split, and accuracy on two multiple-choice sets (instruction answers, and
the Moby-Dick cloze: which sentence comes next). A score is {"value", "interval", "n"}; a
benchmark that does not apply to a model (spam for a language model, text for a classifier) is
None, shown as "-". Accuracies carry a 95% Wilson interval. ``score_model`` scores one model
file on ``load_benchmarks``'s data, and says how its weights are held (``weights_summary``: float32,
or int8 / int4 from llmscratch.model.quantize, and their megabytes); ``write_report`` writes the results down.
"""

import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from llmscratch.alignment.metrics import check_choice_items, mean_rouge_l, multiple_choice_accuracy, wilson_interval
from llmscratch.assets import read_instructions
from llmscratch.files import write_json_atomically, write_text_atomically
from llmscratch.finetuning.classify import Classifier, evaluate_classifier, make_batches, spam_splits
from llmscratch.finetuning.config import FinetuneConfig
from llmscratch.finetuning.instruct import MAX_NEW_TOKENS, evaluate_responses, read_json_records, respond
from llmscratch.model.checkpoint import load_checkpoint
from llmscratch.model.weights import load_model_and_tokenizer
from llmscratch.progress import progress_bar
from llmscratch.text.data import held_out_moby_dick
from llmscratch.training.evaluation import held_out_bits

TEST_MODE_ITEMS = 8  # per benchmark in a smoke test (evaluate.py --test-mode), and 2 windows of held-out text
# The rows of the table: metric key, label. "exact_match/<family>" rows go after "exact_match".
ROWS = [("bits_per_byte", "Moby-Dick bits per byte (held-out tenth; lower is better)"),
        ("uniform_bits_per_byte", "&nbsp;&nbsp;a uniform guess over the model's vocabulary, for scale"),
        ("spam_accuracy", "spam accuracy"), ("spam_f1", "spam F1"),
        ("exact_match", "instruction exact match, all families"),
        ("well_formed", "well-formed answers"), ("rouge_l", "ROUGE-L F1 of the answers"),
        ("choices_accuracy", "instruction multiple choice"),
        ("choices_accuracy_norm", "instruction multiple choice, per character"),
        ("cloze_accuracy", "Moby-Dick cloze"), ("cloze_accuracy_norm", "Moby-Dick cloze, per character"),
        ("cloze_accuracy_context_gain", "Moby-Dick cloze, by the context's gain (PMI)")]
WEIGHTS_ROW = "weights as scored (format; megabytes)"  # the first row, from ``weights_summary``
CHART_LABELS = {"spam_accuracy": "spam\naccuracy", "spam_f1": "spam\nF1", "exact_match": "instruction\nexact match",
                "rouge_l": "instruction\nROUGE-L", "choices_accuracy": "instruction\nmultiple choice",
                "cloze_accuracy": "Moby-Dick\ncloze"}
FOUR_CHOICES = ("choices_accuracy", "cloze_accuracy")  # chance is 25% on these
# Between context and choice: an instruction answer follows "### Response:\n" directly, as in
# finetuning; a sentence follows the one before it after a space.
DELIMITERS = {"choices": "", "cloze": " "}
# The cloze is also ranked by what the context adds (``multiple_choice_accuracy``'s context gain): a
# sentence's own likelihood varies far more than what two sentences before it change.
UNCONDITIONAL = {"cloze": ""}


@dataclass
class Benchmarks:
    """The data every language model is scored on; an empty list (or None) skips that benchmark.

    (A classifier is scored on the test split of its own training run: see ``classifier_scores``.)
    """

    held_out: str | None = None  # the text scored in bits per byte
    max_windows: int | None = None  # of context_length tokens each; None: the whole text
    instructions: list[dict] = field(default_factory=list)  # instruction records (the test split)
    choices: list[dict] = field(default_factory=list)  # {"context", "choices", "answer"} items
    cloze: list[dict] = field(default_factory=list)


def read_choice_items(path: Path) -> list[dict]:
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


def load_benchmarks(choices: list[dict], cloze: list[dict], limit: int | None = None,
                    max_windows: int | None = None) -> Benchmarks:
    """The bundled held-out text and instruction test split, with ``choices`` and ``cloze``: the first ``limit``
    items of each (None: all), and ``max_windows`` windows of the text."""
    tests = [r for r in read_instructions() if r["split"] == "test"]
    if limit is not None:  # every family keeps some: the records are listed family by family
        tests = tests[:: max(1, len(tests) // limit)][:limit]
    cut = slice(None, limit)
    return Benchmarks(held_out=held_out_moby_dick(), max_windows=max_windows, instructions=tests,
                      choices=choices[cut], cloze=cloze[cut])


def accuracy(successes: int, trials: int) -> dict:
    """A proportion as a score, with its 95% Wilson interval."""
    return {"value": successes / trials, "interval": list(wilson_interval(successes, trials)), "n": trials}


def plain(value: float, n: int) -> dict:
    """A score without an interval (bits per byte, F1, ROUGE-L)."""
    return {"value": value, "interval": None, "n": n}


def language_model_scores(model: nn.Module, tokenizer, benchmarks: Benchmarks, device: torch.device,
                          progress: bool = False, batch_size: int = 16) -> dict[str, dict | None]:
    """Every benchmark of a language model (the spam scores are None: it has no classification head)."""
    scores: dict[str, dict | None] = {"spam_accuracy": None, "spam_f1": None}
    if benchmarks.held_out:
        with benchmark("held-out Moby-Dick (bits per byte)"):
            scores.update(held_out_scores(model, tokenizer, benchmarks.held_out, device, batch_size,
                                          benchmarks.max_windows))
    if benchmarks.instructions:
        with benchmark("instruction answers"):
            scores.update(instruction_scores(model, tokenizer, benchmarks.instructions, progress))
    for name in ("choices", "cloze"):
        items = getattr(benchmarks, name)
        if items:
            with benchmark(f"{name} (multiple choice)"):
                scores.update(choice_scores(model, tokenizer, items, name, progress))
    return scores


def held_out_scores(model: nn.Module, tokenizer, text: str, device: torch.device, batch_size: int = 16,
                    max_windows: int | None = None) -> dict[str, dict]:
    """``held_out_bits`` as ``plain`` scores: "bits_per_byte", "uniform_bits_per_byte"."""
    bits = held_out_bits(model, tokenizer, text, device, batch_size, max_windows)
    return {name: plain(bits[name], bits["predicted"]) for name in ("bits_per_byte", "uniform_bits_per_byte")}


@contextlib.contextmanager
def benchmark(name: str) -> Iterator[None]:
    """A ValueError inside (a prompt too long for the model, say) names the benchmark it came from."""
    try:
        yield
    except ValueError as err:
        raise ValueError(f"the {name} benchmark: {err}") from None


def choice_scores(model: nn.Module, tokenizer, items: Sequence[dict], name: str, progress: bool = False,
                  chunk: int = 16) -> dict[str, dict]:
    """``multiple_choice_accuracy`` of ``items`` as {name}_accuracy and {name}_accuracy_norm scores (name: a
    key of DELIMITERS).

    The items go in chunks, so that a progress bar can count them; the hits of the chunks add up.
    """
    hits = {"accuracy": 0, "accuracy_norm": 0, **({"accuracy_context_gain": 0} if name in UNCONDITIONAL else {})}
    with progress_bar(progress, len(items), name, "item") as bar:
        for start in range(0, len(items), chunk):
            result = multiple_choice_accuracy(model, tokenizer, items[start : start + chunk], DELIMITERS[name],
                                              unconditional_context=UNCONDITIONAL.get(name))
            for key in hits:
                hits[key] += round(result[key] * result["n"])
            if bar is not None:
                bar.update(result["n"])
    return {f"{name}_{key}": accuracy(k, len(items)) for key, k in hits.items()}


def instruction_scores(model: nn.Module, tokenizer, records: Sequence[dict], progress: bool = False) -> dict:
    """Exact match (all, and per family), well-formed share and mean ROUGE-L of greedy answers to ``records``."""
    responses = respond(model, tokenizer, records, MAX_NEW_TOKENS, progress=progress)
    result = evaluate_responses(records, responses)
    n = len(records)
    scores = {"exact_match": accuracy(round(result["exact_match"] * n), n),
              "well_formed": accuracy(round(result["well_formed"] * n), n),
              "rouge_l": plain(mean_rouge_l([r.text for r in responses], [r["output"] for r in records]), n)}
    for family, share in result["by_family"].items():
        size = sum(r.get("family", "all") == family for r in records)
        scores[f"exact_match/{family}"] = accuracy(round(share * size), size)
    return scores


def classifier_scores(classifier: Classifier, messages: Sequence[tuple[str, int]],
                      batch_size: int = 16) -> dict[str, dict | None]:
    """Spam accuracy and F1 of a classifier on (message, label) pairs; the language-model scores are None."""
    pad_id, tokenizer = classifier.pad_id, classifier.tokenizer
    encoded = [(tokenizer.encode(text, disallowed_special=()) or [pad_id], label) for text, label in messages]
    result = evaluate_classifier(classifier.model, make_batches(encoded, batch_size, pad_id, classifier.max_length))
    n = len(messages)
    scores: dict[str, dict | None] = {key: None for key, _ in ROWS}
    scores.update(spam_accuracy=accuracy(round(result["accuracy"] * n), n), spam_f1=plain(result["f1"], n))
    return scores


def spam_test_split(path: Path, limit: int | None) -> list[tuple[str, int]]:
    """The test messages of the classifier ``path``'s own run: split with the seed its metrics.json records."""
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


def weights_summary(model: nn.Module) -> dict:
    """{"format", "megabytes"} of a model as it is scored: its quantization (``llmscratch.model.quantize``) or its
    parameters' dtype, and the bytes of its state (a tensor under two names, a tied head, counted once)."""
    settings = getattr(model, "quantization", None)
    if settings is None:
        form = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}))
    else:  # the head is int8 under either scheme, unless it was kept in floating point
        form = settings["scheme"] + (f", group {settings['group_size']}" if settings["group_size"] else "")
        if settings["scheme"] != "int8" or not settings["head"]:
            form += ", int8 head" if settings["head"] else ", float head"
    tensors = {(t.data_ptr(), t.numel() * t.element_size()): t for t in model.state_dict().values()}
    return {"format": form, "megabytes": sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6}


def score_model(path: Path, benchmarks: Benchmarks, device: torch.device, limit: int | None = None,
                progress: bool = False) -> dict:
    """{"source", "kind", "weights", "scores", "seconds"} of the model in ``path``: a language model on
    ``benchmarks``, or a spam classifier (a classifier.pt) on the first ``limit`` messages of its test split."""
    start = time.perf_counter()
    if path.suffix == ".pt" and "labels" in load_checkpoint(path):  # a classifier: spam only
        classifier = Classifier.load(path, device)
        model, kind = classifier.model, "spam classifier"
        scores = classifier_scores(classifier, spam_test_split(path, limit))
    else:
        model, tokenizer = load_model_and_tokenizer(path, map_location=device)
        kind, scores = "language model", language_model_scores(model, tokenizer, benchmarks, device, progress)
    return {"source": str(path), "kind": kind, "weights": weights_summary(model), "scores": scores,
            "seconds": time.perf_counter() - start}


# --------------------------------------------------------------------------- writing it down
def row_keys(results: dict[str, dict]) -> list[tuple[str, str]]:
    """(key, label) of each row the results fill for at least one model, per-family rows after "exact_match"."""
    families = sorted({key for scores in results.values() for key in scores["scores"]
                       if key.startswith("exact_match/")})
    rows = []
    for key, label in ROWS:
        rows.append((key, label))
        if key == "exact_match":
            rows += [(family, f"&nbsp;&nbsp;{family.split('/', 1)[1]}") for family in families]
    return [(key, label) for key, label in rows
            if any(scores["scores"].get(key) is not None for scores in results.values())]


def format_score(key: str, score: dict | None) -> str:
    """A table cell: "-" for no score, bits per byte as a number, shares in percent with their interval."""
    if score is None:
        return "-"
    if key in ("bits_per_byte", "uniform_bits_per_byte"):
        return f"{score['value']:.3f}"
    if score["interval"] is None:
        return f"{score['value']:.1%}" if key == "spam_f1" else f"{score['value']:.3f}"
    low, high = score["interval"]
    return f"{score['value']:.1%} [{low:.1%}, {high:.1%}]"


def format_weights(weights: dict | None) -> str:
    """A table cell of ``weights_summary``: "int4, group 64, int8 head; 7.9 MB", or "-"."""
    return "-" if weights is None else f"{weights['format']}; {weights['megabytes']:.1f} MB"


def markdown_table(results: dict[str, dict]) -> str:
    """One column per model, one row per metric; results maps a model's name to {"scores": {...}, ...}, and
    optionally "weights" (``weights_summary``: then a first row says how each model's weights are held)."""
    names = list(results)
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    if any("weights" in results[n] for n in names):
        lines.append(f"| {WEIGHTS_ROW} | " + " | ".join(format_weights(results[n].get("weights")) for n in names)
                     + " |")
    for key, label in row_keys(results):
        lines.append(f"| {label} | " + " | ".join(format_score(key, results[n]["scores"].get(key)) for n in names)
                     + " |")
    return "\n".join(lines)


def plot_report(results: dict[str, dict], path: str | os.PathLike) -> None:
    """A grouped bar chart: the 0-1 scores, one group per metric and one bar per model (with its 95% interval),
    beside bits per byte."""
    from matplotlib.figure import Figure  # no pyplot: no global backend

    names = list(results)
    keys = [k for k in CHART_LABELS if any(results[n]["scores"].get(k) is not None for n in names)]
    fig = Figure(figsize=(12, 4.5))
    bars_ax, bpb_ax = fig.subplots(1, 2, width_ratios=[4, 1])
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        scores = [results[name]["scores"].get(k) for k in keys]
        x = [j + (i - (len(names) - 1) / 2) * width for j in range(len(keys))]
        values = [s["value"] if s else 0.0 for s in scores]
        errors = [[s["value"] - s["interval"][0] if s and s["interval"] else 0.0 for s in scores],
                  [s["interval"][1] - s["value"] if s and s["interval"] else 0.0 for s in scores]]
        bars_ax.bar(x, values, width, yerr=errors, capsize=2, label=name, color=f"C{i}")
        bpb = results[name]["scores"].get("bits_per_byte")
        if bpb is not None:
            bpb_ax.bar([i], [bpb["value"]], color=f"C{i}")
        uniform = results[name]["scores"].get("uniform_bits_per_byte")
        if uniform is not None:
            bpb_ax.hlines(uniform["value"], i - 0.4, i + 0.4, color="grey", linestyle="--", linewidth=1,
                          label="uniform guess" if i == 0 else None)
    chance = [j for j, key in enumerate(keys) if key in FOUR_CHOICES]
    for j in chance:
        bars_ax.hlines(0.25, j - 0.45, j + 0.45, color="grey", linestyle="--", linewidth=1,
                       label="chance (4 choices)" if j == chance[0] else None)
    bars_ax.set_xticks(range(len(keys)), [CHART_LABELS[k] for k in keys], fontsize=8)
    bars_ax.set(ylim=(0, 1.05), ylabel="score", title="report card (bars: 95% intervals)")
    bars_ax.legend(fontsize=8)
    bpb_ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
    bpb_ax.set(ylabel="bits per byte", title="held-out Moby-Dick\n(lower is better)")
    if bpb_ax.get_legend_handles_labels()[0]:
        bpb_ax.legend(fontsize=8)
    for ax in (bars_ax, bpb_ax):
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(results: dict[str, dict], out_dir: str | os.PathLike, summary: dict | None = None) -> str:
    """report.md, report.png and report.json in ``out_dir``; returns the Markdown table."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = markdown_table(results)
    sources = "\n".join(f"- **{name}**: {result['source']} ({result['kind']})" for name, result in results.items())
    write_text_atomically(out_dir / "report.md", f"# Report card\n\n{table}\n\nModels:\n{sources}\n\n"
                          "Shares in percent with their 95% Wilson interval; \"-\": the benchmark does not apply to "
                          "the model.\n\n![report](report.png)\n")
    plot_report(results, out_dir / "report.png")
    write_json_atomically(out_dir / "report.json", {"models": results, **(summary or {})})
    return table
