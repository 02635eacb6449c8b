"""The corpus a model learns from, as files: text files checked and read, and token files.

* ``check_text_file`` / ``read_text_file``: a UTF-8 text file, or a ValueError naming it and what is wrong.
* ``prepare_token_files`` tokenizes text files once into ``train.bin`` / ``val.bin`` (flat arrays of
  token ids) and ``meta.json``; ``load_token_split`` memory-maps a split (``llmscratch.text.data`` draws
  windows from it). Every id is checked against the vocabulary once, where it enters: ``meta.json``
  records each file's largest id, so a load compares two numbers instead of reading the corpus.
"""

from __future__ import annotations

import codecs
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np

from llmscratch.files import input_problem, make_temporary_folder, remove_stale_temporaries, write_json_atomically

SPLITS = ("train", "val")
META_FILE = "meta.json"


class Tokenizer(Protocol):
    """What this module needs of a tokenizer; ``tiktoken.Encoding`` and ``BPETokenizer`` fit.

    ``eot_token`` (id of ``<|endoftext|>``) and ``name`` are optional and read with getattr.
    """

    @property
    def n_vocab(self) -> int: ...

    def encode(self, text: str, *, allowed_special: Any = ...) -> list[int]: ...


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
                         f"(llmscratch.text.corpus.prepare_token_files) and train on their folder")
    return Path(path).read_text(encoding="utf-8-sig")


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system that says
        return None


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

    counts = {"train": n_train, "val": n_val}
    meta = {
        "tokenizer": getattr(tokenizer, "name", type(tokenizer).__name__),
        "vocab_size": n_vocab,
        "eot_token": eot_token,
        "dtype": dtype.name,
        "num_tokens": counts,
        "val_fraction": val_fraction,
        "source_files": [str(path) for path in paths],
        "checked": {split: _check_file(out_dir / f"{split}.bin", dtype, count, n_vocab)
                    for split, count in counts.items()},
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
    """Memory-map ``train.bin`` or ``val.bin`` of ``folder``: token ids, read from disk on demand.

    Its ids are not read here: meta.json records the largest (``prepare_token_files`` checked them all),
    compared with the vocabulary. A file without that record (an older version's, or one changed
    since) is read through once, and the record added to meta.json.
    """
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
    vocab_size, largest = meta["vocab_size"], _recorded_largest_id(meta, split, path)
    if largest is None:  # made by an older version, or changed since its check: read it now, and record that
        _record_check(Path(folder), meta, split, _check_file(path, dtype, n_tokens, vocab_size))
    elif largest >= vocab_size:
        raise ValueError(_outside_vocabulary(path, largest, "(its largest, as meta.json records)", vocab_size))
    return np.memmap(path, dtype=dtype, mode="r", shape=(n_tokens,))


def check_token_ids(tokens: np.ndarray, vocab_size: int, source: str | os.PathLike,
                    block: int = 1 << 24) -> int:
    """The largest id of ``tokens``; ValueError naming ``source`` and the first id outside ``0..vocab_size - 1``.

    One pass over the array in blocks: a memory map is read, never copied whole.
    """
    largest = -1
    for start in range(0, len(tokens), block):
        ids = np.asarray(tokens[start : start + block])
        high = int(ids.max())
        if high >= vocab_size or int(ids.min()) < 0:
            position = start + int(np.argmax((ids >= vocab_size) | (ids < 0)))
            raise ValueError(_outside_vocabulary(source, int(tokens[position]), f"at position {position:,}",
                                                 vocab_size))
        largest = max(largest, high)
    return largest


def _outside_vocabulary(source: str | os.PathLike, token_id: int, where: str, vocab_size: int) -> str:
    return (f"{source} holds token id {token_id} {where}, outside the vocabulary of {vocab_size} ids "
            f"(0..{vocab_size - 1}); were these files made with another tokenizer? Run prepare_token_files again")


def _check_file(path: Path, dtype: np.dtype, n_tokens: int, vocab_size: int) -> dict[str, int]:
    """Read the ids of ``path`` once (``check_token_ids``): its largest id, tied to the file as it is now."""
    mtime_ns = path.stat().st_mtime_ns  # taken first: a change during the reading makes the record stale
    largest = check_token_ids(np.memmap(path, dtype=dtype, mode="r", shape=(n_tokens,)), vocab_size, path)
    return {"largest_id": largest, "mtime_ns": mtime_ns}


def _recorded_largest_id(meta: dict[str, Any], split: str, path: Path) -> int | None:
    """The largest id that meta.json records for ``path``, or None if it has none for the file as it is now."""
    try:
        fact = meta["checked"][split]
        if fact["mtime_ns"] == path.stat().st_mtime_ns and isinstance(fact["largest_id"], int):
            return fact["largest_id"]
    except (KeyError, TypeError):  # written before ids were recorded, or a damaged record: read the file
        pass
    return None


def _record_check(folder: Path, meta: dict[str, Any], split: str, fact: dict[str, int]) -> None:
    """Add ``fact`` to meta.json, unless the file changed since ``meta`` was read (a prepare running again) or
    cannot be written (a read-only folder is then read at every load)."""
    path = folder / META_FILE
    try:
        now = json.loads(path.read_text(encoding="utf-8"))
        if {**now, "checked": None} == {**meta, "checked": None}:
            checked = now.get("checked") if isinstance(now.get("checked"), dict) else {}
            write_json_atomically(path, {**now, "checked": {**checked, split: fact}})
    except (OSError, ValueError, TypeError):
        pass
