"""Files that ship inside llmscratch so that everything runs offline.

Sources, licenses and checksums of each file are in ``NOTICE`` beside this module.
"""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
GPT2_RANKS_PATH = ASSETS_DIR / "gpt2.tiktoken"  # GPT-2 byte-level BPE ranks (MIT)
MOBY_DICK_PATH = ASSETS_DIR / "moby_dick.txt"  # Herman Melville, Moby-Dick (public domain)


def read_moby_dick() -> str:
    """The full text of Moby-Dick (1,190,317 characters), the default corpus."""
    return MOBY_DICK_PATH.read_text(encoding="utf-8")
