"""Scores of a model's answers: ROUGE-L and BLEU of generated text, and multiple choice.

Generated text is scored against references by ROUGE-L and BLEU (written here, tested against
rouge-score and sacrebleu; exact match, the instruction tasks' own score, is
``llmscratch.finetuning.instruct.exact_match``); multiple-choice questions by the log-likelihood of
each choice, as lm-evaluation-harness does, with a Wilson interval on the accuracy. The loss,
perplexity and bits per byte of a language model are in ``llmscratch.training.evaluation``.
"""

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from llmscratch.model.gpt import evaluating


# --------------------------------------------------------------------------- ROUGE-L
def rouge_tokens(text: str) -> list[str]:
    """Lower-case runs of a-z and 0-9; everything else separates words (rouge-score's default tokenizer)."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def longest_common_subsequence(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence of ``a`` and ``b``, by dynamic programming one row at a time."""
    previous = [0] * (len(b) + 1)  # previous[j]: the LCS of the items of a so far and b[:j]
    for item in a:
        current = [0]
        for j, other in enumerate(b):
            current.append(previous[j] + 1 if item == other else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-L: precision, recall and F1 of the longest common subsequence of words (all 0 if a text has none)."""
    predicted, wanted = rouge_tokens(prediction), rouge_tokens(reference)
    common = longest_common_subsequence(predicted, wanted) if predicted and wanted else 0
    if common == 0:
        return {"precision": 0.0, "recall": 0.0, "f": 0.0}
    precision, recall = common / len(predicted), common / len(wanted)
    return {"precision": precision, "recall": recall, "f": 2 * precision * recall / (precision + recall)}


def mean_rouge_l(predictions: Sequence[str], references: Sequence[str]) -> float:
    """The mean ROUGE-L F1 over pairs of prediction and reference."""
    _check_pairs(predictions, references)
    return sum(rouge_l(p, r)["f"] for p, r in zip(predictions, references)) / len(predictions)


def _check_pairs(predictions: Sequence[str], references: Sequence[str]) -> None:
    if len(predictions) != len(references) or not predictions:
        raise ValueError(f"need one reference per prediction, and at least one; got {len(references)} references "
                         f"for {len(predictions)} predictions")


# --------------------------------------------------------------------------- BLEU
# mteval-v13a's tokenizer (WMT's, and sacrebleu's default "13a"): split off every ASCII symbol but
# - ' . and , ; then a period or comma unless it sits between digits ("3.5", "1,000" stay whole);
# then a dash after a digit ("5-year" -> "5 - year", while "well-known" stays).
_13A_RULES = [
    (re.compile(r"([!\"#$%&()*+/:;<=>?@\[\\\]^_`{|}~])"), r" \1 "),
    (re.compile(r"([^0-9])([.,])"), r"\1 \2 "),
    (re.compile(r"([.,])([^0-9])"), r" \1 \2"),
    (re.compile(r"([0-9])(-)"), r"\1 \2 "),
]
_13A_ENTITIES = [("&quot;", '"'), ("&amp;", "&"), ("&lt;", "<"), ("&gt;", ">")]  # in this order


def tokenize_13a(line: str) -> str:
    """``line`` tokenized as mteval-v13a does, tokens separated by single spaces."""
    line = line.replace("<skipped>", "").replace("-\n", "").replace("\n", " ")  # rejoin words hyphenated at line ends
    for entity, char in _13A_ENTITIES:
        line = line.replace(entity, char)
    line = f" {line} "
    for pattern, replacement in _13A_RULES:
        line = pattern.sub(replacement, line)
    return " ".join(line.split())


def _ngram_counts(tokens: list[str], max_order: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for n in range(1, max_order + 1) for i in range(len(tokens) - n + 1))


def bleu(predictions: Sequence[str], references: Sequence[str], max_order: int = 4,
         smooth: str = "exp") -> float:
    """Corpus BLEU on the 0-100 scale, one reference per prediction, both tokenized by ``tokenize_13a``.

    Clipped n-gram matches and n-gram counts are summed over the corpus for n = 1..max_order; BLEU is
    the geometric mean of the n-gram precisions times the brevity penalty exp(1 - reference words /
    predicted words), or 1 when the predictions are as long as the references. smooth="exp" (mteval's
    and sacrebleu's default) counts the k-th order without a match as 1 / 2^k matches; "none" scores 0.
    Equals ``sacrebleu.corpus_bleu(predictions, [references]).score``.
    """
    _check_pairs(predictions, references)
    if smooth not in ("exp", "none") or max_order < 1:
        raise ValueError(f"expected smooth 'exp' or 'none' and max_order >= 1, got {smooth!r} and {max_order}")
    matches, totals = [0] * max_order, [0] * max_order
    predicted_words = reference_words = 0
    for prediction, reference in zip(predictions, references):
        predicted = tokenize_13a(prediction.rstrip()).split()  # sacrebleu strips trailing whitespace first
        wanted = tokenize_13a(reference.rstrip()).split()
        predicted_words, reference_words = predicted_words + len(predicted), reference_words + len(wanted)
        wanted_counts = _ngram_counts(wanted, max_order)
        for ngram, count in _ngram_counts(predicted, max_order).items():
            totals[len(ngram) - 1] += count
            # Clipped: an n-gram matches at most as often as the reference has it.
            matches[len(ngram) - 1] += min(count, wanted_counts[ngram])
    return _bleu_from_counts(matches, totals, predicted_words, reference_words, smooth)


def _bleu_from_counts(matches: list[int], totals: list[int], predicted_words: int, reference_words: int,
                      smooth: str) -> float:
    if not any(matches) or 0 in totals:  # nothing matched, or an order has no n-grams: the geometric mean is 0
        return 0.0
    log_precisions, smoothing = [], 1.0
    for matched, total in zip(matches, totals):
        if matched == 0:
            if smooth == "none":
                return 0.0
            smoothing *= 2
            matched = 1 / smoothing
        log_precisions.append(math.log(matched / total))
    brevity = 1.0 if predicted_words >= reference_words else math.exp(1 - reference_words / predicted_words)
    return 100 * brevity * math.exp(sum(log_precisions) / len(log_precisions))


# --------------------------------------------------------------------------- multiple choice
@dataclass(frozen=True)
class ChoiceScores:
    """Each choice's log-likelihood given the context (nats), summed and per character, and the best of each."""

    logprobs: list[float]  # sum over the choice's tokens of log p(token | context and the tokens before it)
    per_char: list[float]  # logprobs / len(choice): lm-evaluation-harness's acc_norm ranking
    n_tokens: list[int]
    best: int
    best_per_char: int


def encode_choices(tokenizer, context: str, choices: Sequence[str],
                   delimiter: str = " ") -> tuple[list[int], list[list[int]]]:
    """The context's ids, and each continuation's (delimiter + choice) ids, encoded apart.

    As in lm-evaluation-harness, whitespace at the end of the context moves to the front of each
    continuation: "Answer: " + "Paris" is scored as "Answer:" + " Paris", the way a BPE tokenizer
    splits running text. Encoding the continuation on its own gives the ids of the whole text
    whenever the tokenizer's pre-split starts a chunk there (GPT-2's does before " word"). An empty
    context becomes the tokenizer's end-of-text token, so the first choice token has a prediction.
    """
    stripped = context.rstrip()
    moved = context[len(stripped):]
    context_ids = list(tokenizer.encode(stripped)) if stripped else []
    if not context_ids:
        if getattr(tokenizer, "eot_token", None) is None:
            raise ValueError("an empty context needs a tokenizer with an end-of-text token (eot_token) to start from")
        context_ids = [tokenizer.eot_token]
    return context_ids, [list(tokenizer.encode(moved + delimiter + choice)) for choice in choices]


@torch.inference_mode()
def score_choices(model: nn.Module, tokenizer, context: str, choices: Sequence[str], delimiter: str = " ",
                  context_length: int | None = None) -> ChoiceScores:
    """Log-likelihood of each choice after ``context`` (``encode_choices``), all choices in one padded batch.

    ``model`` maps ids (B, T) to logits (B, T, V), as ``GPT`` does. A sequence longer than
    ``context_length`` (default: the model's ``config.context_length``, else no limit) loses context
    tokens from the left, as in the harness. per_char divides by the choice's length in characters,
    the delimiter not counted: the harness's acc_norm, which does not depend on the tokenizer.
    """
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"expected a list of non-empty strings as choices, got {choices!r}")
    if context_length is None:
        context_length = getattr(getattr(model, "config", None), "context_length", None)
    context_ids, continuations = encode_choices(tokenizer, context, choices, delimiter)
    rows = [_choice_row(context_ids, ids, context_length, choice) for ids, choice in zip(continuations, choices)]
    device = next(model.parameters()).device
    inputs = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)  # (C, T) padded on the right with id 0
    for i, row in enumerate(rows):
        inputs[i, : len(row)] = torch.tensor(row)
    with evaluating(model):
        logits = model(inputs.to(device))  # (C, T, V): the causal mask keeps the padding out of the real positions
    logprobs = []
    for i, (row, ids) in enumerate(zip(rows, continuations)):
        # The logits at position t predict the token at t + 1: the choice's n ids are read at the last n positions.
        logp = torch.log_softmax(logits[i, len(row) - len(ids) : len(row)].double(), dim=-1)  # (n, V)
        logprobs.append(logp[torch.arange(len(ids)), torch.tensor(ids, device=logp.device)].sum().item())
    per_char = [score / len(choice) for score, choice in zip(logprobs, choices)]
    return ChoiceScores(logprobs, per_char, [len(ids) for ids in continuations],
                        best=max(range(len(choices)), key=logprobs.__getitem__),
                        best_per_char=max(range(len(choices)), key=per_char.__getitem__))


