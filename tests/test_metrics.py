"""Text and multiple-choice metrics: exact match, ROUGE-L and BLEU against rouge-score and sacrebleu,
choice log-likelihoods against a direct float64 computation, and the Wilson interval against its quadratic."""

import copy
import math
import random

import pytest
import sacrebleu
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from model_fixtures import randomize
from rouge_score import rouge_scorer
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a
from torch import nn

from llmscratch.alignment.metrics import (bleu, mean_rouge_l, multiple_choice_accuracy, rouge_l, score_choices,
                                          tokenize_13a, wilson_interval)
from llmscratch.finetuning.instruct import exact_match, normalize_answer
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.text.tokenizer import BPETokenizer


# --------------------------------------------------------------------------- exact match
@pytest.mark.parametrize("prediction, reference, same", [
    ("Paris", "paris.", True),
    ("  The   Answer\n", "the answer", True),
    ('"Yes!"', "yes", True),
    ("(b)", "B", True),
    ("“quoted”", "quoted", True),
    ("", "  ...  ", True),
    ("-5", "5", False),  # a sign is not punctuation to strip
    ("50%", "50", False),
    ("u.s.", "us", False),  # inner punctuation stays
    ("a b", "ab", False),
    ("cat", "cats", False),
])
def test_exact_match_normalises_case_whitespace_and_surrounding_punctuation(prediction, reference, same):
    assert exact_match(prediction, reference) is same


def test_normalize_answer_keeps_the_inside_of_the_text():
    assert normalize_answer(' \t"Well-known  U.S. facts," he said. ') == 'well-known u.s. facts," he said'


# --------------------------------------------------------------------------- ROUGE-L
ROUGE = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
WORDS = ["the", "cat", "sat", "on", "a", "mat", "The", "CAT", "mat.", "on,", "42", "x-ray", "naïve", "!", ""]
sentences = st.lists(st.sampled_from(WORDS), max_size=14).map(" ".join)


def assert_rouge_l_matches_rouge_score(prediction: str, reference: str) -> None:
    expected = ROUGE.score(reference, prediction)["rougeL"]  # rouge-score takes the target first
    assert rouge_l(prediction, reference) == {"precision": expected.precision, "recall": expected.recall,
                                              "f": expected.fmeasure}


@settings(max_examples=400, deadline=None)
@given(sentences, sentences)
@example("", "the cat")
@example("the cat", "")
@example("", "")
@example("The CAT sat.", "the cat sat")
@example("!!! ...", "the cat")  # no words at all once tokenized
@example("cat the cat the", "the cat the cat")  # ties between LCS paths
@example("Naïve café, 3.5 x-ray", "naive cafe 3 5 x ray")
def test_rouge_l_matches_rouge_score(prediction, reference):
    assert_rouge_l_matches_rouge_score(prediction, reference)


def test_mean_rouge_l_is_the_mean_f_of_rouge_score():
    generator = random.Random(3)
    pairs = [(" ".join(generator.choices(WORDS, k=9)), " ".join(generator.choices(WORDS, k=7))) for _ in range(20)]
    expected = sum(ROUGE.score(r, p)["rougeL"].fmeasure for p, r in pairs) / len(pairs)
    assert mean_rouge_l([p for p, _ in pairs], [r for _, r in pairs]) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="one reference per prediction"):
        mean_rouge_l(["a"], ["a", "b"])


# --------------------------------------------------------------------------- BLEU
TOKENIZER_13A = Tokenizer13a()
SYMBOLS = "ab9 0.,-'\"&;<>()$%!?:/\\[]{}^_`~|@#*+=\n\té"
raw_text = st.lists(st.one_of(st.sampled_from(SYMBOLS), st.sampled_from(["&quot;", "&amp;", "&lt;", "&gt;",
                                                                         "<skipped>", "-\n", "3.5", "1,000"])),
                    max_size=30).map("".join)


@settings(max_examples=500, deadline=None)
@given(raw_text)
@example('He said: "it\'s 3.5-4.0, (or 1,000) well-known!" -- really?')
@example("5-year plan; A&amp;B &lt;tag&gt; &quot;x&quot; &amp;lt;")
@example("hyphen-\nated line\nbreak <skipped> end.")
@example("U.S.A. costs $5.00, 10% off... ok.")
def test_tokenize_13a_matches_sacrebleu(text):
    assert tokenize_13a(text) == TOKENIZER_13A(text)


