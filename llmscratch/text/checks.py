"""What a tokenizer is made from, checked where it enters: its merges, byte order, special tokens, split
pattern and files.

``BPETokenizer`` calls these at its doors (the constructor, ``train``, ``from_json``) and trusts its parts
after that, so that the tokenizer reads like the chapter that builds it. Each check is a ValueError naming
the bad value and what was expected.
"""

import json
import os
from collections import Counter
from collections.abc import Collection
from pathlib import Path
from typing import Any

import regex

__all__ = ["NORMALIZATIONS", "check_parts", "check_shown_merges", "check_special_tokens", "check_vocab_size",
           "compile_split_pattern", "parse_tokenizer_json", "read_document", "read_tokenizer_text", "split_covering"]

NORMALIZATIONS = ("NFC", "NFKC", "NFD", "NFKD")  # the Unicode forms a text may be put in before it is split
# A split pattern must cover this text without a gap, or encoding would drop text silently.
_PATTERN_PROBE = ("Hello, world! It's 2026: 3.14 ünïcödé 中文 日本語 한국어 😀👩‍👩‍👧 e\u0301 "
                  "a_b-c.d/e\\f (x) [y] 'q' \"q\" \t\n\r\n  \x00\x1b\x7f\u200b\u2028 end ")


def check_special_tokens(tokens: Collection[str]) -> list[str]:
    """The special tokens as a list; an empty, repeated or non-string one is a ValueError."""
    if isinstance(tokens, str):
        raise ValueError(f"special tokens must be a list of strings, got the string {tokens!r}")
    tokens = list(tokens)
    for token in tokens:
        if not isinstance(token, str) or not token:
            raise ValueError(f"special tokens must be non-empty strings, got {token!r} in {tokens}")
    repeated = [token for token, count in Counter(tokens).items() if count > 1]
    if repeated:
        raise ValueError(f"special tokens must be distinct: {repeated} appear more than once in {tokens}")
    return tokens


def check_parts(merges: list[tuple[int, int]], special_tokens: dict[str, int], byte_order: list[int] | None,
                normalization: str | None, bos_token: str | None, eos_token: str | None,
                added_text: Collection[str]) -> None:
    """A byte-level BPE tokenizer's parts (see ``BPETokenizer``): each merge joins two ids made before it, once;
    the byte order is a permutation of the 256 bytes; the special tokens' ids follow the merges; the roles and
    added text name special tokens."""
    if normalization not in (None, *NORMALIZATIONS):
        raise ValueError(f"normalization must be None, 'NFC', 'NFKC', 'NFD' or 'NFKD', got {normalization!r}")
    if byte_order is not None and sorted(byte_order) != list(range(256)):
        raise ValueError("byte_order must be a permutation of the 256 byte values")
    seen: dict[tuple[int, int], int] = {}
    for index, (left, right) in enumerate(merges):
        if not (0 <= left < 256 + index and 0 <= right < 256 + index):
            raise ValueError(f"merge {index} ({left}, {right}) uses an id not yet defined")
        if (earlier := seen.setdefault((left, right), index)) != index:
            raise ValueError(f"merge {index} ({left}, {right}) repeats merge {earlier}; each pair is merged once")
    check_special_tokens(list(special_tokens))
    first = 256 + len(merges)
    expected = list(range(first, first + len(special_tokens)))
    if sorted(special_tokens.values()) != expected:
        raise ValueError(f"special token ids {sorted(special_tokens.values())} must follow the merges, i.e. be "
                         f"{expected}")
    for role, token in (("bos_token", bos_token), ("eos_token", eos_token)):
        if token is not None and token not in special_tokens:
            raise ValueError(f"{role} {token!r} is not one of the special tokens {list(special_tokens)}")
    if unknown := sorted(set(check_special_tokens(added_text)) - set(special_tokens)):
        raise ValueError(f"added_text {unknown} are not among the special tokens {list(special_tokens)}")


