"""Hugging Face's ``tokenizer.json`` read as a ``BPETokenizer``: the byte-level BPE of GPT-2, Qwen2/Qwen3 and
Llama 3, so that a model downloaded with its tokenizer generates and serves text here.

Such a file keeps each token as text in GPT-2's printable alphabet for bytes (``byte_level_alphabet``), a
merge list or a rank order, its pre-splitting regex, an optional Unicode normalization, and the added
(special) tokens after the vocabulary. Every choice outside that (SentencePiece-style BPE with byte fallback,
as Gemma's and Llama 2's; WordPiece; Unigram; other pre-tokenizers) is a ValueError that names it.
"""

import functools
import os
from pathlib import Path

from llmscratch.bpe import merges_from_ranks
from llmscratch.hf_formats import read_json_object
from llmscratch.tokenizer import GPT2_SPLIT_PATTERN, BPETokenizer

__all__ = ["byte_level_alphabet", "tokenizer_from_hf"]

NORMALIZATIONS = ("NFC", "NFKC", "NFD", "NFKD")


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """The character that stands for each byte in a byte-level vocabulary: char -> byte.

    The 188 bytes that are printable Latin-1 ("!" to "~", "¡" to "¬", "®" to "ÿ") stand for themselves;
    the other 68 (control characters, the space, the soft hyphen) take the characters from U+0100 up, in
    byte order. So " hello" is kept as "Ġhello" (U+0120 is the 33rd of those, for byte 32).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + i): b for i, b in enumerate(others)})
    return alphabet


def tokenizer_from_hf(path: str | os.PathLike) -> BPETokenizer:
    """The ``BPETokenizer`` of a Hugging Face ``tokenizer.json`` (or a folder holding one).

    Token for token what the ``tokenizers`` library encodes with ``add_special_tokens=False`` (tests/
    test_hf_tokenizer.py): a post-processor's added BOS is not added. Added tokens become special tokens
    (encoded as such only where ``encode`` allows them, as for any of ours).
    """
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    data = read_json_object(file)
    if not isinstance(data.get("model"), dict):
        raise ValueError(f"{file} is not a tokenizer.json: it has no 'model' object")
    model = data["model"]
    _check_model(model, file)
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        raise ValueError(f"{file}: the BPE model needs a 'vocab' object and a 'merges' list")
    added = {entry["content"]: entry["id"] for entry in data.get("added_tokens") or []}
    regular = {_token_bytes(token, file): token_id for token, token_id in vocab.items() if token not in added}
    n = len(regular)
    if sorted(regular.values()) != list(range(n)):
        raise ValueError(f"{file}: the vocabulary's ids (added tokens aside) must be 0..{n - 1}, each once")
    if sorted(added.values()) != list(range(n, n + len(added))):
        raise ValueError(f"{file}: the added tokens' ids {sorted(added.values())} must follow the vocabulary's "
                         f"{n:,} ids ({n}..{n + len(added) - 1}); llmscratch keeps special tokens last")
    options = dict(pattern=_split_pattern(data.get("pre_tokenizer"), file),
                   special_tokens=added, name=file.parent.name or "hf",
                   normalization=_normalization(data.get("normalizer"), file),
                   whole_chunks=bool(model.get("ignore_merges")))
    listed = _merges_in_id_order(regular, merges, vocab)
    if listed is not None:  # the merge list makes ids 256, 257, ... in order: read as it is
        byte_order, pairs = listed
        return BPETokenizer(pairs, byte_order=byte_order, **options)
    # Else a vocabulary in tiktoken's rank order, as Llama 3's: the list holds every split of each token, sorted
    # by the id of what it makes, so an earlier merge is one that makes a smaller id, as in tiktoken's BPE, and
    # the merges are recovered from the ranks. (Two merges that make the same token: the list's order picks one,
    # ours the leftmost in the text. They give the same token; only the split of the rest could differ.)
    made = [vocab.get("".join(merge.split(" ") if isinstance(merge, str) else merge)) for merge in merges]
    in_rank_order = None not in made and all(a <= b for a, b in zip(made, made[1:]))
    try:
        if not in_rank_order:
            raise ValueError("the merge list is not sorted by the ids of the tokens it makes")
        byte_order, ranked = merges_from_ranks(regular)
    except ValueError as err:
        raise ValueError(f"{file}: the merges make the tokens neither in id order nor in rank order ({err})") from None
    return BPETokenizer(ranked, byte_order=byte_order, **options)


def _check_model(model: dict, file: Path) -> None:
    """A byte-level BPE model, or a ValueError naming what it is instead."""
    if model.get("type", "BPE") != "BPE":
        raise ValueError(f"{file}: a {model['type']} tokenizer; llmscratch reads byte-level BPE only "
                         "(GPT-2, Qwen2/Qwen3, Llama 3)")
    if model.get("byte_fallback"):
        raise ValueError(f"{file}: a SentencePiece-style BPE (byte_fallback, as Gemma's and Llama 2's), which "
                         "llmscratch does not read yet; it reads byte-level BPE (GPT-2, Qwen2/Qwen3, Llama 3)")
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key):
            raise ValueError(f"{file}: the BPE model sets {key}={model[key]!r}, which byte-level BPE leaves unset")


def _token_bytes(token: str, file: Path) -> bytes:
    alphabet = byte_level_alphabet()
    try:
        return bytes(alphabet[char] for char in token)
    except KeyError as err:
        raise ValueError(f"{file}: the token {token!r} has the character {err.args[0]!r}, which stands for no "
                         "byte: this is no byte-level vocabulary") from None


def _split_pattern(pre_tokenizer: dict | None, file: Path) -> str:
    """The regex that splits text into chunks: a Split's, before a ByteLevel that adds none, or GPT-2's."""
    steps = (pre_tokenizer or {}).get("pretokenizers", [pre_tokenizer]) if pre_tokenizer else []
    kinds = [step.get("type") for step in steps]
    byte_level = steps[-1] if kinds and kinds[-1] == "ByteLevel" else None
    if byte_level is None or kinds[:-1] not in ([], ["Split"]):
        raise ValueError(f"{file}: the pre-tokenizer {kinds or None} is not supported; byte-level BPE has a "
                         "ByteLevel pre-tokenizer, after one Split or alone")
    if byte_level.get("add_prefix_space"):
        raise ValueError(f"{file}: the ByteLevel pre-tokenizer adds a prefix space, which llmscratch does not")
    if kinds == ["ByteLevel"]:
        if not byte_level.get("use_regex", True):
            raise ValueError(f"{file}: a ByteLevel pre-tokenizer without a regex would not split the text")
        return GPT2_SPLIT_PATTERN  # what ByteLevel's use_regex splits by
    split = steps[0]
    pattern = (split.get("pattern") or {}).get("Regex")
    if pattern is None or split.get("behavior") != "Isolated" or split.get("invert") or byte_level.get("use_regex"):
        raise ValueError(f"{file}: the Split pre-tokenizer {split} is not supported: a Regex pattern, behavior "
                         "Isolated, not inverted, and a ByteLevel after it with use_regex false are")
    return pattern


def _normalization(normalizer: dict | None, file: Path) -> str | None:
    steps = (normalizer or {}).get("normalizers", [normalizer]) if normalizer else []
    kinds = [step.get("type") for step in steps]
    if not kinds:
        return None
    if len(kinds) == 1 and kinds[0] in NORMALIZATIONS:
        return kinds[0]
    raise ValueError(f"{file}: the normalizer {kinds} is not supported; one of {NORMALIZATIONS} or none is")


def _merges_in_id_order(regular: dict[bytes, int], merges: list, vocab: dict[str, int]
                        ) -> tuple[list[int], list[tuple[int, int]]] | None:
    """(byte order, merges as id pairs) when ids 0-255 are the bytes and merge i makes id 256 + i; else None."""
    by_id = sorted(regular, key=regular.get)
    if len(merges) != len(by_id) - 256 or any(len(token) != 1 for token in by_id[:256]):
        return None
    pairs = []
    for index, merge in enumerate(merges):
        left, right = merge.split(" ") if isinstance(merge, str) else merge  # "a b" or ["a", "b"]
        ids = vocab.get(left), vocab.get(right), vocab.get(left + right)
        if ids[2] != 256 + index or None in ids:
            return None
        pairs.append(ids[:2])
    return [token[0] for token in by_id[:256]], pairs
