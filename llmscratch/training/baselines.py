"""Count-based baselines for a language model's loss: unigram and bigram models fitted by counting.

A transformer's bits per byte mean more beside models that see no context (a unigram: each token's
frequency) or one token of it (a bigram: each token's frequency after the one before), fitted on the
same training tokens and scored on the same held-out ones.
"""
import math

import numpy as np


def _checked_ids(ids, vocab_size: int) -> np.ndarray:
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be at least 1, got {vocab_size}")
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or len(ids) < 2:
        raise ValueError(f"expected a 1-D sequence of at least 2 token ids, got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = ids.min() if ids.min() < 0 else ids.max()
        raise ValueError(f"token id {bad} is outside the vocabulary of {vocab_size} (ids 0..{vocab_size - 1})")
    return ids


def unigram_probs(ids, vocab_size: int) -> np.ndarray:
    """(V,) each token's frequency in ids, add-one smoothed so that no token has probability 0."""
    counts = np.bincount(_checked_ids(ids, vocab_size), minlength=vocab_size).astype(np.float64)
    return (counts + 1) / (counts.sum() + vocab_size)


def bigram_probs(ids, vocab_size: int, weight: float) -> np.ndarray:
    """(V, V) float64: row a is the distribution of the token after a.

    It is ``weight`` x the frequency of each token after a in ids, plus (1 - weight) x the unigram:
    most pairs of a large vocabulary never occur in the training text, and must not get probability 0.
    After a token never followed by another in ids, the row is the unigram alone.
    """
    if not 0 <= weight < 1:  # at 1, a pair never seen in training would get probability 0
        raise ValueError(f"weight must be in [0, 1) (the bigram's share of the mix), got {weight}")
    ids = _checked_ids(ids, vocab_size)
    probs = np.bincount(ids[:-1] * vocab_size + ids[1:], minlength=vocab_size * vocab_size)
    probs = probs.reshape(vocab_size, vocab_size).astype(np.float64)  # (V, V) pair counts, then probabilities
    followed = probs.sum(axis=1)  # (V,) how often each token has a next token
    seen = followed > 0
    probs[seen] *= weight / followed[seen, None]
    unigram = unigram_probs(ids, vocab_size)
    probs[seen] += (1 - weight) * unigram
    probs[~seen] = unigram
    return probs


def _target_probs(probs: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The probability each model gives every target ids[1:]: after ids[:-1] for a bigram, alone for a unigram."""
    return probs[ids[:-1], ids[1:]] if probs.ndim == 2 else probs[ids[1:]]


def nats_per_token(probs: np.ndarray, ids) -> float:
    """The mean -ln p of the targets ids[1:] under a unigram (V,) or bigram (V, V) model."""
    ids = _checked_ids(ids, len(probs))
    return float(-np.log(_target_probs(probs, ids)).mean())


def bits_per_byte(probs: np.ndarray, ids, byte_lengths) -> float:
    """Bits per byte of the targets ids[1:]: their total -log2 p over their total UTF-8 bytes.

    ``byte_lengths`` (V,) is each token's length in bytes (``evaluation.token_byte_lengths``).
    """
    ids = _checked_ids(ids, len(probs))
    n_bytes = float(np.asarray(byte_lengths, dtype=np.float64)[ids[1:]].sum())
    if n_bytes == 0:
        raise ValueError("the targets hold no bytes of text (only special tokens?): bits per byte are undefined")
    return float(-np.log(_target_probs(probs, ids)).sum() / math.log(2) / n_bytes)


def fit_bigram(train_ids, vocab_size: int, weights=tuple(np.linspace(0.05, 0.95, 19)),
               held_out: float = 0.1) -> tuple[np.ndarray, float]:
    """The bigram model of train_ids and its mixing weight.

    The weight is the one of ``weights`` whose bigram, counted on the first (1 - held_out) of the
    tokens, gives the last held_out the lowest loss; the returned model is counted on all of them.
    """
    if not 0 < held_out < 1:
        raise ValueError(f"held_out must be a share strictly between 0 and 1, got {held_out}")
    ids = _checked_ids(train_ids, vocab_size)
    split = int(len(ids) * (1 - held_out))
    fit, tune = ids[:split], ids[split - 1 :]  # the tuning targets start right after the fitted ones
    losses = {w: nats_per_token(bigram_probs(fit, vocab_size, w), tune) for w in weights}
    best = min(losses, key=losses.get)
    return bigram_probs(ids, vocab_size, best), float(best)
