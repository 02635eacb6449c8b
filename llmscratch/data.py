"""Training data for next-token prediction: sliding windows in memory, token files on disk.

Two ways to feed a model, from small to large:

* ``SlidingWindowDataset`` / ``create_dataloader``: a text in memory, tokenized and cut
  into (possibly overlapping) windows; the targets are the inputs shifted by one token.
* ``prepare_token_files`` writes ``train.bin`` / ``val.bin`` (flat arrays of token ids)
  and ``meta.json`` once; ``load_token_split`` memory-maps a split, and
  ``RandomWindowBatches`` draws random windows from it, one reproducible, resumable
  stream per distributed rank. Nothing has to fit in memory.
"""

from __future__ import annotations

import codecs
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from llmscratch.atomic import make_temporary_folder, remove_stale_temporaries

SPLITS = ("train", "val")
META_FILE = "meta.json"


class Tokenizer(Protocol):
    """What this module needs of a tokenizer; ``tiktoken.Encoding`` and ``BPETokenizer`` fit.

    ``eot_token`` (id of ``<|endoftext|>``) and ``name`` are optional and read with getattr.
    """

    @property
    def n_vocab(self) -> int: ...

    def encode(self, text: str, *, allowed_special: Any = ...) -> list[int]: ...


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


def prepare_token_files(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    out_dir: str | os.PathLike,
    tokenizer: Tokenizer,
    val_fraction: float = 0.1,
    block_chars: int = 1 << 20,
) -> dict[str, Any]:
    """Tokenize text files into ``out_dir``: train.bin, val.bin and meta.json; return the metadata.

    Each file is a document; documents are joined by the tokenizer's end-of-text id when it
    has one. The validation split is the last ``val_fraction`` of the whole corpus's tokens
    (with several files, mostly the last ones), as in taking the end of a book. Every input
    is checked first and the files are written aside: a failure leaves ``out_dir`` as it was.
    """
    paths = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    if not paths:
        raise ValueError("paths is empty: prepare_token_files needs at least one text file")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if block_chars < 1:
        raise ValueError(f"block_chars must be >= 1, got {block_chars}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out_dir {out_dir} is a file, not a folder")
    for path in paths:
        check_text_file(path)
    # Written in a folder of its own inside out_dir (the same filesystem: the renames are atomic),
    # named .prepare.<pid>.<8 hex digits>.tmp; one that a killed prepare left is deleted first.
    work_name = out_dir / "prepare"
    remove_stale_temporaries(work_name)
    work = make_temporary_folder(work_name)
    try:
        meta = _write_token_files(paths, work, tokenizer, val_fraction, block_chars)
        # meta.json goes first and comes back last: a folder with a meta.json holds complete token files.
        (out_dir / META_FILE).unlink(missing_ok=True)
        for split in SPLITS:
            os.replace(work / f"{split}.bin", out_dir / f"{split}.bin")
        os.replace(work / META_FILE, out_dir / META_FILE)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return meta


