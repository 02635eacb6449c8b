"""Chapter 1's exercise checks: each solution passes, and plausible wrong answers fail with the right hint."""

from collections import Counter

import regex
import torch
from exercise_suite import ExerciseSuite
from exercise_suite import solutions as solutions_of
from torch import nn

from llmscratch.exercises import ch01
from llmscratch.text.tokenizer import BPETokenizer

solutions = solutions_of(ch01)


# --------------------------------------------------------------------------- wrong answers
def merge_in_a_for_loop(ids, pair, new_id):
    merged = []
    for i in range(len(ids)):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            merged.append(new_id)
            i += 1  # no effect: the for loop sets i again
        else:
            merged.append(ids[i])
    return merged


def merge_dropping_the_last(ids, pair, new_id):
    merged, i = [], 0
    while i < len(ids) - 1:
        if (ids[i], ids[i + 1]) == pair:
            merged.append(new_id)
            i += 2
        else:
            merged.append(ids[i])
            i += 1
    return merged


def merge_right_to_left(ids, pair, new_id):
    return solutions.merge_pair(ids[::-1], pair[::-1], new_id)[::-1]


def merge_in_place(ids, pair, new_id):
    ids[:] = solutions.merge_pair(ids, pair, new_id)
    return ids


def encode_characters(text, merges):
    ids = [ord(c) for c in text]
    for new_id, pair in enumerate(merges, start=256):
        ids = solutions.merge_pair(ids, pair, new_id)
    return ids


def encode_by_frequency(text, merges):
    """Merges the most frequent mergeable pair of the text first, as training would."""
    rank = {pair: new_id for new_id, pair in enumerate(merges, start=256)}
    ids = list(text.encode("utf-8"))
    while pairs := [pair for pair in zip(ids, ids[1:]) if pair in rank]:
        best = Counter(pairs).most_common(1)[0][0]
        ids = solutions.merge_pair(ids, best, rank[best])
    return ids


def encode_latest_first(text, merges):
    ids = list(text.encode("utf-8"))
    for new_id, pair in reversed(list(enumerate(merges, start=256))):
        ids = solutions.merge_pair(ids, pair, new_id)
    return ids


def train_across_chunks(text, n_merges, pattern):
    return solutions.train_merges(text, n_merges, r"(?s).+")


def train_ties_by_first_seen(text, n_merges, pattern):
    """Counter.most_common picks the most frequent pair, and among equals the one counted first."""
    chunks = [list(chunk.encode("utf-8")) for chunk in regex.findall(pattern, text)]
    merges = []
    while len(merges) < n_merges and (counts := Counter(p for c in chunks for p in zip(c, c[1:]))):
        merges.append(counts.most_common(1)[0][0])
        chunks = [solutions.merge_pair(chunk, merges[-1], 255 + len(merges)) for chunk in chunks]
    return merges


def train_as_lists(text, n_merges, pattern):
    return [list(pair) for pair in solutions.train_merges(text, n_merges, pattern)]


def windows_not_shifted(ids, max_length, stride):
    inputs, _ = solutions.sliding_windows(ids, max_length, stride)
    return inputs, inputs.clone()


def windows_missing_the_last(ids, max_length, stride):
    inputs, targets = solutions.sliding_windows(ids, max_length, stride)
    return inputs[:-1], targets[:-1]


def windows_ignoring_stride(ids, max_length, stride):
    return solutions.sliding_windows(ids, max_length, max_length)


def windows_as_int32(ids, max_length, stride):
    """Equal values, yet F.cross_entropy refuses int32 targets."""
    return tuple(part.int() for part in solutions.sliding_windows(ids, max_length, stride))


def dropout_keeping_with_p(tokenizer, text, p, generator):
    return solutions.encode_with_dropout(tokenizer, text, 1 - p, generator)


def dropout_byte_values(tokenizer, text, p, generator):
    identity = BPETokenizer(list(tokenizer.merges), pattern=tokenizer.pattern)
    return solutions.encode_with_dropout(identity, text, p, generator)


def dropout_without_splitting(tokenizer, text, p, generator):
    unsplit = BPETokenizer(list(tokenizer.merges), pattern=r"(?s).+", byte_order=tokenizer.byte_order)
    return solutions.encode_with_dropout(unsplit, text, p, generator)


def dropout_with_the_global_generator(tokenizer, text, p, generator):
    return solutions.encode_with_dropout(tokenizer, text, p, torch.default_generator)


def dropout_once_per_text(tokenizer, text, p, generator):
    skip_all = torch.rand(1, generator=generator).item() < p
    return solutions.encode_with_dropout(tokenizer, text, float(skip_all), generator)


def dropout_skipping_rules(tokenizer, text, p, generator):
    """Drops merge RULES for the whole chunk (one draw per rule) instead of candidate pairs at each step."""
    id_of_byte = {byte: token_id for token_id, byte in enumerate(tokenizer.byte_order)}
    ids = []
    for chunk in regex.findall(tokenizer.pattern, text):
        parts, skipped = [id_of_byte[byte] for byte in chunk.encode("utf-8")], {}
        while True:
            candidates = [(tokenizer.merges[pair], i, pair) for i, pair in enumerate(zip(parts, parts[1:]))
                          if pair in tokenizer.merges]
            for *_, pair in candidates:
                if pair not in skipped:
                    skipped[pair] = torch.rand(1, generator=generator).item() < p
            kept = [(new_id, i) for new_id, i, pair in candidates if not skipped[pair]]
            if not kept:
                break
            new_id, i = min(kept)
            parts[i : i + 2] = [new_id]
        ids.extend(parts)
    return ids


