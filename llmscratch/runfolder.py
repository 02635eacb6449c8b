"""The folder a script writes its results to: checked before any work, held by one run at a time, never lost.

A run may train for an hour; a problem with where it writes must not show only at the end.
Every script that writes results (pretraining, finetuning, the report card) goes through here:

* ``folder_problem`` / ``file_problem`` before anything starts: the place is, or can be made,
  writable (not a file, not under a file, not read-only). Nothing is created by asking.
* ``claim`` while the run lasts: an advisory lock (``fcntl.flock``) on the folder's ``.lock``
  file, which one process holds at a time. The kernel releases it when the process ends, however
  it ends, so a killed run never leaves the folder stuck. (Without ``fcntl``, e.g. on Windows,
  nothing is locked.)
* ``save_or_rescue`` at the end: if writing the results fails after all (a disk that filled up,
  a folder made read-only meanwhile), they are written to a rescue folder instead, and the error
  names it: the work is not thrown away.
"""

import contextlib
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks here
    fcntl = None

LOCK_FILE = ".lock"


class FolderInUse(ValueError):
    """Another process holds the run folder."""


class SaveFailed(OSError):
    """The results could not be written where asked; the message says where they are (or that they are lost)."""

    def __str__(self) -> str:
        return self.strerror


# --------------------------------------------------------------------------- before any work
def folder_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be (made into) a folder this process writes in, or None. Creates nothing."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return "is a file, not a folder"
    existing = _nearest_existing(path)
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):  # also false on a read-only filesystem
        return f"{existing} is not writable (read-only filesystem or no permission)"
    return None


def file_problem(path: str | os.PathLike) -> str | None:
    """Why a file cannot be written at ``path`` (missing folders are made), or None. Creates nothing."""
    path = Path(path)
    if path.is_dir():
        return "is a folder; give a file name"
    if path.exists() and not path.is_file():
        return "is not a regular file"
    if problem := folder_problem(path.parent):
        return f"its folder {path.parent} {problem}" if path.parent.exists() else problem
    if path.exists() and not os.access(path, os.W_OK):
        return "exists and is not writable"
    return None


def _nearest_existing(path: Path) -> Path:
    return next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())


def same_folder(folder: str | os.PathLike, model: str | os.PathLike) -> bool:
    """True when ``folder`` is where the model file ``model`` lives (or is the model's folder itself)."""
    model = Path(model)
    model_folder = model if model.is_dir() else model.parent
    return Path(folder).resolve() == model_folder.resolve()


def present(folder: str | os.PathLike, names: Iterable[str]) -> list[str]:
    """The names among ``names`` that exist in ``folder`` (files or folders)."""
    return [name for name in names if (Path(folder) / name).exists()]


# --------------------------------------------------------------------------- while the run lasts
@contextlib.contextmanager
def claim(folder: str | os.PathLike) -> Iterator[Path]:
    """Hold ``folder`` (made if missing) for this process while the block runs.

    FolderInUse, naming the holder, if another process holds it. On leaving, the lock file goes;
    a folder this call made and that is still empty goes too (a run refused early leaves nothing).
    """
    folder = Path(folder)
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    lock = _lock(folder / LOCK_FILE)
    try:
        yield folder
    finally:
        _unlock(folder / LOCK_FILE, lock)
        if made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty


def _lock(path: Path) -> int | None:
    """A descriptor of ``path`` holding its exclusive lock (None without fcntl)."""
    if fcntl is None:
        return None
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise FolderInUse(f"{path.parent} is in use by another run ({holder}); wait for it to finish, or "
                              f"choose another folder") from None
        # The holder before us may have deleted the file as it let go: then we locked a file nobody
        # else will open. Lock the file that is at the path now.
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"process {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
             .encode())
    return fd


def _unlock(path: Path, fd: int | None) -> None:
    if fd is None:
        return
    with contextlib.suppress(OSError):
        path.unlink()  # before letting go, so that no one locks a file about to vanish
    os.close(fd)


# --------------------------------------------------------------------------- at the end
def save_or_rescue(folder: str | os.PathLike, save: Callable[[Path], None], what: str = "the results") -> None:
    """``save(folder)``; if that fails with an OSError, ``save`` into a rescue folder and raise SaveFailed naming it.

    The rescue folder is new, beside the working directory's other files (``NAME-rescued-TIME-XXXX``),
    or in the system's temporary folder if that fails too. SaveFailed says where ``what`` went,
    or that no place would take it.
    """
    folder = Path(folder)
    try:
        save(folder)
        return
    except OSError as err:
        failure = err
    stamp = time.strftime("%Y%m%d-%H%M%S")
    tried = []
    for parent in (Path.cwd(), Path(tempfile.gettempdir())):
        if parent.resolve() in tried:
            continue
        tried.append(parent.resolve())
        try:  # a new folder, never one that holds another run's rescue
            rescue = Path(tempfile.mkdtemp(prefix=f"{folder.name or 'run'}-rescued-{stamp}-", dir=parent))
        except OSError:
            continue
        try:
            save(rescue)
        except OSError:
            shutil.rmtree(rescue, ignore_errors=True)
            continue
        raise SaveFailed(failure.errno, f"could not write {what} to {folder} ({failure}); saved to {rescue} "
                                        f"instead") from failure
    raise SaveFailed(failure.errno, f"could not write {what} to {folder} ({failure}), nor to a rescue folder in "
                                    f"{' or '.join(map(str, tried))}: lost") from failure
