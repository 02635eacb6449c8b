"""Byte-level BPE tokenizer, built from scratch, that matches GPT-2 token for token.

Token ids 0-255 are single bytes, every later id is a merge of two earlier tokens, and
special tokens (such as ``<|endoftext|>``) come last. Training learns the merges from a
text; ``BPETokenizer.gpt2()`` recovers GPT-2's merges from its published ranks. The merge
algorithms themselves are in ``llmscratch.bpe``; this module adds the pre-splitting regex,
tiktoken's rules for special tokens, and the JSON file.
"""

import base64
import functools
import json
import os
import unicodedata
import warnings
from collections import Counter
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Literal

import regex
import tiktoken

from llmscratch.assets import GPT2_RANKS_PATH
from llmscratch.atomic import write_text_atomically
from llmscratch.bpe import Pair, apply_merges, learn_merges, merges_from_ranks
from llmscratch.progress import progress_bar

# GPT-2's pre-tokenizer: contractions, words, numbers, punctuation runs, whitespace.
# A merge never crosses the boundary between two of these chunks.
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ENDOFTEXT = "<|endoftext|>"
FILE_FORMAT, FILE_VERSION = "llmscratch-bpe", 1
SPM_FILE_FORMAT = "llmscratch-sentencepiece-bpe"  # llmscratch.hf_tokenizer.SentencePieceBPE's files (Gemma's)
_CACHE_LIMIT = 1 << 17  # chunk-cache entries kept before the cache is cleared
_JSON_VALUE = r'(?:"(?:[^"\\]|\\.)*"|[^\s\[\]{},"]+)'  # a JSON string, number, true, false or null
_FLAT_LIST = regex.compile(rf"\[\n +{_JSON_VALUE}(?:,\n +{_JSON_VALUE})*\n *\]")  # as json.dumps(indent=2) writes it
# A split pattern must cover this text without a gap, or encoding would drop text silently.
_PATTERN_PROBE = ("Hello, world! It's 2026: 3.14 ünïcödé 中文 日本語 한국어 😀👩‍👩‍👧 e\u0301 "
                  "a_b-c.d/e\\f (x) [y] 'q' \"q\" \t\n\r\n  \x00\x1b\x7f\u200b\u2028 end ")

SpecialSet = Literal["all"] | Collection[str]