def check_vocab_size(vocab_size: int, special_tokens: Collection[str]) -> list[str]:
    """The special tokens as a list, once ``vocab_size`` leaves room for the 256 bytes and them."""
    special_tokens = check_special_tokens(special_tokens)
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(f"vocab_size={vocab_size} is too small: it must be at least 256 (bytes) + "
                         f"{len(special_tokens)} (special tokens) = {256 + len(special_tokens)}")
    return special_tokens


def compile_split_pattern(pattern: str) -> regex.Pattern:
    """Compile a pre-split pattern; one that is invalid, has groups or skips text is a ValueError."""
    try:
        splitter = regex.compile(pattern)
    except (regex.error, TypeError) as err:
        raise ValueError(f"the split pattern {pattern!r} is not a regular expression: {err}") from None
    if splitter.groups:
        raise ValueError(f"the split pattern {pattern!r} has capture groups, so findall would return "
                         f"the groups instead of the chunks: write each group as (?:...)")
    split_covering(splitter, _PATTERN_PROBE, "a test text")
    return splitter


def split_covering(splitter: regex.Pattern, text: str, text_name: str = "the text") -> list[str]:
    """``splitter.findall(text)``, checked to cover every character: text is never dropped silently."""
    chunks = splitter.findall(text)
    if sum(map(len, chunks)) != len(text):  # matches never overlap, so equal lengths mean no gap
        position = 0
        for match in splitter.finditer(text):
            if match.start() != position:
                break
            position = match.end()
        raise ValueError(
            f"the split pattern {splitter.pattern!r} skips {text[position:position + 10]!r} at "
            f"character {position} of {text_name}; a split pattern must match every character "
            f"(a last alternative such as |(?s:.) makes sure of it)"
        )
    return chunks


# --------------------------------------------------------------------------- files
def read_tokenizer_text(path: str | os.PathLike) -> str:
    """The text of a tokenizer file; one that is not UTF-8 is a ValueError naming it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not a tokenizer file (not UTF-8: {err})") from None


def parse_tokenizer_json(text: str, source: str) -> Any:
    """The JSON value of a tokenizer file's text; text that is not JSON is a ValueError naming ``source``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{source} is not a tokenizer file (invalid JSON: {err})") from None


def read_document(text: str, source: str, file_format: str, version: int) -> tuple[dict[str, Any], list[str]]:
    """The constructor arguments a ``BPETokenizer.to_json`` document holds, and the token each merge is said to
    make (to be compared with what it makes); a document of another kind or a damaged one is a ValueError."""
    data = parse_tokenizer_json(text, source)
    if not isinstance(data, dict) or data.get("format") != file_format:
        raise ValueError(f"{source} is not an {file_format} file (format field missing or wrong; "
                         f"llmscratch.text.hf_tokenizer.load_tokenizer reads every kind of tokenizer file)")
    if data.get("version") != version:
        raise ValueError(f"{source} has version {data.get('version')!r}; this llmscratch reads version {version}")
    try:
        merges = [(int(left), int(right)) for left, right, _ in data["merges"]]
        shown = [str(made) for _, _, made in data["merges"]]
        fields = dict(merges=merges, pattern=data["pattern"], special_tokens=dict(data["special_tokens"]),
                      byte_order=data["byte_order"], name=data["name"], normalization=data.get("normalization"),
                      whole_chunks=data.get("whole_chunks", False), bos_token=data.get("bos_token"),
                      eos_token=data.get("eos_token"), added_text=data.get("added_text", ()))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{source} is a corrupt tokenizer file: {err!r}") from None
    return fields, shown


def check_shown_merges(shown: list[str], made: list[str], source: str) -> None:
    """ValueError naming the first merge whose token, as the file shows it, is not the one the merge makes."""
    if (index := next((i for i, (said, was) in enumerate(zip(shown, made)) if said != was), None)) is not None:
        raise ValueError(f"{source} is a corrupt tokenizer file: merge {index} makes {made[index]!r}, the file "
                         f"says {shown[index]!r}")
