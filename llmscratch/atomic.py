"""Writing files so that a crash never leaves half of one: the one home of atomic writes.

Everything the package saves (checkpoints, model exports, tokenizers, adapters, caches) goes
through here: the data goes to a temporary file in the same folder, is flushed to disk, and is
then renamed over the target. A reader, or a run resumed after a crash, sees the old file or
the new one, never a mixture.
"""

import os
import secrets
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)``, flush the file to disk, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh name in the same folder (a rename across filesystems would not be atomic; several
    # processes may write at once); the writer creates the file, so it gets the usual permissions.
    tmp = str(path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"))
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
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
