"""What a tokenizer is made from, checked where it enters: its merges, byte order, special tokens, split
pattern and files.

``BPETokenizer`` calls these at its doors (the constructor, ``train``, ``from_json``) and trusts its parts
after that, so that the tokenizer reads like the chapter that builds it. Each check is a ValueError naming
the bad value and what was expected.
"""

import functools
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

import regex

__all__ = ["LINEAR_PATTERNS", "NORMALIZATIONS", "check_hf_tokenizer", "check_parts", "check_shown_merges",
           "check_special_tokens", "check_tokenizer_config", "check_vocab_size", "compile_split_pattern",
           "parse_tokenizer_json", "read_document", "read_tokenizer_text", "split_covering"]

NORMALIZATIONS = ("NFC", "NFKC", "NFD", "NFKD")  # the Unicode forms a text may be put in before it is split
# A split pattern must cover this text without a gap, or encoding would drop text silently.
_PATTERN_PROBE = ("Hello, world! It's 2026: 3.14 ünïcödé 中文 日本語 한국어 😀👩‍👩‍👧 e\u0301 "
                  "a_b-c.d/e\\f (x) [y] 'q' \"q\" \t\n\r\n  \x00\x1b\x7f\u200b\u2028 end ")
# The split patterns of the tokenizers the package reads, which split in linear time: they run unbounded. Any
# other pattern is first tried on texts that make a backtracking pattern blow up, and each split it makes has a
# time limit proportional to the text.
LINEAR_PATTERNS = frozenset({
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",  # GPT-2's
    *(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|" + numbers  # Llama 3's, Qwen2's and Qwen3's
      + r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+" for numbers in (r"\p{N}{1,3}", r"\p{N}")),
})
_PROBE_SECONDS = 1.0  # all the tries of a new pattern together
_SPLIT_SECONDS, _SPLIT_SECONDS_PER_CHAR = 1.0, 2e-6  # a split's limit: tens of times what it needs


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
    """Compile a pre-split pattern; one that is invalid, has groups, skips text or backtracks catastrophically
    is a ValueError."""
    try:
        splitter = regex.compile(pattern)
    except (regex.error, TypeError) as err:
        raise ValueError(f"the split pattern {pattern!r} is not a regular expression: {err}") from None
    if splitter.groups:
        raise ValueError(f"the split pattern {pattern!r} has capture groups, so findall would return "
                         f"the groups instead of the chunks: write each group as (?:...)")
    split_covering(splitter, _PATTERN_PROBE, "a test text")
    if pattern not in LINEAR_PATTERNS:
        _check_backtracking(pattern)
    return splitter


@functools.lru_cache(maxsize=64)
def _check_backtracking(pattern: str) -> None:
    """Try the pattern on runs of a piece of it (each character and pair of characters it writes, a letter, a
    digit, a space, ...) before an end that breaks the run: where a repeated part can match the same text in
    many ways, as in ``(?:a|a)+$``, a backtracking matcher takes time exponential in the run's length, and a
    run of 32 shows it."""
    splitter = regex.compile(pattern)
    deadline = time.monotonic() + _PROBE_SECONDS
    pieces = [*pattern, *(pattern[i:i + 2] for i in range(len(pattern) - 1)), *"aA1 \n\t.'_é中😀"]
    for piece in dict.fromkeys(pieces):
        for end in ("", "!", "\x00", "b"):
            probe = piece * 32 + end
            try:
                splitter.findall(probe, timeout=max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                raise ValueError(f"the split pattern {pattern!r} backtracks catastrophically: splitting {probe!r} "
                                 f"takes more than {_PROBE_SECONDS:g} s; write each repeated part so that it "
                                 "matches a text one way only") from None


def split_covering(splitter: regex.Pattern, text: str, text_name: str = "the text") -> list[str]:
    """``splitter.findall(text)``, checked to cover every character: text is never dropped silently. A pattern
    outside ``LINEAR_PATTERNS`` has a time limit proportional to the text's length."""
    if splitter.pattern in LINEAR_PATTERNS:
        chunks = splitter.findall(text)
    else:
        seconds = _SPLIT_SECONDS + _SPLIT_SECONDS_PER_CHAR * len(text)
        try:
            chunks = splitter.findall(text, timeout=seconds)
        except TimeoutError:
            raise ValueError(f"the split pattern {splitter.pattern!r} took more than {seconds:.1f} s to split "
                             f"{text_name} ({len(text):,} characters): it backtracks catastrophically on it") from None
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
    except IsADirectoryError:
        raise ValueError(f"{path} is a folder, not a tokenizer file") from None


def parse_tokenizer_json(text: str, source: str) -> Any:
    """The JSON value of a tokenizer file's text; text that is not JSON is a ValueError naming ``source``."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:  # (RecursionError: nested past Python's limit)
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


# --------------------------------------------------------------------------- Hugging Face files
class _Shape:
    """A check of one JSON value, beyond its type: ``test(value)`` is true when it fits ``expected`` (words)."""

    def __init__(self, test: Callable[[Any], bool], expected: str):
        self.test, self.expected = test, expected


class _Each:
    """An object whose every value has ``shape`` (a vocabulary); ``ids``: its keys are decimal ids too."""

    def __init__(self, shape, ids: bool = False):
        self.shape, self.ids = shape, ids


_NEEDS = "required"  # the key, in an object's shape, of the keys it must have
_TOKEN = _Shape(lambda value: isinstance(value, str) or (isinstance(value, dict)
                                                      and isinstance(value.get("content"), str)),
                "a string, or an object with a string 'content'")
_MERGE = _Shape(lambda value: isinstance(value, str) or (isinstance(value, list) and len(value) == 2
                                                         and all(isinstance(part, str) for part in value)),
                "a string 'left right' or a pair of strings")
_TEMPLATES = _Shape(lambda value: isinstance(value, str) or (isinstance(value, list) and all(
    isinstance(entry, dict) and isinstance(entry.get("template"), str) for entry in value)),
    "Jinja text, or a list of objects with a 'name' and a 'template'")
_PATTERN = {"String": str, "Regex": str}
_NORMALIZER = {"type": str, "pattern": _PATTERN, "content": str}
_NORMALIZER["normalizers"] = [_NORMALIZER]
_PRE_TOKENIZER = {"type": str, "pattern": _PATTERN, "behavior": str, "invert": bool, "add_prefix_space": bool,
                  "use_regex": bool}
_PRE_TOKENIZER["pretokenizers"] = [_PRE_TOKENIZER]
_POST_PROCESSOR = {"type": str, "single": [{"SpecialToken": {"id": str}, "Sequence": {"id": str}}]}
_POST_PROCESSOR["processors"] = [_POST_PROCESSOR]
# Every field of a tokenizer.json that llmscratch reads, with its shape (a key may be missing or null).
_TOKENIZER_JSON = {
    _NEEDS: ("model",),
    "model": {_NEEDS: ("vocab",), "type": str, "vocab": _Each(int), "merges": [_MERGE], "byte_fallback": bool,
              "ignore_merges": bool, "fuse_unk": bool, "unk_token": str, "continuing_subword_prefix": str,
              "end_of_word_suffix": str, "dropout": (int, float)},
    "added_tokens": [{_NEEDS: ("id", "content"), "id": int, "content": str, "special": bool, "normalized": bool}],
    "normalizer": _NORMALIZER, "pre_tokenizer": _PRE_TOKENIZER, "post_processor": _POST_PROCESSOR,
    "decoder": {"type": str},
}
_TOKENIZER_CONFIG = {
    "chat_template": _TEMPLATES,
    **{key: _TOKEN for key in ("bos_token", "eos_token", "pad_token", "unk_token")},
    "added_tokens_decoder": _Each({_NEEDS: ("content",), "content": str, "special": bool}, ids=True),
}


def check_hf_tokenizer(data: dict, file: str | os.PathLike) -> None:
    """A tokenizer.json's fields have the shapes llmscratch reads (an object where one is read, a string id, a
    merge of two tokens, ...); else a ValueError naming the file and the field."""
    _check_shape(data, _TOKENIZER_JSON, "", file)


def check_tokenizer_config(data: dict, file: str | os.PathLike) -> None:
    """As ``check_hf_tokenizer``, for tokenizer_config.json: its special tokens, chat template and added tokens."""
    _check_shape(data, _TOKENIZER_CONFIG, "", file)


def _check_shape(value: Any, shape: Any, where: str, file: str | os.PathLike) -> None:
    """ValueError naming ``file`` and the field ``where`` when ``value`` does not fit ``shape``: a type (or tuple
    of types; a bool is no int), a ``_Shape``, [shape] for a list of them, an ``_Each``, or {key: shape} for an
    object whose keys may be missing or null unless named under _NEEDS."""
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{file}: {where or 'the file'} should be an object, got {_described(value)}")
        if missing := [key for key in shape.get(_NEEDS, ()) if value.get(key) is None]:
            raise ValueError(f"{file}: {where or 'the file'} has no {missing[0]!r}")
        for key, inner in shape.items():
            if key != _NEEDS and value.get(key) is not None:
                _check_shape(value[key], inner, f"{where}.{key}" if where else key, file)
    elif isinstance(shape, list):
        if not isinstance(value, list):
            raise ValueError(f"{file}: {where} should be a list, got {_described(value)}")
        for index, item in _misfits(enumerate(value), shape[0]):
            _check_shape(item, shape[0], f"{where}[{index}]", file)
    elif isinstance(shape, _Each):
        _check_shape(value, {}, where, file)
        if shape.ids and (key := next((key for key in value if not key.isdecimal()), None)) is not None:
            raise ValueError(f"{file}: {where} has the key {key!r}, which is not a token id")
        for key, item in _misfits(value.items(), shape.shape):
            _check_shape(item, shape.shape, f"{where}[{key!r}]", file)
    elif isinstance(shape, _Shape):
        if not shape.test(value):
            raise ValueError(f"{file}: {where} should be {shape.expected}, got {_described(value)}")
    elif not isinstance(value, shape) or (isinstance(value, bool) and bool not in _types(shape)):
        names = {str: "a string", int: "an integer", bool: "true or false", float: "a number"}
        expected = " or ".join(dict.fromkeys(names[kind] for kind in _types(shape)))
        raise ValueError(f"{file}: {where} should be {expected}, got {_described(value)}")


def _misfits(items: Iterable[tuple[Any, Any]], shape: Any) -> Iterable[tuple[Any, Any]]:
    """The (key, value) items to check against ``shape`` one by one: all of them for an object's shape, else
    (a vocabulary of 150,000 ids, as many merges) the first that does not fit, found in one quick pass."""
    if isinstance(shape, dict | list | _Each):
        return items
    kinds = _types(shape)
    test = shape.test if isinstance(shape, _Shape) else lambda item: type(item) in kinds
    misfit = next(((key, item) for key, item in items if not test(item)), None)
    return [] if misfit is None else [misfit]


def _types(shape: type | tuple[type, ...]) -> tuple[type, ...]:
    return shape if isinstance(shape, tuple) else (shape,)


def _described(value: Any) -> str:
    """A JSON value in a few words: its kind, and the value itself when it is short."""
    kind = {dict: "an object", list: "a list", str: "the string", bool: "", int: "the integer", float: "the number",
            type(None): "null"}.get(type(value), type(value).__name__)
    if isinstance(value, (dict, list)):
        return kind
    shown = json.dumps(value, ensure_ascii=False)
    return f"{kind} {shown[:40]}{'...' if len(shown) > 40 else ''}".strip() if value is not None else kind