BLEU_WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", ".", ",", "3.5", "well-known", "it's"]
corpus_lines = st.lists(st.sampled_from(BLEU_WORDS), max_size=12).map(" ".join)
corpora = st.integers(1, 6).flatmap(lambda n: st.tuples(st.lists(corpus_lines, min_size=n, max_size=n),
                                                        st.lists(corpus_lines, min_size=n, max_size=n)))


def assert_bleu_matches_sacrebleu(predictions, references, **options) -> None:
    settings_ = {"max_ngram_order": options.get("max_order", 4), "smooth_method": options.get("smooth", "exp")}
    expected = sacrebleu.BLEU(**settings_).corpus_score(predictions, [references]).score
    assert bleu(predictions, references, **options) == pytest.approx(expected, rel=1e-9, abs=0.0)


@settings(max_examples=300, deadline=None)
@given(corpora)
def test_bleu_matches_sacrebleu_on_random_corpora(corpus):
    assert_bleu_matches_sacrebleu(*corpus)


@pytest.mark.parametrize("predictions, references", [
    (["the cat sat on the mat"], ["the cat sat on the mat"]),  # perfect: 100
    (["the cat sat on a mat today"], ["the dog sat on the mat"]),  # no 4-gram (nor 3-gram) matches: smoothing
    (["the cat"], ["the cat sat on the mat"]),  # far too short: brevity penalty, and no 3- or 4-grams at all
    (["the cat sat", "on the mat ."], ["the cat sat on", "the mat ."]),
    (["a cat sat on the mat and then on the dog and the mat again"], ["the cat sat on the mat"]),  # too long
    (["", "the cat sat on the mat"], ["the cat", "the cat sat on the mat"]),  # an empty prediction
    (["dog dog dog dog dog"], ["the dog"]),  # clipping: "dog" matches once
    (["It's 3.5-4.0 (well-known)!"], ["it's 3.5 - 4.0 well-known!"]),
])
@pytest.mark.parametrize("options", [{}, {"max_order": 2}, {"smooth": "none"}])
def test_bleu_matches_sacrebleu_on_edge_cases(predictions, references, options):
    assert_bleu_matches_sacrebleu(predictions, references, **options)


def test_bleu_rejects_bad_arguments():
    with pytest.raises(ValueError, match="one reference per prediction"):
        bleu(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="smooth"):
        bleu(["a"], ["a"], smooth="floor")


# --------------------------------------------------------------------------- multiple choice
TEXT = ("The cat sat on the mat. The dog sat on the log. A cat and a dog met on a mat by the log, "
        "and the cat ran off to the barn while the dog slept in the sun. ") * 4


@pytest.fixture(scope="module")
def tokenizer() -> BPETokenizer:
    return BPETokenizer.train(TEXT, 300, special_tokens=["<|endoftext|>"])


LLAMA_STYLE = {"norm": "rmsnorm", "mlp": "swiglu", "position": "rope", "n_kv_heads": 2, "qkv_bias": False,
               "bias": False}


def tiny_model(tokenizer, llama: bool, seed: int = 0, **overrides) -> GPT:
    """A small GPT over the tokenizer's ids with weights large enough that the choices score apart."""
    style = LLAMA_STYLE if llama else {}
    config = GPTConfig(**{"vocab_size": tokenizer.vocab_size, "context_length": 32, "d_model": 16, "n_layers": 2,
                          "n_heads": 4, **style, **overrides})
    model = GPT(config)
    randomize(model, seed, scale=0.3)
    return model.eval()


def direct_logprob(model: nn.Module, context_ids: list[int], choice_ids: list[int]) -> float:
    """log p(choice | context) in float64: the model run on the one unpadded sequence, log_softmax at the choice."""
    model = copy.deepcopy(model).double().eval()
    ids = torch.tensor([(context_ids + choice_ids)[:-1]])  # (1, L - 1): the last id is only predicted
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0].double(), dim=-1)  # (L - 1, V)
    return sum(logp[len(context_ids) - 1 + j, token].item() for j, token in enumerate(choice_ids))


CONTEXT = "The cat sat on the"
CHOICES = ["mat", "log", "barn while the dog slept", "sun"]