def input_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a file to read (no such file, a folder, a device or pipe), or None."""
    path = Path(path)
    if path.is_file():
        return None
    return "a folder" if path.is_dir() else "not a regular file (a device or pipe)" if path.exists() else \
        "no such file"


def check_text_file(path: str | os.PathLike, name: str = "") -> None:
    """ValueError naming ``path`` (after ``name``, e.g. "--data") unless it is a regular file of UTF-8 text.

    Read through once, in blocks. Text never holds a NUL byte: a file that does is binary, or
    UTF-16 without a byte-order mark (ASCII letters with a NUL beside each pass as UTF-8, and a
    model would learn the NULs); UTF-16 with its byte-order mark is named as such.
    """
    path = Path(path)
    label = f"{name} {path}" if name else str(path)
    if problem := input_problem(path):
        raise ValueError(f"{label}: {problem}; expected a UTF-8 text file")
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as file:
        while block := file.read(1 << 20):
            if offset == 0 and block.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
                raise ValueError(f"{label} is UTF-16 text (it starts with UTF-16's byte-order mark); convert it "
                                 f"to UTF-8 (e.g. iconv -f UTF-16 -t UTF-8)")
            if (nul := block.find(b"\0")) >= 0:
                utf16 = block[1:200:2].count(0) > 40 or block[0:200:2].count(0) > 40  # every other byte
                looks = "UTF-16 text without a byte-order mark" if utf16 else "binary data"
                raise ValueError(f"{label} holds a NUL byte (byte {offset + nul:,}): it looks like {looks}, not "
                                 f"UTF-8 text{'; convert it to UTF-8 (e.g. iconv -f UTF-16LE -t UTF-8)' * utf16}")
            try:
                decoder.decode(block)
            except UnicodeDecodeError as err:
                raise ValueError(f"{label} is not UTF-8 text (near byte {offset + err.start:,}: {err.reason}); "
                                 f"expected a UTF-8 text file") from None
            offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise ValueError(f"{label} is not UTF-8 text (it ends inside a character); expected a UTF-8 text file") \
            from None


def read_text_file(path: str | os.PathLike, name: str = "") -> str:
    """The text of ``path`` once ``check_text_file`` accepts it (a UTF-8 byte-order mark is dropped).

    A text of more than a quarter of the machine's memory is refused too: held as a Python
    string and then as tokens, it would not fit; ``prepare_token_files`` streams such a corpus.
    """
    check_text_file(path, name)
    size, memory = Path(path).stat().st_size, _physical_memory()
    if memory is not None and size > memory // 4:
        raise ValueError(f"{name + ' ' if name else ''}{path} is {size / 2**30:.1f} GiB, more than a quarter of this "
                         f"machine's {memory / 2**30:.0f} GiB of memory; tokenize it once into token files "
                         f"(llmscratch.data.prepare_token_files) and train on their folder")
    return Path(path).read_text(encoding="utf-8-sig")


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system that says
        return None


def _write_token_files(paths: list[Path], out_dir: Path, tokenizer: Tokenizer, val_fraction: float,
                       block_chars: int) -> dict[str, Any]:
    """Write train.bin, val.bin and then meta.json into the (new, empty) folder ``out_dir``."""
    n_vocab = tokenizer.n_vocab
    # uint16 halves the file (and the disk reads) whenever every id fits in 16 bits.
    dtype = np.dtype(np.uint16 if n_vocab <= 2**16 else np.uint32)
    eot_token = getattr(tokenizer, "eot_token", None)
    train_path, val_path = out_dir / "train.bin", out_dir / "val.bin"

    # Stream every token into train.bin; its tail moves to val.bin once the total is known.
    n_tokens = 0
    with open(train_path, "wb") as out:
        for index, path in enumerate(paths):
            if index > 0 and eot_token is not None:
                n_tokens += _write_ids(out, [eot_token], dtype, n_vocab, path)
            for text in _text_blocks(path, block_chars):
                ids = tokenizer.encode(text, allowed_special="all")
                n_tokens += _write_ids(out, ids, dtype, n_vocab, path)

    n_val = round(n_tokens * val_fraction)
    n_train = n_tokens - n_val
    if n_train < 1 or n_val < 1:
        raise ValueError(
            f"{n_tokens} tokens with val_fraction={val_fraction} give {n_train} train and "
            f"{n_val} val tokens; each split needs at least 1"
        )
    with open(train_path, "rb") as source, open(val_path, "wb") as target:
        source.seek(n_train * dtype.itemsize)
        shutil.copyfileobj(source, target)
    os.truncate(train_path, n_train * dtype.itemsize)

    meta = {
        "tokenizer": getattr(tokenizer, "name", type(tokenizer).__name__),
        "vocab_size": n_vocab,
        "eot_token": eot_token,
        "dtype": dtype.name,
        "num_tokens": {"train": n_train, "val": n_val},
        "val_fraction": val_fraction,
        "source_files": [str(path) for path in paths],
    }
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def _write_ids(out: BinaryIO, ids: list[int], dtype: np.dtype, n_vocab: int, path: Path) -> int:
    """Append ``ids`` to ``out`` as ``dtype``, checking they are in the vocabulary; return the count."""
    array = np.asarray(ids, dtype=np.int64)  # (n,)
    # A wrong id would wrap around silently when cast to uint16.
    if array.size and (array.min() < 0 or array.max() >= n_vocab):
        bad = array.min() if array.min() < 0 else array.max()
        raise ValueError(f"token id {bad} (from {path}) is outside the vocabulary of {n_vocab} ids")
    array.astype(dtype).tofile(out)
    return array.size


def _text_blocks(path: Path, block_chars: int) -> Iterator[str]:
    """The text of ``path`` in blocks of about ``block_chars`` characters, cut only between lines.

    A cut goes only between a line ending in "<non-space>\\n" and a line starting with a
    non-space: GPT-2 and GPT-4 style pre-tokenizers make that lone "\\n" a chunk of its own,
    so the blocks encode to exactly the tokens of the whole text. A file without such a
    place (one giant line) is read as one block.
    """
    lines: list[str] = []
    size = 0
    with open(path, encoding="utf-8") as file:
        for line in file:
            if size >= block_chars and _can_cut(lines[-1], line):
                yield "".join(lines)
                lines, size = [], 0
            lines.append(line)
            size += len(line)
    if lines:
        yield "".join(lines)


def _can_cut(previous_line: str, next_line: str) -> bool:
    # "a\n" | "b" is safe; "a\n\n" | "b" is not: alone, a final "\n\n" becomes one token.
    return len(previous_line) >= 2 and not previous_line[-2].isspace() and not next_line[0].isspace()


def load_token_meta(folder: str | os.PathLike) -> dict[str, Any]:
    """Read and check the ``meta.json`` that ``prepare_token_files`` wrote in ``folder``."""
    path = Path(folder) / META_FILE
    if not path.is_file():
        raise ValueError(f"no {path}: run prepare_token_files on the text files first")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        dtype, counts, vocab_size = meta["dtype"], meta["num_tokens"], meta["vocab_size"]
        valid = dtype in ("uint16", "uint32") and all(
            isinstance(counts[split], int) and counts[split] >= 1 for split in SPLITS
        ) and isinstance(vocab_size, int) and vocab_size >= 1
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is corrupt ({error!r}); run prepare_token_files again") from error
    if not valid:
        raise ValueError(
            f"{path} is corrupt: dtype={dtype!r}, num_tokens={counts!r}, vocab_size={vocab_size!r}; expected "
            f"dtype uint16 or uint32, a positive integer count for each of {SPLITS} and a positive vocab_size"
        )
    return meta


def load_token_split(folder: str | os.PathLike, split: str) -> np.memmap:
    """Memory-map ``train.bin`` or ``val.bin`` of ``folder``: token ids, read from disk on demand."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    meta = load_token_meta(folder)
    dtype = np.dtype(meta["dtype"])
    n_tokens = meta["num_tokens"][split]
    path = Path(folder) / f"{split}.bin"
    n_bytes = path.stat().st_size if path.is_file() else 0
    if n_bytes != n_tokens * dtype.itemsize:
        raise ValueError(
            f"{path} has {n_bytes} bytes, but meta.json promises {n_tokens} {dtype.name} tokens "
            f"({n_tokens * dtype.itemsize} bytes); run prepare_token_files again"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n_tokens,))
    check_token_ids(tokens, meta["vocab_size"], path)
    return tokens


def check_token_ids(tokens: np.ndarray, vocab_size: int, source: str | os.PathLike,
                    block: int = 1 << 24) -> None:
    """ValueError naming ``source`` and the first id outside ``0..vocab_size - 1``, if there is one.

    One pass over the array in blocks: a memory map is read, never copied whole.
    """
    for start in range(0, len(tokens), block):
        ids = np.asarray(tokens[start : start + block])
        if ids.size and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            position = start + int(np.argmax((ids >= vocab_size) | (ids < 0)))
            raise ValueError(
                f"{source} holds token id {int(tokens[position])} at position {position:,}, outside the "
                f"vocabulary of {vocab_size} ids (0..{vocab_size - 1}); were these files made with "
                f"another tokenizer? Run prepare_token_files again"
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