class BPETokenizer:
    """Byte-level BPE: regex pre-splitting, then merges applied in the order learned."""

    def __init__(
        self,
        merges: Iterable[Pair],
        pattern: str = GPT2_SPLIT_PATTERN,
        special_tokens: dict[str, int] | None = None,
        byte_order: list[int] | None = None,
        name: str = "bpe",
        normalization: str | None = None,
        whole_chunks: bool = False,
        bos_token: str | None = None,
        eos_token: str | None = None,
        added_text: Collection[str] = (),
    ):
        """``merges[i]`` creates id ``256 + i``; ``byte_order[i]`` is the byte of id ``i``.

        Two choices that tokenizers made elsewhere need (``llmscratch.hf_tokenizer``): ``normalization``, a
        Unicode form ("NFC", "NFKC", "NFD", "NFKD") the text is put in before it is split (Qwen's is NFC);
        ``whole_chunks``, a chunk that is itself a token encodes as that token without merging (tiktoken does
        this, and Hugging Face's ``ignore_merges``); ``bos_token``, a special token a sequence starts with
        (Llama 3's "<|begin_of_text|>"), which ``encode`` does not add (``llmscratch.generate.with_bos`` does);
        ``eos_token``, the one that ends it (default ``<|endoftext|>``); ``added_text``, special tokens that
        are text rather than control, always encoded as themselves, wherever they are written (Qwen3's
        "<think>"; Hugging Face's added tokens that are not special).
        """
        if normalization not in (None, "NFC", "NFKC", "NFD", "NFKD"):
            raise ValueError(f"normalization must be None, 'NFC', 'NFKC', 'NFD' or 'NFKD', got {normalization!r}")
        self.name = name
        self.normalization, self.whole_chunks = normalization, bool(whole_chunks)
        self.pattern = pattern
        self._split = _compile_split_pattern(pattern)
        self.byte_order = list(range(256)) if byte_order is None else list(byte_order)
        if sorted(self.byte_order) != list(range(256)):
            raise ValueError("byte_order must be a permutation of the 256 byte values")
        self.vocab = {i: bytes([b]) for i, b in enumerate(self.byte_order)}  # id -> bytes
        self.merges: dict[Pair, int] = {}  # (left id, right id) -> merged id
        for new_id, (left, right) in enumerate(merges, start=256):
            if not (0 <= left < new_id and 0 <= right < new_id):
                raise ValueError(f"merge {new_id - 256} ({left}, {right}) uses an id not yet defined")
            if (left, right) in self.merges:
                raise ValueError(f"merge {new_id - 256} ({left}, {right}) repeats merge "
                                 f"{self.merges[left, right] - 256}; each pair is merged once")
            self.merges[left, right] = new_id
            self.vocab[new_id] = self.vocab[left] + self.vocab[right]
        self._byte_to_id = [0] * 256
        for token_id, byte in enumerate(self.byte_order):
            self._byte_to_id[byte] = token_id
        self.special_tokens = dict(special_tokens or {})
        check_special_tokens(list(self.special_tokens))
        expected = list(range(len(self.vocab), len(self.vocab) + len(self.special_tokens)))
        if sorted(self.special_tokens.values()) != expected:
            raise ValueError(
                f"special token ids {sorted(self.special_tokens.values())} must follow the "
                f"merges, i.e. be {expected}"
            )
        self._special_by_id = {i: s.encode("utf-8") for s, i in self.special_tokens.items()}
        for role, token in (("bos_token", bos_token), ("eos_token", eos_token)):
            if token is not None and token not in self.special_tokens:
                raise ValueError(f"{role} {token!r} is not one of the special tokens {list(self.special_tokens)}")
        self.bos_token, self.eos_token = bos_token, eos_token
        self.added_text = frozenset(check_special_tokens(added_text))
        if unknown := sorted(self.added_text - set(self.special_tokens)):
            raise ValueError(f"added_text {unknown} are not among the special tokens {list(self.special_tokens)}")
        self._cache: dict[str, list[int]] = {}
        self._id_of = {token: i for i, token in self.vocab.items()} if self.whole_chunks else {}

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        """Number of token ids: 256 bytes + merges + special tokens."""
        return len(self.vocab) + len(self.special_tokens)

    @property
    def n_vocab(self) -> int:
        """Same as ``vocab_size``, under tiktoken's name so either tokenizer fits."""
        return self.vocab_size

    @property
    def eot_token(self) -> int | None:
        """Id of the token that ends a text (``eos_token``, else ``<|endoftext|>``), or None if there is none."""
        return self.special_tokens.get(self.eos_token or ENDOFTEXT)

    @property
    def bos_id(self) -> int | None:
        """Id of the token a sequence starts with (``bos_token``), or None."""
        return None if self.bos_token is None else self.special_tokens[self.bos_token]

    def __repr__(self) -> str:
        return (f"BPETokenizer(name={self.name!r}, vocab_size={self.vocab_size}, "
                f"merges={len(self.merges)}, special_tokens={list(self.special_tokens)})")

    # ------------------------------------------------------------------ training
    @classmethod
    def train(
        cls,
        text: str,
        vocab_size: int,
        pattern: str = GPT2_SPLIT_PATTERN,
        special_tokens: Collection[str] = (),
        name: str = "bpe",
        progress: bool = False,
    ) -> "BPETokenizer":
        """Learn ``vocab_size - 256 - len(special_tokens)`` merges from ``text``.

        Each step merges the most frequent adjacent pair (ties: the pair of smaller ids) within
        the chunks the pattern splits the text into (``llmscratch.bpe.learn_merges``).
        """
        special_tokens = check_special_tokens(special_tokens)
        n_merges = vocab_size - 256 - len(special_tokens)
        if n_merges < 0:
            raise ValueError(
                f"vocab_size={vocab_size} is too small: it must be at least 256 (bytes) + "
                f"{len(special_tokens)} (special tokens) = {256 + len(special_tokens)}"
            )
        chunk_counts = _count_chunks(text, _compile_split_pattern(pattern), special_tokens)
        with progress_bar(progress, n_merges, "BPE merges", "merge") as bar:
            merges = learn_merges(chunk_counts, n_merges, None if bar is None else bar.update)
        if len(merges) < n_merges:
            warnings.warn(
                f"the text has only enough distinct pairs for {len(merges)} merges, not "
                f"{n_merges}: vocab_size is {256 + len(merges) + len(special_tokens)}, "
                f"not {vocab_size}",
                stacklevel=2,
            )
        first_special = 256 + len(merges)
        specials = {tok: first_special + i for i, tok in enumerate(special_tokens)}
        return cls(merges, pattern=pattern, special_tokens=specials, name=name)

    # ------------------------------------------------------------------ GPT-2
    @classmethod
    def gpt2(cls) -> "BPETokenizer":
        """GPT-2's tokenizer (50,257 ids), rebuilt from the bundled ranks file."""
        byte_order, merges = _gpt2_merges()
        return cls(merges, pattern=GPT2_SPLIT_PATTERN, special_tokens={ENDOFTEXT: 50256},
                   byte_order=list(byte_order), name="gpt2")

    @classmethod
    def from_ranks(cls, ranks: dict[bytes, int], **kwargs) -> "BPETokenizer":
        """The tokenizer behind a tiktoken-style ranks table (token bytes -> rank), its merges
        recovered by ``llmscratch.bpe.merges_from_ranks``; kwargs as for the constructor."""
        byte_order, merges = merges_from_ranks(ranks)
        return cls(merges, byte_order=byte_order, **kwargs)

    # ------------------------------------------------------------------ encoding
    def _merge_chunk(self, chunk: bytes) -> list[int]:
        """BPE on one pre-split chunk: its bytes' ids, merged as learned."""
        if (whole := self._id_of.get(chunk)) is not None:  # only with whole_chunks
            return [whole]
        return apply_merges([self._byte_to_id[b] for b in chunk], self.merges)

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode text, treating special-token strings as ordinary text (``added_text`` excepted)."""
        return split_added_text(self, text, self._encode_plain)

    def _encode_plain(self, text: str) -> list[int]:
        text = _replace_lone_surrogates(text)
        if self.normalization is not None:
            text = unicodedata.normalize(self.normalization, text)
        cache, ids = self._cache, []
        for chunk in _split_covering(self._split, text):
            chunk_ids = cache.get(chunk)
            if chunk_ids is None:
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                chunk_ids = cache[chunk] = self._merge_chunk(chunk.encode("utf-8"))
            ids.extend(chunk_ids)
        return ids

    def encode(self, text: str, allowed_special: SpecialSet = (),
               disallowed_special: SpecialSet = "all") -> list[int]:
        """Encode text to ids; special tokens follow tiktoken's ``allowed``/``disallowed`` rules.

        By default a special-token string in the text is an error (it may be an injection);
        allow it to get its id, or pass ``disallowed_special=()`` to encode it as text.
        """
        return encode_with_specials(self, text, allowed_special, disallowed_special)

    # ------------------------------------------------------------------ decoding
    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The exact bytes behind ``ids`` (which may end in the middle of a character)."""
        parts = []
        for token_id in ids:
            token_id = int(token_id)
            part = self.vocab.get(token_id) or self._special_by_id.get(token_id)
            if part is None:
                raise ValueError(f"token id {token_id} is out of range: ids run from 0 to "
                                 f"{self.vocab_size - 1}")
            parts.append(part)
        return b"".join(parts)

    def decode(self, ids: Iterable[int]) -> str:
        """Text behind ``ids``; bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ files
    def to_json(self) -> str:
        """The tokenizer as versioned JSON text, one merge per line with the token it makes."""
        document = {
            "format": FILE_FORMAT, "version": FILE_VERSION, "name": self.name, "pattern": self.pattern,
            "special_tokens": self.special_tokens,
            "byte_order": None if self.byte_order == list(range(256)) else self.byte_order,
            "merges": [[left, right, _readable(self.vocab[new_id])] for (left, right), new_id in self.merges.items()],
        }
        extras = dict(normalization=self.normalization, whole_chunks=self.whole_chunks, bos_token=self.bos_token,
                      eos_token=self.eos_token, added_text=sorted(self.added_text))
        document.update({key: value for key, value in extras.items() if value})  # only when set: older files stay
        return _one_line_lists(json.dumps(document, ensure_ascii=False, indent=2)) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "the tokenizer JSON") -> "BPETokenizer":
        """Parse ``to_json`` output; a corrupt or unknown document is a ValueError naming ``source``."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source} is not a tokenizer file (invalid JSON: {err})") from None
        if isinstance(data, dict) and data.get("format") == SPM_FILE_FORMAT:  # Gemma's kind
            from llmscratch.hf_tokenizer import SentencePieceBPE

            return SentencePieceBPE.from_document(data, source)
        if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
            raise ValueError(f"{source} is not an {FILE_FORMAT} file (format field missing or wrong)")
        if data.get("version") != FILE_VERSION:
            raise ValueError(f"{source} has version {data.get('version')!r}; this llmscratch "
                             f"reads version {FILE_VERSION}")
        try:
            merges = [(int(left), int(right)) for left, right, _ in data["merges"]]
            tokenizer = cls(merges, pattern=data["pattern"], special_tokens=data["special_tokens"],
                            byte_order=data["byte_order"], name=data["name"],
                            normalization=data.get("normalization"), whole_chunks=data.get("whole_chunks", False),
                            bos_token=data.get("bos_token"), eos_token=data.get("eos_token"),
                            added_text=data.get("added_text", ()))
        except ValueError as err:  # our own checks: a sentence that names the bad value
            raise ValueError(f"{source} is a corrupt tokenizer file: {err}") from None
        except (KeyError, TypeError) as err:
            raise ValueError(f"{source} is a corrupt tokenizer file: {err!r}") from None
        for index, (_, _, shown) in enumerate(data["merges"]):
            if shown != _readable(tokenizer.vocab[256 + index]):
                raise ValueError(f"{source} is a corrupt tokenizer file: merge {index} makes "
                                 f"{_readable(tokenizer.vocab[256 + index])!r}, the file says {shown!r}")
        return tokenizer

    def save(self, path: str | os.PathLike) -> None:
        """Write ``to_json()`` to ``path`` atomically (a crash never leaves half a file)."""
        write_text_atomically(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "BPETokenizer":
        """Read a file written by ``save``; a corrupt or unknown file is a ValueError."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{path} is not a tokenizer file (not UTF-8: {err})") from None
        return cls.from_json(text, source=str(path))


def encode_with_specials(tokenizer, text: str, allowed_special: SpecialSet = (),
                         disallowed_special: SpecialSet = "all") -> list[int]:
    """``encode`` for any tokenizer with ``special_tokens`` (str -> id) and ``encode_ordinary``: tiktoken's
    rules for the special tokens in ``text`` (see ``BPETokenizer.encode``)."""
    allowed = _special_set(tokenizer, allowed_special, "allowed_special")
    disallowed = (set(tokenizer.special_tokens) - allowed if disallowed_special == "all"
                  else _special_set(tokenizer, disallowed_special, "disallowed_special"))
    disallowed -= tokenizer.added_text  # text, not control: always encoded as themselves
    if disallowed and (found := _special_regex(disallowed).search(text)):
        raise ValueError(
            f"the text contains the special token {found.group()!r}, which is disallowed: "
            f"pass allowed_special={{{found.group()!r}}} to encode it as a special token, "
            f"or disallowed_special=() to encode it as ordinary text"
        )
    if not allowed:
        return tokenizer.encode_ordinary(text)
    ids = []
    for i, piece in enumerate(_special_regex(allowed, capture=True).split(text)):
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
    for i, piece in enumerate(_special_regex(tokenizer.added_text, capture=True).split(text)):
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


def load_gpt2_ranks() -> dict[bytes, int]:
    """Read the bundled GPT-2 ranks: token bytes -> id (rank), 50,256 entries."""
    ranks = {}
    for line in GPT2_RANKS_PATH.read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def gpt2_encoding() -> tiktoken.Encoding:
    """tiktoken's GPT-2 encoding built from the bundled file: no download, no cache dir."""
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_SPLIT_PATTERN,
                             mergeable_ranks=load_gpt2_ranks(), special_tokens={ENDOFTEXT: 50256})


