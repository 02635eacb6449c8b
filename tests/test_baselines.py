"""llmscratch.training.baselines: unigram and bigram models against counts made with plain Python dicts."""
import math
import re
from collections import Counter

import numpy as np
import pytest

from llmscratch.training import baselines


def random_ids(n, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, n)


def markov_ids(n, vocab, seed):
    """A sequence where each token mostly decides the next (the same rule for every seed)."""
    following, rng = np.random.default_rng(0).permutation(vocab), np.random.default_rng(seed)
    ids = [0]
    for _ in range(n - 1):
        ids.append(following[ids[-1]] if rng.random() < 0.8 else rng.integers(vocab))
    return np.array(ids)


@pytest.mark.parametrize("vocab, n, seed", [(5, 40, 0), (9, 25, 1), (3, 200, 2)])
def test_probabilities_equal_counting_by_hand(vocab, n, seed):
    ids = random_ids(n, vocab, seed).tolist()
    ids[-1] = vocab - 1  # the last token is never followed: its row must be the unigram
    if vocab - 1 in ids[:-1]:
        ids = [i for i in ids[:-1] if i != vocab - 1] + [vocab - 1]
    singles, pairs, weight = Counter(ids), Counter(zip(ids, ids[1:])), 0.7
    firsts = Counter(ids[:-1])
    unigram = baselines.unigram_probs(ids, vocab)
    bigram = baselines.bigram_probs(ids, vocab, weight)
    for b in range(vocab):
        expected = (singles[b] + 1) / (len(ids) + vocab)
        assert unigram[b] == pytest.approx(expected, rel=1e-12)
    for a in range(vocab):
        for b in range(vocab):
            if firsts[a]:
                expected = weight * pairs[a, b] / firsts[a] + (1 - weight) * unigram[b]
            else:
                expected = unigram[b]
            assert bigram[a, b] == pytest.approx(expected, rel=1e-12), (a, b)
    np.testing.assert_allclose(bigram.sum(axis=1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(unigram.sum(), 1.0, rtol=1e-12)


def test_scores_are_the_targets_log_probabilities_over_their_bytes():
    vocab = 7
    train, val = random_ids(300, vocab, 3), random_ids(50, vocab, 4)
    lengths = np.arange(1, vocab + 1, dtype=np.float64)  # token t holds t + 1 bytes
    bigram = baselines.bigram_probs(train, vocab, 0.5)
    unigram = baselines.unigram_probs(train, vocab)
    nats = [-math.log(bigram[a, b]) for a, b in zip(val[:-1], val[1:])]
    assert baselines.nats_per_token(bigram, val) == pytest.approx(sum(nats) / len(nats), rel=1e-12)
    n_bytes = sum(lengths[b] for b in val[1:])
    assert baselines.bits_per_byte(bigram, val, lengths) == pytest.approx(sum(nats) / math.log(2) / n_bytes)
    unigram_nats = sum(-math.log(unigram[b]) for b in val[1:])
    assert baselines.bits_per_byte(unigram, val, lengths) == pytest.approx(unigram_nats / math.log(2) / n_bytes)
    uniform = np.full(vocab, 1 / vocab)  # a uniform guess: log2(V) bits per token, whatever the text
    mean_bytes = n_bytes / (len(val) - 1)
    assert baselines.bits_per_byte(uniform, val, lengths) == pytest.approx(math.log2(vocab) / mean_bytes)


def test_fit_bigram_picks_the_weight_best_on_the_held_out_tail():
    vocab, ids = 11, markov_ids(2000, 11, 5)
    weights = (0.0, 0.3, 0.6, 0.9, 0.99)
    model, chosen = baselines.fit_bigram(ids, vocab, weights=weights, held_out=0.2)
    split = int(len(ids) * 0.8)
    tail = {w: baselines.nats_per_token(baselines.bigram_probs(ids[:split], vocab, w), ids[split - 1 :])
            for w in weights}
    assert chosen == min(tail, key=tail.get)
    np.testing.assert_array_equal(model, baselines.bigram_probs(ids, vocab, chosen))  # refitted on all
    # On text where the previous token matters, one token of context beats none, which beats a guess.
    val = markov_ids(500, vocab, 6)
    scores = [baselines.nats_per_token(model, val),
              baselines.nats_per_token(baselines.unigram_probs(ids, vocab), val), math.log(vocab)]
    assert scores[0] < scores[1] - 0.5 and scores[1] < scores[2] + 0.05


@pytest.mark.parametrize("call, message", [
    (lambda: baselines.unigram_probs([0, 5], 5), "token id 5 is outside the vocabulary of 5"),
    (lambda: baselines.unigram_probs([-1, 2], 5), "token id -1"),
    (lambda: baselines.unigram_probs([1], 5), "at least 2 token ids"),
    (lambda: baselines.bigram_probs([0, 1, 2], 3, 1.0), "weight must be in [0, 1)"),
    (lambda: baselines.fit_bigram([0, 1, 2], 3, held_out=1.0), "held_out must be a share"),
    (lambda: baselines.bits_per_byte(np.full(3, 1 / 3), [0, 1, 2], np.zeros(3)), "hold no bytes"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()