@pytest.mark.parametrize("llama", [False, True])
def test_choice_scores_match_a_direct_float64_computation(tokenizer, llama):
    model = tiny_model(tokenizer, llama, seed=1)
    context_ids = tokenizer.encode(CONTEXT)
    choice_ids = [tokenizer.encode(" " + choice) for choice in CHOICES]
    assert len({len(ids) for ids in choice_ids}) > 1, "the choices must differ in token count to exercise padding"
    expected = [direct_logprob(model, context_ids, ids) for ids in choice_ids]
    for scored, atol in [(model, 1e-4), (copy.deepcopy(model).double(), 1e-10)]:  # float32 rounding; then exact
        scores = score_choices(scored, tokenizer, CONTEXT, CHOICES)
        assert scores.logprobs == pytest.approx(expected, abs=atol)
        assert scores.n_tokens == [len(ids) for ids in choice_ids]
        per_char = [score / len(choice) for score, choice in zip(expected, CHOICES)]
        assert scores.per_char == pytest.approx(per_char, abs=atol)
        assert scores.best == max(range(len(CHOICES)), key=expected.__getitem__)
        assert scores.best_per_char == max(range(len(CHOICES)), key=per_char.__getitem__)


def test_trailing_context_whitespace_moves_to_the_choice(tokenizer):
    model = tiny_model(tokenizer, llama=True, seed=2).double()
    moved = score_choices(model, tokenizer, CONTEXT + " ", CHOICES, delimiter="")
    expected = [direct_logprob(model, tokenizer.encode(CONTEXT), tokenizer.encode(" " + c)) for c in CHOICES]
    assert moved.logprobs == pytest.approx(expected, abs=1e-10)


def test_empty_context_starts_from_end_of_text_and_long_context_is_cut_on_the_left(tokenizer):
    model = tiny_model(tokenizer, llama=False, seed=3).double()
    eot = tokenizer.encode("<|endoftext|>", allowed_special="all")
    choices = ["the cat", "a dog sat on the log"]
    expected = [direct_logprob(model, eot, tokenizer.encode(" " + c)) for c in choices]
    assert score_choices(model, tokenizer, "", choices).logprobs == pytest.approx(expected, abs=1e-10)
    long_context = TEXT.strip()  # far more than the model's 32 positions
    whole = [tokenizer.encode(long_context) + tokenizer.encode(" " + c) for c in choices]
    kept = [ids[-33:] for ids in whole]  # 32 fed, the last only predicted
    expected = [direct_logprob(model, ids[: -len(tokenizer.encode(" " + c))], tokenizer.encode(" " + c))
                for ids, c in zip(kept, choices)]
    assert score_choices(model, tokenizer, long_context, choices).logprobs == pytest.approx(expected, abs=1e-10)


def test_any_module_from_ids_to_logits_can_be_scored(tokenizer):
    torch.manual_seed(0)
    bigram = nn.Sequential(nn.Embedding(tokenizer.vocab_size, 8), nn.Linear(8, tokenizer.vocab_size)).double()
    context_ids = tokenizer.encode(CONTEXT)
    expected = [direct_logprob(bigram, context_ids, tokenizer.encode(" " + c)) for c in CHOICES]
    assert score_choices(bigram, tokenizer, CONTEXT, CHOICES).logprobs == pytest.approx(expected, abs=1e-10)


def test_scoring_turns_dropout_off_and_restores_the_mode(tokenizer):
    model = tiny_model(tokenizer, llama=True, seed=4, dropout=0.5).double().train()
    context_ids = tokenizer.encode(CONTEXT)
    expected = [direct_logprob(model, context_ids, tokenizer.encode(" " + c)) for c in CHOICES]
    assert score_choices(model, tokenizer, CONTEXT, CHOICES).logprobs == pytest.approx(expected, abs=1e-10)
    assert model.training


def test_multiple_choice_accuracy_counts_the_direct_argmax_with_wilson_intervals(tokenizer):
    model = tiny_model(tokenizer, llama=True, seed=5)
    contexts = ["The dog sat on the", "A cat and a dog met on a", "the cat ran off to the", "The cat sat on the"]
    items, hits, hits_norm = [], 0, 0
    for index, context in enumerate(contexts):
        direct = [direct_logprob(model, tokenizer.encode(context), tokenizer.encode(" " + c)) for c in CHOICES]
        best = max(range(len(CHOICES)), key=direct.__getitem__)
        best_norm = max(range(len(CHOICES)), key=lambda i: direct[i] / len(CHOICES[i]))
        answer = best if index % 2 else (best + 1) % len(CHOICES)  # half the items answered right by the model
        items.append({"context": context, "choices": CHOICES, "answer": answer})
        hits, hits_norm = hits + (best == answer), hits_norm + (best_norm == answer)
    result = multiple_choice_accuracy(model, tokenizer, items)
    assert result["n"] == len(items)
    assert result["accuracy"] == hits / len(items) and result["accuracy_norm"] == hits_norm / len(items)
    assert result["accuracy_interval"] == pytest.approx(quadratic_wilson(hits, len(items)), abs=1e-12)
    assert result["accuracy_norm_interval"] == pytest.approx(quadratic_wilson(hits_norm, len(items)), abs=1e-12)


