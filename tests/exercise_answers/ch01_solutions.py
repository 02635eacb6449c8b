"""Worked answers to chapter 1's exercises: the code of ch01-tokenization/solutions.ipynb, cell for cell.

``python -m llmscratch.exercises ch01 tests/exercise_answers/ch01_solutions.py`` checks them all.
"""

from collections import Counter

import regex
import torch
from torch import nn

from llmscratch.text.tokenizer import GPT2_SPLIT_PATTERN, BPETokenizer


def merge_pair(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """A new list: ``ids`` with every occurrence of ``pair``, left to right, replaced by ``new_id``."""
    merged, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            merged.append(new_id)
            i += 2  # both ids are used up: [7, 7, 7] becomes [new_id, 7]
        else:
            merged.append(ids[i])
            i += 1
    return merged


def encode_with_merges(text: str, merges: list[tuple[int, int]]) -> list[int]:
    """Byte-level BPE without pre-splitting: ``merges[i]`` makes id ``256 + i``."""
    ids = list(text.encode("utf-8"))
    # Each merge once, in the order learned: a merge only makes pairs whose own merge comes later.
    for new_id, pair in enumerate(merges, start=256):
        ids = merge_pair(ids, pair, new_id)
    return ids


def train_merges(text: str, n_merges: int, pattern: str = GPT2_SPLIT_PATTERN) -> list[tuple[int, int]]:
    """Up to ``n_merges`` merges learned from ``text``, never across the chunks ``pattern`` cuts it into."""
    chunk_counts = Counter(regex.findall(pattern, text))  # each distinct chunk once, with its count
    chunk_ids = {chunk: list(chunk.encode("utf-8")) for chunk in chunk_counts}
    merges = []
    for new_id in range(256, 256 + n_merges):
        pair_counts = Counter()
        for chunk, ids in chunk_ids.items():
            for pair in zip(ids, ids[1:]):
                pair_counts[pair] += chunk_counts[chunk]
        if not pair_counts:
            break  # every chunk is one token: nothing is left to merge
        best = min(pair_counts, key=lambda pair: (-pair_counts[pair], pair))  # ties: the smaller ids
        merges.append(best)
        chunk_ids = {chunk: merge_pair(ids, best, new_id) for chunk, ids in chunk_ids.items()}
    return merges


def encode_with_dropout(tokenizer: BPETokenizer, text: str, p: float, generator: torch.Generator) -> list[int]:
    """BPE-dropout: encode as ``tokenizer`` does, but each step skips each possible merge with probability p."""
    id_of_byte = {byte: token_id for token_id, byte in enumerate(tokenizer.byte_order)}
    ids = []
    for chunk in regex.findall(tokenizer.pattern, text):
        parts = [id_of_byte[byte] for byte in chunk.encode("utf-8")]
        while True:
            candidates = [(tokenizer.merges[pair], i) for i, pair in enumerate(zip(parts, parts[1:]))
                          if pair in tokenizer.merges]
            survives = torch.rand(len(candidates), generator=generator) >= p  # each with probability 1 - p
            kept = [candidate for candidate, alive in zip(candidates, survives.tolist()) if alive]
            if not kept:
                break
            new_id, i = min(kept)  # the earliest-learned merge; among equals, the leftmost
            parts[i : i + 2] = [new_id]
        ids.extend(parts)
    return ids


def add_special_tokens(tokenizer: BPETokenizer, tokens: list[str]) -> BPETokenizer:
    """A new tokenizer: ``tokenizer`` plus the new ``tokens`` as special tokens, with the next free ids."""
    special_tokens = dict(tokenizer.special_tokens)
    for token in tokens:
        if token not in special_tokens:
            special_tokens[token] = len(tokenizer.vocab) + len(special_tokens)  # after the last id
    return BPETokenizer(list(tokenizer.merges), pattern=tokenizer.pattern, special_tokens=special_tokens,
                        byte_order=tokenizer.byte_order, name=tokenizer.name)


def sliding_windows(ids: list[int], max_length: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (n_windows, max_length): windows every ``stride`` tokens, targets shifted by one."""
    ids = torch.tensor(ids, dtype=torch.long)  # (N,)
    if len(ids) <= max_length:  # not one window: each needs max_length + 1 tokens
        empty = torch.empty(0, max_length, dtype=torch.long)
        return empty, empty.clone()
    windows = ids.unfold(0, max_length + 1, stride)  # (n_windows, max_length + 1)
    return windows[:, :-1], windows[:, 1:]


class SinusoidalPositions(nn.Module):
    """The fixed position encodings of "Attention Is All You Need": sin on even dimensions, cos on odd ones."""

    def __init__(self, context_length: int, d_model: int):
        super().__init__()
        position = torch.arange(context_length, dtype=torch.float64).unsqueeze(1)  # (T, 1)
        two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d_model / 2,): 0, 2, 4, ...
        angle = position / 10_000 ** (two_i / d_model)  # (T, d_model / 2)
        table = torch.empty(context_length, d_model, dtype=torch.float64)
        table[:, 0::2] = torch.sin(angle)
        table[:, 1::2] = torch.cos(angle)
        # A buffer, not a parameter: the optimizer leaves it alone, and it follows .to(device).
        self.register_buffer("table", table.float(), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.table[positions]  # (T, d_model)