@functools.cache
def _gpt2_merges() -> tuple[tuple[int, ...], tuple[Pair, ...]]:
    """GPT-2's byte order and merges, recovered once per process (about a second)."""
    byte_order, merges = merges_from_ranks(load_gpt2_ranks())
    return tuple(byte_order), tuple(merges)


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


def _compile_split_pattern(pattern: str) -> regex.Pattern:
    """Compile a pre-split pattern; one that is invalid, has groups or skips text is a ValueError."""
    try:
        splitter = regex.compile(pattern)
    except (regex.error, TypeError) as err:
        raise ValueError(f"the split pattern {pattern!r} is not a regular expression: {err}") from None
    if splitter.groups:
        raise ValueError(f"the split pattern {pattern!r} has capture groups, so findall would return "
                         f"the groups instead of the chunks: write each group as (?:...)")
    _split_covering(splitter, _PATTERN_PROBE, "a test text")
    return splitter


def _split_covering(splitter: regex.Pattern, text: str, text_name: str = "the text") -> list[str]:
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


@functools.lru_cache(maxsize=64)
def _special_regex_cached(tokens: frozenset[str], capture: bool) -> regex.Pattern:
    # Longest first, so a special token that contains another one wins.
    body = "|".join(regex.escape(tok) for tok in sorted(tokens, key=len, reverse=True))
    return regex.compile(f"({body})" if capture else body)


