"""Byte-level BPE tokenizer, built from scratch, that matches GPT-2 token for token.

Token ids 0-255 are single bytes, every later id is a merge of two earlier tokens, and
special tokens (such as ``<|endoftext|>``) come last. Training learns the merges from a
text; ``BPETokenizer.gpt2()`` recovers GPT-2's merges from its published ranks.
"""

import base64
import functools
import heapq
import json
import os
import warnings
from collections import Counter
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Literal

import regex
import tiktoken

from llmscratch.assets import GPT2_RANKS_PATH
from llmscratch.atomic import write_text_atomically

# GPT-2's pre-tokenizer: contractions, words, numbers, punctuation runs, whitespace.
# A merge never crosses the boundary between two of these chunks.
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ENDOFTEXT = "<|endoftext|>"
FILE_FORMAT, FILE_VERSION = "llmscratch-bpe", 1
_CACHE_LIMIT = 1 << 17  # chunk-cache entries kept before the cache is cleared
_NO_MERGE = 1 << 62  # larger than any token id

Pair = tuple[int, int]
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
    ):
        """``merges[i]`` creates id ``256 + i``; ``byte_order[i]`` is the byte of id ``i``."""
        self.name = name
        self.pattern = pattern
        self._split = regex.compile(pattern)
        self.byte_order = list(range(256)) if byte_order is None else list(byte_order)
        if sorted(self.byte_order) != list(range(256)):
            raise ValueError("byte_order must be a permutation of the 256 byte values")
        self.vocab = {i: bytes([b]) for i, b in enumerate(self.byte_order)}  # id -> bytes
        self.merges: dict[Pair, int] = {}  # (left id, right id) -> merged id
        for new_id, (left, right) in enumerate(merges, start=256):
            if not (0 <= left < new_id and 0 <= right < new_id):
                raise ValueError(f"merge {new_id - 256} ({left}, {right}) uses an id not yet defined")
            self.merges[left, right] = new_id
            self.vocab[new_id] = self.vocab[left] + self.vocab[right]
        self._byte_to_id = [0] * 256
        for token_id, byte in enumerate(self.byte_order):
            self._byte_to_id[byte] = token_id
        self.special_tokens = dict(special_tokens or {})
        expected = list(range(len(self.vocab), len(self.vocab) + len(self.special_tokens)))
        if sorted(self.special_tokens.values()) != expected:
            raise ValueError(
                f"special token ids {sorted(self.special_tokens.values())} must follow the "
                f"merges, i.e. be {expected}"
            )
        self._special_by_id = {i: s.encode("utf-8") for s, i in self.special_tokens.items()}
        self._cache: dict[str, list[int]] = {}

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
        """Id of ``<|endoftext|>``, or None if this tokenizer has no such token."""
        return self.special_tokens.get(ENDOFTEXT)

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

        Each step merges the most frequent adjacent pair (ties: the pair of smaller ids).
        Pair counts are updated only in the chunks a merge touches, never recounted.
        """
        special_tokens = list(dict.fromkeys(special_tokens))
        n_merges = vocab_size - 256 - len(special_tokens)
        if n_merges < 0:
            raise ValueError(
                f"vocab_size={vocab_size} is too small: it must be at least 256 (bytes) + "
                f"{len(special_tokens)} (special tokens) = {256 + len(special_tokens)}"
            )
        # Special tokens are never learned from the text: cut them out before counting.
        pieces = _special_regex(special_tokens).split(text) if special_tokens else [text]
        splitter = regex.compile(pattern)
        chunk_counts = Counter(chunk for piece in pieces for chunk in splitter.findall(piece))
        words = [list(chunk.encode("utf-8")) for chunk in chunk_counts]
        freqs = list(chunk_counts.values())

        counts: Counter[Pair] = Counter()  # pair -> occurrences weighted by chunk frequency
        where: dict[Pair, set[int]] = {}  # pair -> indices of the chunks that (may) hold it
        for index, (word, freq) in enumerate(zip(words, freqs)):
            for pair in zip(word, word[1:]):
                counts[pair] += freq
                where.setdefault(pair, set()).add(index)
        # A max-heap by (count, smaller ids first). Entries go stale as counts drop; a
        # stale entry is re-pushed with its current count when it reaches the top.
        heap = [(-count, pair) for pair, count in counts.items()]
        heapq.heapify(heap)

        merges: list[Pair] = []
        bar = _progress_bar(n_merges, "BPE merges") if progress else None
        while len(merges) < n_merges and heap:
            neg_count, pair = heapq.heappop(heap)
            current = counts.get(pair, 0)
            if current != -neg_count:
                if current > 0:
                    heapq.heappush(heap, (-current, pair))
                continue
            new_id = 256 + len(merges)
            merges.append(pair)
            new_pairs = _apply_merge(pair, new_id, words, freqs, where.pop(pair), counts, where)
            for new_pair in new_pairs:
                heapq.heappush(heap, (-counts[new_pair], new_pair))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
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
        """Recover the merges behind a tiktoken-style ranks table (token bytes -> rank).

        Token ``r`` is the merge of the two tokens that BPE, using only the merges of
        rank below ``r``, makes of its bytes.
        """
        by_rank = sorted(ranks.items(), key=lambda item: item[1])
        if [rank for _, rank in by_rank] != list(range(len(by_rank))):
            raise ValueError("ranks must be the integers 0..n-1, each used once")
        if any(len(token) != 1 for token, _ in by_rank[:256]):
            raise ValueError("ranks 0-255 must be the 256 single bytes")
        byte_order = [token[0] for token, _ in by_rank[:256]]
        partial = cls([], byte_order=byte_order)  # grows one merge at a time
        merges = []
        for token, rank in by_rank[256:]:
            parts = partial._merge_chunk(token)
            if len(parts) != 2:
                raise ValueError(f"token {token!r} (rank {rank}) is not a merge of two earlier tokens")
            merges.append((parts[0], parts[1]))
            partial.merges[parts[0], parts[1]] = rank
            partial.vocab[rank] = token
        return cls(merges, byte_order=byte_order, **kwargs)

    # ------------------------------------------------------------------ encoding
    def _merge_chunk(self, chunk: bytes) -> list[int]:
        """BPE on one pre-split chunk: apply the earliest-learned merge until none applies."""
        ids = [self._byte_to_id[b] for b in chunk]
        rank = self.merges.get  # a merge's new id is its rank: smaller means learned earlier
        ranks = [rank(pair, _NO_MERGE) for pair in zip(ids, ids[1:])]  # ranks[i]: ids[i], ids[i+1]
        while ranks:
            new_id = min(ranks)
            if new_id == _NO_MERGE:
                break
            i = ranks.index(new_id)  # leftmost occurrence first, as GPT-2 does
            ids[i : i + 2] = [new_id]
            del ranks[i]
            if i > 0:  # the pair to the left now ends in the new token
                ranks[i - 1] = rank((ids[i - 1], new_id), _NO_MERGE)
            if i < len(ranks):  # and the pair to the right starts with it
                ranks[i] = rank((new_id, ids[i + 1]), _NO_MERGE)
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode text, treating special-token strings as ordinary text."""
        text = _replace_lone_surrogates(text)
        cache, ids = self._cache, []
        for chunk in self._split.findall(text):
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
        allowed = self._special_set(allowed_special, "allowed_special")
        disallowed = (set(self.special_tokens) - allowed if disallowed_special == "all"
                      else self._special_set(disallowed_special, "disallowed_special"))
        if disallowed and (found := _special_regex(disallowed).search(text)):
            raise ValueError(
                f"the text contains the special token {found.group()!r}, which is disallowed: "
                f"pass allowed_special={{{found.group()!r}}} to encode it as a special token, "
                f"or disallowed_special=() to encode it as ordinary text"
            )
        if not allowed:
            return self.encode_ordinary(text)
        ids = []
        for i, piece in enumerate(_special_regex(allowed, capture=True).split(text)):
            if i % 2:  # odd pieces are the captured special tokens
                ids.append(self.special_tokens[piece])
            elif piece:
                ids.extend(self.encode_ordinary(piece))
        return ids

    def _special_set(self, names: SpecialSet, argument: str) -> set[str]:
        if names == "all":
            return set(self.special_tokens)
        unknown = sorted(set(names) - set(self.special_tokens))
        if unknown:
            raise ValueError(f"{argument} names unknown special tokens {unknown}; this "
                             f"tokenizer has {sorted(self.special_tokens)}")
        return set(names)

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
        byte_order = None if self.byte_order == list(range(256)) else self.byte_order
        header = {"format": FILE_FORMAT, "version": FILE_VERSION, "name": self.name,
                  "pattern": self.pattern, "special_tokens": self.special_tokens,
                  "byte_order": byte_order}
        lines = [f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}," for key, value in header.items()]
        merge_lines = [
            f"    {json.dumps([left, right, _readable(self.vocab[new_id])], ensure_ascii=False)}"
            for (left, right), new_id in self.merges.items()
        ]
        return "{\n" + "\n".join(lines) + '\n  "merges": [\n' + ",\n".join(merge_lines) + "\n  ]\n}\n"

    @classmethod
    def from_json(cls, text: str, source: str = "the tokenizer JSON") -> "BPETokenizer":
        """Parse ``to_json`` output; a corrupt or unknown document is a ValueError naming ``source``."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source} is not a tokenizer file (invalid JSON: {err})") from None
        if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
            raise ValueError(f"{source} is not an {FILE_FORMAT} file (format field missing or wrong)")
        if data.get("version") != FILE_VERSION:
            raise ValueError(f"{source} has version {data.get('version')!r}; this llmscratch "
                             f"reads version {FILE_VERSION}")
        try:
            merges = [(int(left), int(right)) for left, right, _ in data["merges"]]
            tokenizer = cls(merges, pattern=data["pattern"], special_tokens=data["special_tokens"],
                            byte_order=data["byte_order"], name=data["name"])
        except (KeyError, TypeError, ValueError, regex.error) as err:
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
    tokenizer = BPETokenizer.from_ranks(load_gpt2_ranks())
    return tuple(tokenizer.byte_order), tuple(tokenizer.merges)


def _apply_merge(pair: Pair, new_id: int, words: list[list[int]], freqs: list[int],
                 candidates: set[int], counts: Counter, where: dict[Pair, set[int]]) -> set[Pair]:
    """Merge ``pair`` in every chunk that holds it, updating pair counts; return new pairs."""
    left, right = pair
    new_pairs = set()
    for index in candidates:
        word, freq = words[index], freqs[index]
        merged, i = [], 0
        while i < len(word):
            if i + 1 < len(word) and word[i] == left and word[i + 1] == right:
                merged.append(new_id)
                i += 2
            else:
                merged.append(word[i])
                i += 1
        if len(merged) == len(word):
            continue  # a stale entry of ``where``: this chunk lost the pair to an earlier merge
        for old in zip(word, word[1:]):
            counts[old] -= freq
            if counts[old] == 0:
                del counts[old]
        for new in zip(merged, merged[1:]):
            counts[new] += freq
            if new_id in new:
                where.setdefault(new, set()).add(index)
                new_pairs.add(new)
        words[index] = merged
    return new_pairs


@functools.lru_cache(maxsize=64)
def _special_regex_cached(tokens: frozenset[str], capture: bool) -> regex.Pattern:
    # Longest first, so a special token that contains another one wins.
    body = "|".join(regex.escape(tok) for tok in sorted(tokens, key=len, reverse=True))
    return regex.compile(f"({body})" if capture else body)


def _special_regex(tokens: Iterable[str], capture: bool = False) -> regex.Pattern:
    return _special_regex_cached(frozenset(tokens), capture)


def _replace_lone_surrogates(text: str) -> str:
    """Lone surrogates cannot be UTF-8 encoded; like tiktoken, turn them into U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _readable(token: bytes) -> str:
    """A token's bytes as text, with invalid UTF-8 shown as \\xNN escapes."""
    return token.decode("utf-8", errors="backslashreplace")


def _progress_bar(total: int, description: str):
    from tqdm.auto import tqdm  # imported here so tokenizing needs no tqdm at import time

    return tqdm(total=total, desc=description, unit="merge")
