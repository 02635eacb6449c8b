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
from collections import Counter, defaultdict
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
# Chunks up to this many bytes take the simple rescanning merge: it is quadratic, but quicker
# than the rank-by-rank merge below about 30 bytes, and nearly every chunk of prose is short.
_SHORT_CHUNK = 32
# A split pattern must cover this text without a gap, or encoding would drop text silently.
_PATTERN_PROBE = ("Hello, world! It's 2026: 3.14 ünïcödé 中文 日本語 한국어 😀👩‍👩‍👧 e\u0301 "
                  "a_b-c.d/e\\f (x) [y] 'q' \"q\" \t\n\r\n  \x00\x1b\x7f\u200b\u2028 end ")

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
        Pair counts are updated only where a merge happens, never recounted.
        """
        special_tokens = check_special_tokens(special_tokens)
        n_merges = vocab_size - 256 - len(special_tokens)
        if n_merges < 0:
            raise ValueError(
                f"vocab_size={vocab_size} is too small: it must be at least 256 (bytes) + "
                f"{len(special_tokens)} (special tokens) = {256 + len(special_tokens)}"
            )
        # Special tokens are never learned from the text: cut them out before counting.
        pieces = _special_regex(special_tokens).split(text) if special_tokens else [text]
        splitter = _compile_split_pattern(pattern)
        chunk_counts: Counter[str] = Counter()
        for piece in pieces:
            chunk_counts.update(_split_covering(splitter, piece))
        bar = _progress_bar(n_merges, "BPE merges") if progress else None
        merges = _learn_merges(chunk_counts, n_merges, bar)
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
        # A merge's new id is its rank: smaller means learned earlier.
        if len(ids) <= _SHORT_CHUNK:
            return _merge_by_scanning(ids, self.merges)
        return _merge_rank_by_rank(ids, self.merges)

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode text, treating special-token strings as ordinary text."""
        text = _replace_lone_surrogates(text)
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


def _merge_by_scanning(ids: list[int], merges: dict[Pair, int]) -> list[int]:
    """BPE by rescanning: each step merges the lowest-ranked pair, the leftmost among equals.

    Quadratic in ``len(ids)``, and the quickest on the few-byte chunks of ordinary text.
    """
    rank = merges.get
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


def _merge_rank_by_rank(ids: list[int], merges: dict[Pair, int]) -> list[int]:
    """The same tokens as ``_merge_by_scanning`` in O(n log n): take the ranks in increasing
    order and merge each rank's pairs from left to right.

    A merge only creates pairs of a higher rank than its own, so when a rank comes up all its
    pairs are already noted, and taking them left to right is the leftmost-first rule.
    """
    rank = merges.get
    n = len(ids)
    # A linked list of the parts: a part merged into its left neighbour gets the id -1.
    after = list(range(1, n + 1))  # after[i]: the next live part (n: none)
    before = list(range(-1, n - 1))  # before[i]: the previous live part (-1: none)
    noted: dict[int, list[int]] = {}  # rank -> left parts of its pairs (some stale)
    for i, pair in enumerate(zip(ids, ids[1:])):
        if (r := rank(pair)) is not None:
            noted.setdefault(r, []).append(i)
    pending = list(noted)  # a min-heap of the ranks with noted pairs
    heapq.heapify(pending)
    while pending:
        r = heapq.heappop(pending)
        for i in sorted(noted.pop(r)):
            j = after[i]
            if j == n or rank((ids[i], ids[j])) != r:
                continue  # stale: a part of this pair went into an earlier merge
            ids[i], ids[j] = r, -1
            k = after[i] = after[j]
            new_pairs = []
            if k < n:
                before[k] = i
                new_pairs.append(((r, ids[k]), i))
            if (h := before[i]) >= 0:
                new_pairs.append(((ids[h], r), h))
            for pair, left in new_pairs:
                if (s := rank(pair)) is not None:
                    if s not in noted:
                        noted[s] = []
                        heapq.heappush(pending, s)
                    noted[s].append(left)
    return [token for token in ids if token >= 0]


def _learn_merges(chunk_counts: Counter[str], n_merges: int, bar=None) -> list[Pair]:
    """Merge the most frequent pair (ties: smaller ids first) until ``n_merges`` or no pair is left.

    The distinct chunks lie end to end in one linked list of symbols (no link crosses from a
    chunk to the next), each symbol weighted by its chunk's count; ``where[pair]`` holds the
    positions where ``pair`` starts (some stale), so a merge touches only those.
    """
    symbols, weight, after, before = [], [], [], []
    for chunk, count in chunk_counts.items():
        data = chunk.encode("utf-8")
        start, end = len(symbols), len(symbols) + len(data)
        symbols.extend(data)
        weight.extend([count] * len(data))
        after.extend(range(start + 1, end + 1))
        before.extend(range(start - 1, end - 1))
        if data:
            after[-1], before[start] = -1, -1
    counts: Counter[Pair] = Counter()  # pair -> occurrences weighted by chunk count
    where: defaultdict[Pair, list[int]] = defaultdict(list)
    for i, j in enumerate(after):
        if j >= 0:
            pair = symbols[i], symbols[j]
            counts[pair] += weight[i]
            where[pair].append(i)
    # A max-heap by (count, smaller ids first). Entries go stale as counts drop; a
    # stale entry is re-pushed with its current count when it reaches the top.
    heap = [(-count, pair) for pair, count in counts.items()]
    heapq.heapify(heap)
    merges: list[Pair] = []
    while len(merges) < n_merges and heap:
        neg_count, pair = heapq.heappop(heap)
        current = counts.get(pair, 0)
        if current != -neg_count:
            if current > 0:
                heapq.heappush(heap, (-current, pair))
            continue
        new_id = 256 + len(merges)
        merges.append(pair)
        for new_pair in _merge_pair(pair, new_id, where.pop(pair), symbols, weight, after, before,
                                    counts, where):
            if new_pair in counts:  # some made pairs are gone again, e.g. (new, a) in "aaaa"
                heapq.heappush(heap, (-counts[new_pair], new_pair))
        if bar is not None:
            bar.update(1)
    return merges


def _merge_pair(pair: Pair, new_id: int, positions: list[int], symbols: list[int], weight: list[int],
                after: list[int], before: list[int], counts: Counter, where: dict) -> set[Pair]:
    """Merge ``pair`` where it starts at ``positions``, left to right as a scan would (``aaa``
    makes ``(aa)a``), updating pair counts and positions; return the pairs made."""
    left, right = pair
    made = set()
    for i in sorted(positions):
        j = after[i]
        if symbols[i] != left or j < 0 or symbols[j] != right:
            continue  # stale: a part of this pair went into an earlier merge
        w, h, k = weight[i], before[i], after[j]
        _count(counts, pair, -w)
        if h >= 0:  # the pair to the left now ends in the new symbol
            _count(counts, (symbols[h], left), -w)
            made.add(new := (symbols[h], new_id))
            _count(counts, new, w)
            where[new].append(h)
        if k >= 0:  # and the pair to the right starts with it
            _count(counts, (right, symbols[k]), -w)
            made.add(new := (new_id, symbols[k]))
            _count(counts, new, w)
            where[new].append(i)
            before[k] = i
        symbols[i], symbols[j], after[i] = new_id, -1, k
    return made


def _count(counts: Counter, pair: Pair, change: int) -> None:
    """Add ``change`` to a pair's count, dropping pairs that reach zero (the heap skips them)."""
    count = counts[pair] + change
    if count:
        counts[pair] = count
    else:
        del counts[pair]


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
