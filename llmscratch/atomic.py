"""Writing files so that a crash never leaves half of one: the one home of atomic writes.

Everything the package saves (checkpoints, model exports, tokenizers, adapters, caches) goes
through here: the data goes to a temporary file in the same folder, is flushed to disk, and is
then renamed over the target. A reader, or a run resumed after a crash, sees the old file or
the new one, never a mixture. A full disk is reported as such, naming the file and the folder.
"""

import errno
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

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
