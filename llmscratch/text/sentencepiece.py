"""BPE over characters with byte fallback, SentencePiece's kind, as Gemma's tokenizer.json lays it out.

``llmscratch.text.hf_tokenizer`` reads such a file into a ``SentencePieceBPE``; the tokenizer saves and
loads itself in a file format of its own, as ``BPETokenizer`` does.
"""

import functools
import heapq
import json
import os

from llmscratch.files import write_text_atomically
from llmscratch.text.special_tokens import SpecialSet, encode_with_specials, replace_lone_surrogates, split_added_text

SPM_FILE_FORMAT = "llmscratch-sentencepiece-bpe"
SPM_VERSION = 1
SPACE = "\u2581"  # "▁": a space, as SentencePiece's vocabularies write it


class SentencePieceBPE:
    """BPE over characters with byte fallback, as Gemma's tokenizer.json lays it out.

    Spaces become "▁"; the text between special tokens is one word whose characters are the first
    symbols (a character outside the vocabulary: its UTF-8 bytes as the tokens "<0xNN>", or the unknown
    token); then the merge of lowest rank applies, leftmost first, until none does. Special tokens sit
    anywhere in the ids. The same interface as ``BPETokenizer`` for encoding, decoding and files.
    """

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], special_tokens: dict[str, int],
                 unk_token: str | None = None, eos_token: str | None = None, bos_token: str | None = None,
                 name: str = "spm-bpe", added_text: list[str] = (), fuse_unk: bool = True):
        self.name, self.special_tokens = name, dict(special_tokens)
        self.token_ids = dict(vocab)
        self.tokens = {i: token for token, i in {**vocab, **special_tokens}.items()}
        self.merge_list = [tuple(pair) for pair in merges]
        self.ranks: dict[tuple[int, int], tuple[int, int]] = {}  # (left id, right id) -> (rank, merged id)
        for rank, (left, right) in enumerate(self.merge_list):
            ids = vocab.get(left), vocab.get(right), vocab.get(left + right)
            if None in ids:
                raise ValueError(f"merge {rank} ({left!r}, {right!r}) names a token outside the vocabulary")
            self.ranks[ids[:2]] = (rank, ids[2])  # a pair listed twice: the later rank, as in ``tokenizers``
        self.unk_token, self.eos_token, self.bos_token, self.fuse_unk = unk_token, eos_token, bos_token, fuse_unk
        self.added_text = frozenset(added_text)
        if unknown := sorted(self.added_text - set(special_tokens)):
            raise ValueError(f"added_text {unknown} are not among the special tokens")
        for role, token in (("unk_token", unk_token), ("eos_token", eos_token), ("bos_token", bos_token)):
            if token is not None and token not in vocab and token not in special_tokens:
                raise ValueError(f"{role} {token!r} is not a token of this vocabulary")
        self._byte_ids = [vocab.get(f"<0x{b:02X}>") for b in range(256)]  # byte -> the id of its token
        self._byte_of = {token_id: bytes([b]) for b, token_id in enumerate(self._byte_ids) if token_id is not None}
        self._size = max(self.tokens) + 1

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def n_vocab(self) -> int:
        return self.vocab_size

    @property
    def eot_token(self) -> int | None:
        """The id of the end-of-sequence token (Gemma's "<eos>")."""
        return None if self.eos_token is None else self._id(self.eos_token)

    @property
    def bos_id(self) -> int | None:
        """The id a sequence starts with (Gemma's "<bos>"), which ``encode`` does not add."""
        return None if self.bos_token is None else self._id(self.bos_token)

    @functools.cached_property
    def vocab(self) -> dict[int, bytes]:
        """id -> the bytes it stands for, special tokens left out (as ``BPETokenizer.vocab``: bits per byte)."""
        return {i: self.decode_bytes([i]) for token, i in self.token_ids.items() if token not in self.special_tokens}

    def _id(self, token: str) -> int:
        return self.special_tokens.get(token, self.token_ids.get(token))

    def __repr__(self) -> str:
        return (f"SentencePieceBPE(name={self.name!r}, vocab_size={self.vocab_size}, merges={len(self.merge_list)}, "
                f"special_tokens={len(self.special_tokens)})")

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode text, special-token strings as ordinary text (``added_text`` excepted)."""
        return split_added_text(self, text, self._encode_plain)

    def _encode_plain(self, text: str) -> list[int]:
        symbols = []
        for char in replace_lone_surrogates(text).replace(" ", SPACE):
            if (token_id := self.token_ids.get(char)) is not None:
                symbols.append(token_id)
                continue
            fallback = [self._byte_ids[b] for b in char.encode("utf-8")]
            if None not in fallback:
                symbols.extend(fallback)
            elif self.unk_token is not None:
                unk = self._id(self.unk_token)
                if not (self.fuse_unk and symbols and symbols[-1] == unk):  # fused: unknowns in a row are one
                    symbols.append(unk)
            else:
                raise ValueError(f"the character {char!r} has no token, no byte tokens and there is no unknown token")
        return self._merge(symbols)

    def _merge(self, ids: list[int]) -> list[int]:
        """Apply the merge of lowest rank, the leftmost among equals, until none applies."""
        n = len(ids)
        after, before = list(range(1, n + 1)), list(range(-1, n - 1))
        heap = [(*self.ranks[pair], i) for i, pair in enumerate(zip(ids, ids[1:])) if pair in self.ranks]
        heapq.heapify(heap)  # (rank, merged id, left position)
        while heap:
            rank, merged, i = heapq.heappop(heap)
            j = after[i] if ids[i] >= 0 else n
            if j >= n or self.ranks.get((ids[i], ids[j])) != (rank, merged):
                continue  # stale: a part of this pair went into another merge
            ids[i], ids[j] = merged, -1
            after[i] = k = after[j]
            if k < n:
                before[k] = i
                if (found := self.ranks.get((merged, ids[k]))) is not None:
                    heapq.heappush(heap, (*found, i))
            if (h := before[i]) >= 0 and (found := self.ranks.get((ids[h], merged))) is not None:
                heapq.heappush(heap, (*found, h))
        return [token for token in ids if token >= 0]

    def encode(self, text: str, allowed_special: SpecialSet = (), disallowed_special: SpecialSet = "all") -> list[int]:
        """As ``BPETokenizer.encode``: a special token in the text is an error unless allowed or passed as text."""
        return encode_with_specials(self, text, allowed_special, disallowed_special)

    def decode_bytes(self, ids) -> bytes:
        parts = []
        for token_id in ids:
            token = self.tokens.get(int(token_id))
            if token is None:
                raise ValueError(f"token id {int(token_id)} is not in this vocabulary of {self.vocab_size:,} ids")
            byte = self._byte_of.get(int(token_id))
            parts.append(byte if byte is not None else token.replace(SPACE, " ").encode("utf-8"))
        return b"".join(parts)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return json.dumps({"format": SPM_FILE_FORMAT, "version": SPM_VERSION, "name": self.name,
                           "vocab": self.token_ids, "merges": [list(pair) for pair in self.merge_list],
                           "special_tokens": self.special_tokens, "unk_token": self.unk_token,
                           "eos_token": self.eos_token, "bos_token": self.bos_token,
                           "added_text": sorted(self.added_text), "fuse_unk": self.fuse_unk}, ensure_ascii=False) + "\n"

    @classmethod
    def from_document(cls, data: dict, source: str) -> "SentencePieceBPE":
        if data.get("version") != SPM_VERSION:
            raise ValueError(f"{source} has version {data.get('version')!r}; this llmscratch reads version "
                             f"{SPM_VERSION}")
        try:
            return cls(data["vocab"], data["merges"], data["special_tokens"], data["unk_token"], data["eos_token"],
                       data["bos_token"], data["name"], data["added_text"], data["fuse_unk"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{source} is a corrupt tokenizer file: {err}") from None

    def save(self, path: str | os.PathLike) -> None:
        write_text_atomically(path, self.to_json())
