"""Special tokens, the rules every tokenizer of the package shares: tiktoken's ``allowed_special`` /
``disallowed_special`` (a special token written in a text is refused unless allowed), and added text
(tokens such as Qwen3's ``<think>`` that are encoded as themselves wherever they are written)."""

import functools
from collections.abc import Collection, Iterable
from typing import Literal

import regex

SpecialSet = Literal["all"] | Collection[str]


def encode_with_specials(tokenizer, text: str, allowed_special: SpecialSet = (),
                         disallowed_special: SpecialSet = "all") -> list[int]:
    """``encode`` for any tokenizer with ``special_tokens`` (str -> id) and ``encode_ordinary``: tiktoken's
    rules for the special tokens in ``text`` (see ``BPETokenizer.encode``)."""
    allowed = _special_set(tokenizer, allowed_special, "allowed_special")
    disallowed = (set(tokenizer.special_tokens) - allowed if disallowed_special == "all"
                  else _special_set(tokenizer, disallowed_special, "disallowed_special"))
    disallowed -= tokenizer.added_text  # text, not control: always encoded as themselves
    if disallowed and (found := special_regex(disallowed).search(text)):
        raise ValueError(
            f"the text contains the special token {found.group()!r}, which is disallowed: "
            f"pass allowed_special={{{found.group()!r}}} to encode it as a special token, "
            f"or disallowed_special=() to encode it as ordinary text"
        )
    if not allowed:
        return tokenizer.encode_ordinary(text)
    ids = []
    for i, piece in enumerate(special_regex(allowed, capture=True).split(text)):
        if i % 2:  # odd pieces are the captured special tokens
            ids.append(tokenizer.special_tokens[piece])
        elif piece:
            ids.extend(tokenizer.encode_ordinary(piece))
    return ids


def split_added_text(tokenizer, text: str, encode_plain) -> list[int]:
    """``encode_plain`` on the text between the tokenizer's ``added_text`` tokens, each of which is its id."""
    if not tokenizer.added_text:
        return encode_plain(text)
    ids = []
    for i, piece in enumerate(special_regex(tokenizer.added_text, capture=True).split(text)):
        if i % 2:
            ids.append(tokenizer.special_tokens[piece])
        elif piece:
            ids.extend(encode_plain(piece))
    return ids


def _special_set(tokenizer, names: SpecialSet, argument: str) -> set[str]:
    if names == "all":
        return set(tokenizer.special_tokens)
    unknown = sorted(set(names) - set(tokenizer.special_tokens))
    if unknown:
        raise ValueError(f"{argument} names unknown special tokens {unknown}; this "
                         f"tokenizer has {sorted(tokenizer.special_tokens)}")
    return set(names)


@functools.lru_cache(maxsize=64)
def _special_regex_cached(tokens: frozenset[str], capture: bool) -> regex.Pattern:
    # Longest first, so a special token that contains another one wins.
    body = "|".join(regex.escape(tok) for tok in sorted(tokens, key=len, reverse=True))
    return regex.compile(f"({body})" if capture else body)


def special_regex(tokens: Iterable[str], capture: bool = False) -> regex.Pattern:
    return _special_regex_cached(frozenset(tokens), capture)


def replace_lone_surrogates(text: str) -> str:
    """Lone surrogates cannot be UTF-8 encoded; like tiktoken, turn them into U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