def _choice_row(context_ids: list[int], choice_ids: list[int], context_length: int | None, choice: str) -> list[int]:
    """The ids fed to the model for one choice: context + choice, cut to fit, without the last id (only predicted)."""
    if not choice_ids or (context_length is not None and len(choice_ids) > context_length):
        shown = repr(choice) if len(choice) <= 60 else repr(choice[:57]) + "..."
        raise ValueError(f"choice {shown} is {len(choice_ids)} tokens; expected 1 to context_length="
                         f"{context_length}")
    whole = context_ids + choice_ids
    if context_length is not None:
        whole = whole[-(context_length + 1):]  # keep the choice and the context nearest to it
    return whole[:-1]


def multiple_choice_accuracy(model: nn.Module, tokenizer, items: Sequence[dict], delimiter: str = " ",
                             z: float = 1.96, unconditional_context: str | None = None) -> dict:
    """Accuracy of the top choice by summed and by per-character log-likelihood, each with a Wilson interval.

    ``items`` are ``{"context": str, "choices": [str, ...], "answer": index of the right choice}``.
    ``unconditional_context`` (e.g. "" or a bare answer header): also rank the choices by how much the
    item's context raises their log-likelihood over this context, log p(choice | context) - log
    p(choice | unconditional), as "accuracy_context_gain" (pointwise mutual information, the ranking GPT-3
    used on some benchmarks): a choice that is likely text in any context gains no credit for it.
    """
    if not items:
        raise ValueError("multiple_choice_accuracy needs at least one item")
    check_choice_items(items)  # all of them before the first forward pass
    hits = {"accuracy": 0, "accuracy_norm": 0}
    if unconditional_context is not None:
        hits["accuracy_context_gain"] = 0
    for item in items:
        scores = score_choices(model, tokenizer, item["context"], item["choices"], delimiter)
        hits["accuracy"] += scores.best == item["answer"]
        hits["accuracy_norm"] += scores.best_per_char == item["answer"]
        if unconditional_context is not None:
            alone = score_choices(model, tokenizer, unconditional_context, item["choices"], delimiter)
            gains = [given - without for given, without in zip(scores.logprobs, alone.logprobs)]
            hits["accuracy_context_gain"] += max(range(len(gains)), key=gains.__getitem__) == item["answer"]
    n = len(items)
    return {"n": n, **{name: k / n for name, k in hits.items()},
            **{f"{name}_interval": wilson_interval(k, n, z) for name, k in hits.items()}}


