"""Byte-level BPE tokenizer, built from scratch, that matches GPT-2 token for token.

Token ids 0-255 are single bytes, every later id is a merge of two earlier tokens, and
special tokens (such as ``<|endoftext|>``) come last. Training learns the merges from a
text; ``BPETokenizer.gpt2()`` recovers GPT-2's merges from its published ranks. The merge
algorithms themselves are in ``llmscratch.text.bpe`` and the rules for special tokens (tiktoken's) in
``llmscratch.text.special_tokens``; this module adds the pre-splitting regex and the JSON file.
"""

import base64
import functools
import json
import os
import unicodedata
import warnings
from collections import Counter
from collections.abc import Collection, Iterable

import regex
import tiktoken

from llmscratch.assets import GPT2_RANKS_PATH
from llmscratch.files import write_text_atomically
from llmscratch.progress import progress_bar
from llmscratch.text.bpe import Pair, apply_merges, learn_merges, merges_from_ranks
from llmscratch.text.checks import (check_parts, check_shown_merges, check_vocab_size, compile_split_pattern,
                                    read_document, read_tokenizer_text, split_covering)
from llmscratch.text.special_tokens import (SpecialSet, encode_with_specials, replace_lone_surrogates, special_regex,
                                            split_added_text)

# GPT-2's pre-tokenizer: contractions, words, numbers, punctuation runs, whitespace.
# A merge never crosses the boundary between two of these chunks.
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ENDOFTEXT = "<|endoftext|>"
FILE_FORMAT, FILE_VERSION = "llmscratch-bpe", 1
_CACHE_LIMIT = 1 << 17  # chunk-cache entries kept before the cache is cleared
_JSON_VALUE = r'(?:"(?:[^"\\]|\\.)*"|[^\s\[\]{},"]+)'  # a JSON string, number, true, false or null
_FLAT_LIST = regex.compile(rf"\[\n +{_JSON_VALUE}(?:,\n +{_JSON_VALUE})*\n *\]")  # as json.dumps(indent=2) writes it


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

        Two choices that tokenizers made elsewhere need (``llmscratch.text.hf_tokenizer``): ``normalization``, a
        Unicode form ("NFC", "NFKC", "NFD", "NFKD") the text is put in before it is split (Qwen's is NFC);
        ``whole_chunks``, a chunk that is itself a token encodes as that token without merging (tiktoken does
        this, and Hugging Face's ``ignore_merges``); ``bos_token``, a special token a sequence starts with
        (Llama 3's "<|begin_of_text|>"), which ``encode`` does not add (``llmscratch.model.generate.with_bos`` does);
        ``eos_token``, the one that ends it (default ``<|endoftext|>``); ``added_text``, special tokens that
        are text rather than control, always encoded as themselves, wherever they are written (Qwen3's
        "<think>"; Hugging Face's added tokens that are not special).
        """
        self.special_tokens = dict(special_tokens or {})
        merges = list(merges)
        check_parts(merges, self.special_tokens, byte_order, normalization, bos_token, eos_token, added_text)
        self.name = name
        self.normalization, self.whole_chunks = normalization, bool(whole_chunks)
        self.pattern = pattern
        self._split = compile_split_pattern(pattern)
        self.byte_order = list(range(256)) if byte_order is None else list(byte_order)
        self.vocab = {i: bytes([b]) for i, b in enumerate(self.byte_order)}  # id -> bytes
        self.merges: dict[Pair, int] = {}  # (left id, right id) -> merged id
        for new_id, (left, right) in enumerate(merges, start=256):
            self.merges[left, right] = new_id
            self.vocab[new_id] = self.vocab[left] + self.vocab[right]
        self._byte_to_id = [0] * 256
        for token_id, byte in enumerate(self.byte_order):
            self._byte_to_id[byte] = token_id
        self._special_by_id = {i: s.encode("utf-8") for s, i in self.special_tokens.items()}
        self.bos_token, self.eos_token = bos_token, eos_token
        self.added_text = frozenset(added_text)
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
        the chunks the pattern splits the text into (``llmscratch.text.bpe.learn_merges``).
        """
        special_tokens = check_vocab_size(vocab_size, special_tokens)
        n_merges = vocab_size - 256 - len(special_tokens)
        chunk_counts = _count_chunks(text, compile_split_pattern(pattern), special_tokens)
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
        recovered by ``llmscratch.text.bpe.merges_from_ranks``; kwargs as for the constructor."""
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
        text = replace_lone_surrogates(text)
        if self.normalization is not None:
            text = unicodedata.normalize(self.normalization, text)
        cache, ids = self._cache, []
        for chunk in split_covering(self._split, text):
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
        fields, shown = read_document(text, source, FILE_FORMAT, FILE_VERSION)
        try:
            tokenizer = cls(**fields)
        except (ValueError, TypeError) as err:  # the parts' own checks: a sentence that names the bad value
            raise ValueError(f"{source} is a corrupt tokenizer file: {err}") from None
        check_shown_merges(shown, [_readable(tokenizer.vocab[256 + index]) for index in range(len(shown))], source)
        return tokenizer

    def save(self, path: str | os.PathLike) -> None:
        """Write ``to_json()`` to ``path`` atomically (a crash never leaves half a file)."""
        write_text_atomically(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "BPETokenizer":
        """Read a file written by ``save``; a corrupt or unknown file is a ValueError."""
        return cls.from_json(read_tokenizer_text(path), source=str(path))


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


def _count_chunks(text: str, splitter: regex.Pattern, special_tokens: list[str]) -> dict[bytes, int]:
    """Each distinct pre-split chunk of ``text`` as UTF-8 bytes, with how often it occurs."""
    # Special tokens are never learned from the text: cut them out before splitting.
    pieces = special_regex(special_tokens).split(text) if special_tokens else [text]
    counts: Counter[str] = Counter()
    for piece in pieces:
        counts.update(split_covering(splitter, piece))
    return {chunk.encode("utf-8"): count for chunk, count in counts.items()}


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