def special_tokens_without_byte_order(tokenizer, tokens):
    added = solutions.add_special_tokens(tokenizer, tokens)
    return BPETokenizer(list(added.merges), pattern=added.pattern, special_tokens=added.special_tokens)


def special_tokens_without_pattern(tokenizer, tokens):
    added = solutions.add_special_tokens(tokenizer, tokens)
    return BPETokenizer(list(added.merges), special_tokens=added.special_tokens, byte_order=added.byte_order)


def special_tokens_in_place(tokenizer, tokens):
    added = solutions.add_special_tokens(tokenizer, tokens)
    tokenizer.__dict__.update(added.__dict__)
    return tokenizer


def special_tokens_dropping_the_old(tokenizer, tokens):
    new = [token for token in tokens if token not in tokenizer.special_tokens]
    return BPETokenizer(list(tokenizer.merges), pattern=tokenizer.pattern, byte_order=tokenizer.byte_order,
                        special_tokens={token: len(tokenizer.vocab) + i for i, token in enumerate(new)})


def positions_module(table_of, trainable=False, dtype=torch.float32):
    """A SinusoidalPositions look-alike whose table is ``table_of(context_length, d_model)``, in ``dtype``."""
    class Positions(nn.Module):
        def __init__(self, context_length, d_model):
            super().__init__()
            table = table_of(context_length, d_model).to(dtype)
            if trainable:
                self.table = nn.Parameter(table)
            else:
                self.register_buffer("table", table)

        def forward(self, positions):
            return self.table[positions]

    Positions.__name__ = table_of.__name__ + ("_as_a_parameter" if trainable else "")
    return Positions


def angle(context_length, d_model, index):
    """pos / 10000^(index / d_model): (context_length, len(index))."""
    return torch.arange(context_length, dtype=torch.float64)[:, None] / 10_000 ** (index / d_model)


def sin_cos(context_length, d_model, first=torch.sin, second=torch.cos, interleaved=True):
    """sin(angle) and cos(angle) of each pair 2i, 2i + 1: interleaved (right) or in two halves."""
    pair_angle = angle(context_length, d_model, torch.arange(0, d_model, 2, dtype=torch.float64))
    halves = [first(pair_angle), second(pair_angle)]  # (T, d/2) each
    return torch.stack(halves, dim=-1).flatten(1) if interleaved else torch.cat(halves, dim=1)


def table_in_halves(context_length, d_model):
    return sin_cos(context_length, d_model, interleaved=False)


def table_cos_first(context_length, d_model):
    return sin_cos(context_length, d_model, first=torch.cos, second=torch.sin)


def table_by_dimension_index(context_length, d_model):
    dim = torch.arange(d_model, dtype=torch.float64)
    dim_angle = angle(context_length, d_model, dim)  # each dimension its own frequency
    return torch.where(dim % 2 == 0, dim_angle.sin(), dim_angle.cos())


WRONG_ANSWERS = [
    ("merge_pair", merge_in_a_for_loop, "a for loop's `i += 1` does not skip"),
    ("merge_pair", merge_dropping_the_last, "the last id is lost"),
    ("merge_pair", merge_right_to_left, "merge from left to right"),
    ("merge_pair", merge_in_place, "the list you were given must not change"),
    ("encode_with_merges", encode_characters, "BPE works on UTF-8 bytes, not characters"),
    ("encode_with_merges", encode_by_frequency, "you merged the most frequent pair of this text"),
    ("encode_with_merges", encode_latest_first, "you applied the last-learned merge first"),
    ("train_merges", train_across_chunks, "you counted pairs across chunk boundaries"),
    ("train_merges", train_ties_by_first_seen, "ties between equally frequent pairs go to the pair seen first"),
    ("train_merges", train_as_lists, "return the merges as tuples"),
    ("sliding_windows", windows_not_shifted, "the targets are the inputs shifted by ONE token"),
    ("sliding_windows", windows_missing_the_last, "the last window is missing"),
    ("sliding_windows", windows_ignoring_stride, "the next window starts `stride` tokens later"),
    ("sliding_windows", windows_as_int32, "sliding_windows([], max_length=4, stride=4), the inputs",
     "exactly torch.long (int64)"),
    ("encode_with_dropout", dropout_keeping_with_p, "p is the probability of SKIPPING a merge"),
    ("encode_with_dropout", dropout_byte_values, "the id of byte b is not b"),
    ("encode_with_dropout", dropout_without_splitting, "you merged across the pre-split chunks"),
    ("encode_with_dropout", dropout_with_the_global_generator, "draw every random number from `generator`"),
    ("encode_with_dropout", dropout_once_per_text, "skip merges independently at every step"),
    ("encode_with_dropout", dropout_skipping_rules, "'aaaa', p=0.5) with 20 seeds", "skip candidate PAIRS"),
    ("add_special_tokens", special_tokens_without_byte_order, "keep the tokenizer's byte_order"),
    ("add_special_tokens", special_tokens_without_pattern, "keep the tokenizer's split pattern"),
    ("add_special_tokens", special_tokens_in_place, "return a NEW tokenizer"),
    ("add_special_tokens", special_tokens_dropping_the_old, "keep the tokenizer's own special tokens"),
    ("SinusoidalPositions", positions_module(table_in_halves), "interleave"),
    ("SinusoidalPositions", positions_module(table_cos_first), "sin goes on the even dimensions"),
    ("SinusoidalPositions", positions_module(sin_cos, trainable=True), "register the table with register_buffer"),
    ("SinusoidalPositions", positions_module(table_by_dimension_index), "you used each dimension's own index"),
    ("SinusoidalPositions", positions_module(sin_cos, dtype=torch.float64), "exactly torch.float32"),
]


class TestChapter1(ExerciseSuite):
    chapter, folder, wrong = ch01, "ch01-tokenization", WRONG_ANSWERS