def check_choice_items(items: Sequence[dict]) -> None:
    """ValueError naming the first item that is not {"context": str, "choices": [str, ...], "answer": index},
    and what is wrong with it."""
    for index, item in enumerate(items):
        if problem := _choice_item_problem(item):
            raise ValueError(f"item {index}: {problem}; expected {{'context': str, 'choices': [distinct non-empty "
                             f"str, ...], 'answer': an index into the choices}}")


def _choice_item_problem(item) -> str | None:
    if not isinstance(item, dict):
        return f"{_short(item)} is not an object"
    context, choices, answer = item.get("context"), item.get("choices"), item.get("answer")
    if not isinstance(context, str):
        return "no 'context'" if "context" not in item else f"'context' is a {type(context).__name__}, not a string"
    if not isinstance(choices, (list, tuple)) or not choices:
        return "no 'choices'" if "choices" not in item else f"'choices' is {_short(choices)}, not a list of strings"
    if len(choices) < 2:
        return f"'choices' is {_short(choices)}: one choice, nothing to choose between"
    for choice in choices:
        if not isinstance(choice, str) or not choice:
            return f"choice {_short(choice)} is not a non-empty string"
    if len(set(choices)) < len(choices):
        return f"'choices' repeat one ({_short(next(c for c in choices if choices.count(c) > 1))}): a tie, not a test"
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        return (f"'answer' {_short(answer)} is not an index into its {len(choices)} choices (0 to {len(choices) - 1})"
                if "answer" in item else "no 'answer'")
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a proportion (z = 1.96: 95%); unlike p +- z sqrt(p(1 - p) / n), it stays
    inside [0, 1] and is not empty at 0 or n successes."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"expected 0 <= successes <= trials and trials >= 1, got {successes} of {trials}")
    p, z2 = successes / trials, z * z
    center = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / (1 + z2 / trials)
    # At 0 (or n) successes the lower (upper) bound is exactly 0 (1); rounding would leave it 1e-17 off.
    return (0.0 if successes == 0 else center - half), (1.0 if successes == trials else center + half)
