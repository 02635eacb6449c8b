"""Training data for next-token prediction: windows of token ids, in memory or from token files.

Two ways to feed a model, from small to large:

* ``SlidingWindowDataset`` / ``create_dataloader``: a text in memory, tokenized and cut
  into (possibly overlapping) windows; the targets are the inputs shifted by one token.
* ``RandomWindowBatches`` draws random windows from a token array (a split of token files,
  memory-mapped by ``llmscratch.text.corpus.load_token_split``), one reproducible, resumable
  stream per distributed rank. Nothing has to fit in memory.

And the split every model of the course is scored on: ``held_out_moby_dick``, the last tenth of the novel
(``moby_dick_training_text``, the rest, is what the bundled model learned).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from llmscratch.assets import read_moby_dick
from llmscratch.text.corpus import Tokenizer


class SlidingWindowDataset(Dataset):
    """Windows of ``max_length`` tokens starting every ``stride`` tokens, with next-token targets."""

    def __init__(self, token_ids: Sequence[int] | torch.Tensor, max_length: int, stride: int):
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        self.token_ids = torch.as_tensor(token_ids, dtype=torch.long)  # (N,)
        n_tokens = len(self.token_ids)
        # A window needs max_length inputs plus one more token: the target of its last input.
        if n_tokens < max_length + 1:
            raise ValueError(
                f"got {n_tokens} tokens, but one window of max_length={max_length} needs "
                f"at least {max_length + 1} (the inputs plus one target)"
            )
        self.max_length = max_length
        self.stride = stride
        # Starts 0, stride, 2 * stride, ... while start + max_length + 1 <= n_tokens.
        self.n_windows = (n_tokens - max_length - 1) // stride + 1

    def __len__(self) -> int:
        return self.n_windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.n_windows:
            raise IndexError(f"window index {index} is out of range for {self.n_windows} windows")
        start = index * self.stride
        window = self.token_ids[start : start + self.max_length + 1]  # (max_length + 1,)
        return window[:-1], window[1:]  # (max_length,), (max_length,)


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """``text`` cut by characters into its first ``1 - val_fraction`` and its last ``val_fraction``.

    The train/validation split of the chapter scripts (as nanoGPT's character-level recipe cuts);
    the held-out tenth of Moby-Dick that every model of the course is scored on is its second part.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    cut = int(len(text) * (1 - val_fraction))
    return text[:cut], text[cut:]


def create_dataloader(
    text: str,
    tokenizer: Tokenizer,
    batch_size: int = 4,
    max_length: int = 256,
    stride: int = 128,
    shuffle: bool = True,
    drop_last: bool = True,
    num_workers: int = 0,
    seed: int = 0,
) -> DataLoader:
    """Tokenize ``text`` and batch its windows: ``(inputs, targets)``, both (B, max_length)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    dataset = SlidingWindowDataset(tokenizer.encode(text, allowed_special="all"), max_length, stride)
    if drop_last and len(dataset) < batch_size:
        raise ValueError(
            f"the text gives {len(dataset)} windows, fewer than batch_size={batch_size}, so "
            "drop_last=True would leave no batch; use a longer text, a smaller batch_size "
            "or drop_last=False"
        )
    # The loader draws each epoch's order from this generator: same seed, same batches.
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        num_workers=num_workers,
        generator=generator,
    )


class RandomWindowBatches:
    """Endless batches of random windows from a token array: one reproducible stream per (seed, rank).

    ``next()`` gives ``(x, y)``, LongTensors of shape (batch_size, context_length), where
    ``y`` holds the token that follows each position of ``x``.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        context_length: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {context_length}")
        if len(tokens) < context_length + 1:
            raise ValueError(
                f"context_length={context_length} needs at least {context_length + 1} tokens "
                f"(inputs plus one target), but the token array has {len(tokens)}"
            )
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.context_length = context_length
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        # SeedSequence mixes (seed, rank) into unrelated seeds, so ranks never share a stream
        # and (seed=0, rank=1) has nothing to do with (seed=1, rank=0).
        stream_seed = int(np.random.SeedSequence([seed, rank]).generate_state(1, np.uint64)[0])
        self.generator = torch.Generator().manual_seed(stream_seed)

    def __iter__(self) -> RandomWindowBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        # The last start is len - context_length - 1: its window still has a full target.
        n_starts = len(self.tokens) - self.context_length
        starts = torch.randint(n_starts, (self.batch_size,), generator=self.generator)  # (B,)
        length = self.context_length + 1
        windows = np.stack([self.tokens[s : s + length] for s in starts.tolist()])  # (B, T + 1)
        windows = torch.from_numpy(windows.astype(np.int64))
        return windows[:, :-1], windows[:, 1:]  # (B, T), (B, T)

    def _settings(self) -> dict[str, int]:
        return {
            "num_tokens": len(self.tokens),
            "batch_size": self.batch_size,
            "context_length": self.context_length,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this stream stands, for a checkpoint (``torch.save`` can store it)."""
        return {**self._settings(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next batches are those the saved sampler would have given."""
        for key, value in self._settings().items():
            if state[key] != value:
                raise ValueError(
                    f"the saved state has {key}={state[key]}, but this sampler has {key}={value}"
                )
        self.generator.set_state(state["generator"])


# The held-out share of ch04-pretraining/pretrain.py's default run: the last tenth of the novel, on which every
# model of the course is scored (it trained on the rest).
VAL_FRACTION = 0.1


def moby_dick_training_text(val_fraction: float = VAL_FRACTION) -> str:
    """The first ``1 - val_fraction`` of Moby-Dick: the text the bundled model was pretrained on."""
    return split_text(read_moby_dick(), val_fraction)[0]


def held_out_moby_dick(text: str | None = None, val_fraction: float = VAL_FRACTION) -> str:
    """The last ``val_fraction`` of Moby-Dick (or of ``text``), cut by characters as ch04's pretrain.py cuts it."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    text = read_moby_dick() if text is None else text
    return split_text(text, val_fraction)[1]
