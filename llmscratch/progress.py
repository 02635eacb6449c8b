"""Progress bars: the one home of tqdm in the package (tqdm is imported only when a bar is shown)."""

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int, description: str, unit: str, initial: int = 0) -> Iterator:
    """A tqdm bar counting to ``total`` for the block, or None when not ``enabled`` (tqdm is then not imported)."""
    if not enabled:
        yield None
        return
    from tqdm.auto import tqdm  # imported here: the package imports without it

    with tqdm(total=total, initial=initial, desc=description, unit=unit) as bar:
        yield bar