def test_context_gain_ranks_choices_by_what_the_context_adds(tokenizer):
    model = tiny_model(tokenizer, llama=False, seed=6).double()
    eot = tokenizer.encode("<|endoftext|>", allowed_special="all")
    contexts = ["The dog sat on the", "A cat and a dog met on a", "the cat ran off to the"]
    items, hits = [], 0
    for index, context in enumerate(contexts):
        gains = [direct_logprob(model, tokenizer.encode(context), tokenizer.encode(" " + c))
                 - direct_logprob(model, eot, tokenizer.encode(" " + c)) for c in CHOICES]  # "" starts at eot
        best = max(range(len(CHOICES)), key=gains.__getitem__)
        answer = best if index != 1 else (best + 2) % len(CHOICES)
        items.append({"context": context, "choices": CHOICES, "answer": answer})
        hits += best == answer
    result = multiple_choice_accuracy(model, tokenizer, items, unconditional_context="")
    assert result["accuracy_context_gain"] == hits / len(items) == 2 / 3
    assert result["accuracy_context_gain_interval"] == pytest.approx(quadratic_wilson(hits, len(items)), abs=1e-12)
    assert "accuracy_context_gain" not in multiple_choice_accuracy(model, tokenizer, items)


@pytest.mark.parametrize("choices, items, message", [
    ([], None, "non-empty strings"),
    (["mat", ""], None, "non-empty strings"),
    (None, [], "at least one item"),
    (None, [{"context": "x", "choices": ["a", "b"], "answer": 2}], "item 0"),
    (None, [{"context": "x", "choices": ["a", "b"], "answer": 0}, {"choices": ["a", "b"], "answer": 0}], "item 1"),
    (None, [{"context": "x", "choices": ["a"], "answer": 0}], "item 0: 'choices' is \\['a'\\]: one choice"),
])
def test_bad_choices_and_items_are_value_errors(tokenizer, choices, items, message):
    model = tiny_model(tokenizer, llama=False)
    with pytest.raises(ValueError, match=message):
        if items is None:
            score_choices(model, tokenizer, CONTEXT, choices)
        else:
            multiple_choice_accuracy(model, tokenizer, items)


# --------------------------------------------------------------------------- Wilson interval
def quadratic_wilson(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson bounds as the roots in p of (p_hat - p)^2 = z^2 p (1 - p) / n."""
    p_hat = successes / trials
    a, b, c = 1 + z * z / trials, -(2 * p_hat + z * z / trials), p_hat * p_hat
    root = math.sqrt(max(b * b - 4 * a * c, 0.0))
    return (-b - root) / (2 * a), (-b + root) / (2 * a)


@pytest.mark.parametrize("successes, trials", [(0, 1), (1, 1), (0, 10), (3, 10), (5, 10), (10, 10), (37, 100),
                                               (999, 1000), (1, 3)])
@pytest.mark.parametrize("z", [1.0, 1.96, 2.576])
def test_wilson_interval_solves_its_quadratic_and_behaves(successes, trials, z):
    low, high = wilson_interval(successes, trials, z)
    assert (low, high) == pytest.approx(quadratic_wilson(successes, trials, z), abs=1e-12)
    assert 0.0 <= low <= successes / trials <= high <= 1.0
    assert (successes == 0) == (low == 0.0) and (successes == trials) == (high == 1.0)
    mirrored = wilson_interval(trials - successes, trials, z)
    assert mirrored == pytest.approx((1 - high, 1 - low), abs=1e-12)
    wider = wilson_interval(successes, trials, z + 0.5)
    assert wider[0] <= low and high <= wider[1]


@pytest.mark.parametrize("successes, trials", [(1, 0), (-1, 5), (6, 5)])
def test_wilson_interval_rejects_impossible_counts(successes, trials):
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(successes, trials)
