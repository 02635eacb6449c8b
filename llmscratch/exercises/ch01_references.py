"""Chapter 1's references: what the right answer and each usual mistake compute, written out.

``llmscratch.exercises.ch01`` compares a reader's answer with these to name the mistake it reproduces:
each function is the plain computation, and each keyword switch one usual slip.
"""

from collections import Counter

import regex
import torch

from llmscratch.text.data import SlidingWindowDataset

__all__ = ["bpe", "merge", "sinusoids", "train_naively", "windows"]


def merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Reference merge: a token joins the one before it when they make ``pair`` (a merged one never does)."""
    out: list[int] = []
    for token in ids:
        if out and (out[-1], token) == pair:
            out[-1] = new_id
        else:
            out.append(token)
    return out


def bpe(ids: list[int], rank: dict, order: str = "learned", rightmost: bool = False) -> list[int]:
    """What a usual mistake makes of ``ids``: merges picked in another order, or right to left."""
    if order == "latest":  # each merge once, the last-learned first
        for pair in sorted(rank, key=rank.get, reverse=True):
            ids = merge(ids, pair, rank[pair])
        return ids
    while pairs := [pair for pair in zip(ids, ids[1:]) if pair in rank]:
        counts = Counter(pairs)
        pair = min(pairs, key=lambda p: (-counts[p], rank[p]) if order == "frequency" else rank[p])
        ids = merge(ids[::-1], pair[::-1], rank[pair])[::-1] if rightmost else merge(ids, pair, rank[pair])
    return ids


def train_naively(text: str, n_merges: int, pattern: str, pick) -> list[tuple[int, int]]:
    """BPE training by recounting, with ``pick`` choosing among the equally frequent pairs (in order seen)."""
    pieces = [list(chunk.encode("utf-8")) for chunk in regex.findall(pattern, text)]
    merges: list[tuple[int, int]] = []
    while len(merges) < n_merges:
        counts = Counter(pair for piece in pieces for pair in zip(piece, piece[1:]))
        if not counts:
            break
        best = max(counts.values())
        merges.append(pick([pair for pair, count in counts.items() if count == best]))
        pieces = [merge(piece, merges[-1], 255 + len(merges)) for piece in pieces]
    return merges


def windows(ids: list[int], max_length: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SlidingWindowDataset's windows stacked: (inputs, targets), each (n_windows, max_length)."""
    if len(ids) <= max_length:  # the dataset refuses a text shorter than one window
        return torch.empty(0, max_length, dtype=torch.long), torch.empty(0, max_length, dtype=torch.long)
    inputs, targets = zip(*SlidingWindowDataset(ids, max_length, stride))
    return torch.stack(inputs), torch.stack(targets)


def sinusoids(n_positions: int, d_model: int, mistake: str = "") -> torch.Tensor:
    """(n_positions, d_model) in float64: PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(same)."""
    dim = torch.arange(d_model, dtype=torch.float64)
    exponent = {"dimension": dim, "pair": dim // 2}.get(mistake, dim - dim % 2) / d_model
    angle = torch.arange(n_positions, dtype=torch.float64)[:, None] * 10_000.0 ** -exponent  # (n, d)
    if mistake == "halves":
        return torch.cat([angle[:, 0::2].sin(), angle[:, 0::2].cos()], dim=1)
    even = dim % 2 == 0
    return torch.where(even != (mistake == "swapped"), angle.sin(), angle.cos())