def _special_regex(tokens: Iterable[str], capture: bool = False) -> regex.Pattern:
    return _special_regex_cached(frozenset(tokens), capture)


def _count_chunks(text: str, splitter: regex.Pattern, special_tokens: list[str]) -> dict[bytes, int]:
    """Each distinct pre-split chunk of ``text`` as UTF-8 bytes, with how often it occurs."""
    # Special tokens are never learned from the text: cut them out before splitting.
    pieces = _special_regex(special_tokens).split(text) if special_tokens else [text]
    counts: Counter[str] = Counter()
    for piece in pieces:
        counts.update(_split_covering(splitter, piece))
    return {chunk.encode("utf-8"): count for chunk, count in counts.items()}


def _replace_lone_surrogates(text: str) -> str:
    """Lone surrogates cannot be UTF-8 encoded; like tiktoken, turn them into U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _one_line_lists(text: str) -> str:
    """JSON text from json.dumps(indent=...) with each list of plain values on one line.

    Only whitespace between JSON tokens changes: json never writes a newline inside a string,
    so ",\\n" separates the items of such a list and nothing else.
    """
    return _FLAT_LIST.sub(lambda m: "[" + ", ".join(item.strip() for item in m.group()[1:-1].split(",\n")) + "]",
                          text)


def _readable(token: bytes) -> str:
    """A token's bytes as text, with invalid UTF-8 shown as \\xNN escapes."""
    return token.decode("utf-8", errors="backslashreplace")
