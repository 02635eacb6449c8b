"""Files in and out, so that nothing is lost and nothing wrong is used: atomic writes, checked reads.

Writes: everything the package saves (checkpoints, model exports, tokenizers, adapters, caches) goes
through ``write_atomically``: the data goes to a temporary file in the same folder, is flushed to disk,
and is then renamed over the target. A reader, or a run resumed after a crash, sees the old file or
the new one, never a mixture. A full disk is reported as such, naming the file and the folder.

Reads: tensor files are checked before their contents are used (a safetensors file we wrote against
the sha256 in its metadata, a ``torch.save`` file against the CRC-32 of every zip entry, weights for
being floating point and finite), and JSON and JSON-lines files name the file and line that is wrong.
"""

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import zipfile
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

# --------------------------------------------------------------------------- atomic writes
# What torch.save says when the disk fills under it (its zip writer reports no errno).
_TORCH_WRITE_FAILURES = ("unexpected pos", "file write failed")


class DiskFullError(OSError):
    """No space was left to write a file; the file that was there before is unchanged."""

    def __str__(self) -> str:
        return self.strerror  # the message alone: it names the file, the folder and what was kept


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)``, flush the file to disk, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh name in the same folder (a rename across filesystems would not be atomic; several
    # processes may write at once).
    tmp = str(_temporary_name(path))
    try:
        write(tmp)
        # The mode of the file it replaces, or the usual one: some writers (safetensors) make 0600 files.
        os.chmod(tmp, _mode_for(path))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if _is_disk_full(err):
            raise _disk_full(path) from err
        raise
    try:  # make the rename itself survive a power cut
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the rename is still atomic


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """``Path(path).write_text(text)`` in UTF-8, atomically."""
    write_atomically(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def write_json_atomically(path: str | os.PathLike, content) -> None:
    """``content`` as indented JSON (one trailing newline) in ``path``, atomically."""
    write_text_atomically(path, json.dumps(content, indent=2) + "\n")


def _mode_for(path: Path) -> int:
    """The permission bits a file written at ``path`` gets: those of the file there now, else 0666 less the umask."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)  # the only way to read it: set it and put it back
        os.umask(umask)
        return 0o666 & ~umask


def _temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def make_temporary_folder(path: str | os.PathLike) -> Path:
    """A new, empty folder beside ``path``, named like ``write_atomically``'s temporaries.

    For work that writes several files and then renames them into place: if the process is
    killed first, ``remove_stale_temporaries(path)`` finds the folder and deletes it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        folder = _temporary_name(path)
        try:
            folder.mkdir()
        except FileExistsError:
            continue  # the same 8 hex digits twice in one process: draw again
        return folder


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Delete the temporaries of ``path`` that killed processes left behind; return them.

    Only files and folders named as ``write_atomically`` and ``make_temporary_folder`` name
    the temporaries of this very ``path``, and only those of processes that no longer run (a
    live writer's are left alone).
    """
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.[0-9a-f]{{8}}\.tmp")
    removed = []
    for candidate in path.parent.iterdir() if path.parent.is_dir() else []:
        match = pattern.fullmatch(candidate.name)
        if not match or _process_runs(int(match.group(1))):
            continue
        if candidate.is_dir() and not candidate.is_symlink():
            shutil.rmtree(candidate, ignore_errors=True)
        elif candidate.is_file():
            candidate.unlink(missing_ok=True)
        else:
            continue
        removed.append(candidate)
    return removed


def _process_runs(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process is not writing anything while it cleans up
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def _is_disk_full(err: BaseException) -> bool:
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(err, RuntimeError) and any(text in str(err) for text in _TORCH_WRITE_FAILURES)


def _disk_full(path: Path) -> DiskFullError:
    folder = path.parent.resolve()
    try:
        free = f"{shutil.disk_usage(folder).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    kept = (f"the previous {path.name} there is kept unchanged" if path.exists()
            else f"no {path.name} was written")
    return DiskFullError(errno.ENOSPC, f"the disk is full: no space left to write {path.name} in {folder} "
                                       f"({free}); {kept}. Free some space and try again")


# --------------------------------------------------------------------------- tensor files, checked
# The metadata entry of the checksum ``write_safetensors`` adds; named for us, so that another
# tool's own "sha256" entry is never mistaken for it.
CHECKSUM_KEY = "llmscratch_sha256"
_DAMAGED = "the file was changed after it was written (disk or copy error)"


def check_zip_checksums(path: str | os.PathLike) -> None:
    """ValueError naming the first entry of a ``torch.save`` file whose bytes do not match its CRC-32.

    A file that is not a zip at all is left for ``torch.load`` to name. Entries stored with a CRC
    of 0 are skipped: ``torch.serialization.set_crc32_options(False)`` writes every one so.
    """
    path = Path(path)
    if not zipfile.is_zipfile(path):
        return
    entry = None
    try:
        with zipfile.ZipFile(path) as archive:
            for entry in archive.infolist():
                if entry.CRC == 0:
                    continue
                with archive.open(entry) as data:  # reading to the end compares the CRC-32
                    while data.read(1 << 24):
                        pass
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:
        where = f"entry {entry.filename.partition('/')[2] or entry.filename}" if entry else "its zip directory"
        what = "fails its checksum" if "CRC" in str(err) else f"is unreadable ({err})"
        raise ValueError(f"{path} is damaged: {where} {what}; {_DAMAGED}; use another copy or an earlier "
                         f"checkpoint") from None


def check_weights(tensors: dict[str, Any], source: str | os.PathLike) -> None:
    """ValueError naming the first tensor in ``tensors`` that is not floating point or not finite.

    Run it on the tensors as a file stores them: loading them into a float model, or ``.to(dtype)``,
    would turn integers into floats without a word.
    """
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{source}: {name}: the file holds a {type(tensor).__name__}, expected a tensor")
        if not tensor.is_floating_point():
            raise ValueError(f"{source}: {name}: the file holds {tensor.dtype} values, "
                             f"expected floating point weights")
        if torch.isfinite(tensor.sum()):  # a NaN or inf anywhere makes the sum one; 25x faster than isfinite()
            continue
        nan, infinite = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
        if nan or infinite:  # else the sum only overflowed (a float16 tensor's can)
            counts = " and ".join(f"{n:,} {kind}" for n, kind in ((nan, "NaN"), (infinite, "infinite")) if n)
            raise ValueError(f"{source}: {name}: the file holds non-finite values ({counts} of "
                             f"{tensor.numel():,}): a model with them computes NaN; the run that wrote them "
                             f"diverged, or the file was edited")


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` (on the CPU) and ``metadata`` as a safetensors file, atomically, with their checksum.

    The checksum (metadata entry ``CHECKSUM_KEY``) covers every other metadata entry and every
    tensor's name, dtype, shape and bytes, so that ``read_safetensors`` finds any bit that changes.
    """
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    metadata = {**metadata, CHECKSUM_KEY: _content_digest(metadata, sorted(tensors.items()))}
    write_atomically(Path(path), lambda tmp: save_file(tensors, tmp, metadata=metadata))


def _content_digest(metadata: dict[str, str], tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 of the metadata (less the checksum) and of each (name, tensor), taken in name order.

    Each item is a line of JSON, then the tensor's bytes (as many as its dtype and shape say), so
    no two different contents give the same stream.
    """
    digest = hashlib.sha256()
    entries = {key: value for key, value in sorted(metadata.items()) if key != CHECKSUM_KEY}
    digest.update(json.dumps(entries).encode() + b"\n")
    for name, tensor in tensors:
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode() + b"\n")
        # As bytes: bfloat16 has no numpy dtype, and bytes are what a flipped bit changes.
        digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def read_safetensors(path: str | os.PathLike, tensors: bool = True) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The metadata and tensors (on the CPU; none if ``tensors`` is false) of a safetensors file.

    A missing, truncated or foreign file is a ValueError naming it: opening checks that the
    header is whole and that the file covers every tensor it lists. Read with its tensors, a
    file that carries a checksum (``write_safetensors``) is checked against it; files without
    one (Hugging Face downloads, older exports) load as they are. The metadata alone (``tensors``
    false) is a quick look, unchecked: the checksum needs every tensor's bytes.
    """
    path = Path(path)
    with _opened_safetensors(path) as f:
        metadata = f.metadata() or {}
        loaded = {name: f.get_tensor(name) for name in sorted(f.keys())} if tensors else {}
    checksum = metadata.get(CHECKSUM_KEY) if tensors else None
    if checksum is not None and checksum != _content_digest(metadata, loaded.items()):  # loaded: in name order
        raise ValueError(f"{path} is damaged: its tensors or metadata no longer match the checksum written with "
                         f"them ({CHECKSUM_KEY}); {_DAMAGED}; use another copy or write it again")
    return metadata, loaded


def read_safetensors_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor in a safetensors file, from its header alone: no tensor is read or allocated.

    A missing, truncated or foreign file is a ValueError naming it, as in ``read_safetensors``.
    """
    with _opened_safetensors(Path(path)) as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


@contextlib.contextmanager
def _opened_safetensors(path: Path):
    """``safe_open(path)``; a missing, truncated or foreign file (opening checks that the header is whole and that
    the file covers every tensor it lists) is a ValueError naming it."""
    if not path.is_file():
        raise ValueError(f"no safetensors file at {path}")
    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as err:  # e.g. "incomplete metadata, file not fully covered"
        raise ValueError(f"{path} is not a readable safetensors file (truncated, corrupt, or not a safetensors "
                         f"file at all: {err}); copy or download it again") from None


# --------------------------------------------------------------------------- text and JSON files, checked
def input_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a file to read (no such file, a folder, a device or pipe), or None."""
    path = Path(path)
    if path.is_file():
        return None
    return "a folder" if path.is_dir() else "not a regular file (a device or pipe)" if path.exists() else \
        "no such file"


def parse_json_lines(text: str, source: str | os.PathLike, expected: str = "one JSON value per line",
                     skip_malformed: bool = False) -> list:
    """The JSON value of each non-blank line of ``text`` (JSON Lines), read from ``source``.

    A line that is not JSON is a ValueError naming ``source``, the line's number and what the file
    should hold (``expected``); with ``skip_malformed`` it is left out instead (a run killed while
    appending a record leaves a partial last line).
    """
    values = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            values.append(json.loads(line))
        except JSON_ERRORS as err:
            if not skip_malformed:
                raise ValueError(f"{source}, line {number}: not JSON ({err}); expected {expected}") from None
    return values


# What json.loads raises on text that is not JSON, or JSON nested deeper than Python's recursion limit allows.
JSON_ERRORS = (json.JSONDecodeError, RecursionError)


def read_json_object(path: Path) -> dict:
    """One of a Hugging Face folder's JSON files (config.json, tokenizer.json, ...) as a dict; a missing or
    malformed file is a ValueError naming it."""
    try:
        content = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (UnicodeDecodeError, *JSON_ERRORS) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    except OSError as err:  # a folder, a dangling link, no permission
        raise ValueError(f"{path} cannot be read as a JSON file: {err.strerror or err}") from None
    if not isinstance(content, dict):
        raise ValueError(f"{path} should hold a JSON object, got {type(content).__name__}")
    return content
