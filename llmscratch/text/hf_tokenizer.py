"""Tokenizer files of every kind, read into a tokenizer of ours: Hugging Face's ``tokenizer.json``, so that a
model downloaded with its tokenizer generates and serves text here (the byte-level BPE of GPT-2, Qwen2/Qwen3 and
Llama 3 as a ``BPETokenizer``, Gemma's BPE over characters with byte fallback as a ``SentencePieceBPE``), and the
package's own two formats (``load_tokenizer`` tells them all apart).

A byte-level file keeps each token as text in GPT-2's printable alphabet for bytes (``byte_level_alphabet``),
a merge list or a rank order, its pre-splitting regex, an optional Unicode normalization, and the added
(special) tokens after the vocabulary. Every choice outside these two layouts (Llama 2's prepended "▁",
WordPiece, Unigram, other pre-tokenizers or normalizers) is a ValueError that names it.
"""

import functools
import os
import unicodedata
from pathlib import Path

from llmscratch.files import read_json_object
from llmscratch.text.bpe import merges_from_ranks
from llmscratch.text.checks import (NORMALIZATIONS, check_hf_tokenizer, check_tokenizer_config, parse_tokenizer_json,
                                    read_tokenizer_text)
from llmscratch.text.sentencepiece import SPACE, SPM_FILE_FORMAT, SentencePieceBPE
from llmscratch.text.tokenizer import GPT2_SPLIT_PATTERN, BPETokenizer

__all__ = ["byte_level_alphabet", "load_tokenizer", "tokenizer_from_hf", "tokenizer_from_json"]


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


def tokenizer_from_json(text: str, source: str = "the tokenizer JSON") -> "BPETokenizer | SentencePieceBPE":
    """The tokenizer a file of ours holds (``BPETokenizer.to_json`` or ``SentencePieceBPE.to_json``); a corrupt or
    unknown document is a ValueError naming ``source``."""
    data = parse_tokenizer_json(text, source)
    if isinstance(data, dict) and data.get("format") == SPM_FILE_FORMAT:  # Gemma's kind
        return SentencePieceBPE.from_document(data, source)
    return BPETokenizer.from_json(text, source)


def load_tokenizer(path: str | os.PathLike) -> "BPETokenizer | SentencePieceBPE":
    """The tokenizer in a file: one saved by either of our tokenizers, or a Hugging Face ``tokenizer.json``."""
    path = Path(path)
    text = read_tokenizer_text(path)
    content = parse_tokenizer_json(text, str(path))
    if isinstance(content, dict) and isinstance(content.get("model"), dict) and "format" not in content:
        return tokenizer_from_hf(path)
    return tokenizer_from_json(text, source=str(path))


def tokenizer_from_hf(path: str | os.PathLike) -> "BPETokenizer | SentencePieceBPE":
    """The tokenizer of a Hugging Face ``tokenizer.json`` (or a folder holding one): a ``BPETokenizer`` for
    byte-level BPE, a ``SentencePieceBPE`` for Gemma's.

    Token for token what the ``tokenizers`` library encodes with ``add_special_tokens=False`` (tests/
    test_hf_tokenizer.py); the BOS a post-processor adds (Llama 3's, Gemma's) is its ``bos_id``, and the
    eos_token of tokenizer_config.json beside it its ``eot_token``. Added tokens marked special become special
    tokens (encoded as such only where ``encode`` allows them, as for any of ours); the others are
    ``added_text``, encoded as themselves wherever they are written.
    """
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    data = read_json_object(file)
    if not isinstance(data.get("model"), dict):
        raise ValueError(f"{file} is not a tokenizer.json: it has no 'model' object")
    model = data["model"]
    _check_model(model, file)
    check_hf_tokenizer(data, file)
    if model.get("byte_fallback"):
        return _sentencepiece_bpe(data, file)
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        raise ValueError(f"{file}: the BPE model needs a 'vocab' object and a 'merges' list")
    normalization = _normalization(data.get("normalizer"), file)
    added, added_text = _added_tokens(data, file, lambda text: unicodedata.normalize(normalization, text)
                                      if normalization else text)
    regular = {_token_bytes(token, file): token_id for token, token_id in vocab.items() if token not in added}
    n = len(regular)
    if sorted(regular.values()) != list(range(n)):
        raise ValueError(f"{file}: the vocabulary's ids (added tokens aside) must be 0..{n - 1}, each once")
    if sorted(added.values()) != list(range(n, n + len(added))):
        raise ValueError(f"{file}: the added tokens' ids {sorted(added.values())} must follow the vocabulary's "
                         f"{n:,} ids ({n}..{n + len(added) - 1}); llmscratch keeps special tokens last")
    options = dict(pattern=_split_pattern(data.get("pre_tokenizer"), file),
                   special_tokens=added, name=file.parent.name or "hf",
                   normalization=normalization,
                   whole_chunks=bool(model.get("ignore_merges")), bos_token=_first_special(data),
                   eos_token=_config_token(file, "eos_token", added), added_text=added_text)
    merges = _merge_pairs(merges, file)
    _check_merges_known(merges, vocab, file)
    listed = _merges_in_id_order(regular, merges, vocab)
    if listed is not None:  # the merge list makes ids 256, 257, ... in order: read as it is
        byte_order, pairs = listed
        return _named(file, lambda: BPETokenizer(pairs, byte_order=byte_order, **options))
    # Else a vocabulary in tiktoken's rank order, as Llama 3's: the list holds every split of each token, sorted
    # by the id of what it makes, so an earlier merge is one that makes a smaller id, as in tiktoken's BPE, and
    # the merges are recovered from the ranks. (Two merges that make the same token: the list's order picks one,
    # ours the leftmost in the text. They give the same token; only the split of the rest could differ.)
    made = [vocab.get(left + right) for left, right in merges]
    in_rank_order = None not in made and all(a <= b for a, b in zip(made, made[1:]))
    try:
        if not in_rank_order:
            raise ValueError("the merge list is not sorted by the ids of the tokens it makes")
        byte_order, ranked = merges_from_ranks(regular)
    except ValueError as err:
        raise ValueError(f"{file}: the merges make the tokens neither in id order nor in rank order ({err})") from None
    return _named(file, lambda: BPETokenizer(ranked, byte_order=byte_order, **options))


def _check_merges_known(merges: list[tuple[str, str]], vocab: dict[str, int], file: Path) -> None:
    """ValueError naming the first merge that joins, or makes, a token the vocabulary lacks (the tokenizers
    library refuses such a file too)."""
    for index, (left, right) in enumerate(merges):
        for token, what in ((left, "joins"), (right, "joins"), (left + right, "makes")):
            if token not in vocab:
                raise ValueError(f"{file}: merges[{index}] {what} {token!r}, which is not in the vocabulary")


def _named(file: Path, make):
    """``make()``, its ValueError (a part the tokenizer refuses: its split pattern, a role) naming ``file``."""
    try:
        return make()
    except ValueError as err:
        raise ValueError(f"{file}: {err}") from None


def _check_model(model: dict, file: Path) -> None:
    """A BPE model, or a ValueError naming what it is instead."""
    if model.get("type", "BPE") != "BPE":
        raise ValueError(f"{file}: a {model['type']} tokenizer; llmscratch reads BPE only: byte-level (GPT-2, "
                         "Qwen2/Qwen3, Llama 3) or with byte fallback (Gemma)")
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key):
            raise ValueError(f"{file}: the BPE model sets {key}={model[key]!r}, which llmscratch's BPE leaves unset")


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
    if (pattern is None or split.get("behavior") != "Isolated" or split.get("invert")
            or byte_level.get("use_regex", True)):  # a second split by GPT-2's regex: not supported
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


def _merge_pairs(merges: list, file: Path) -> list[tuple[str, str]]:
    """The merge list as (left, right) pairs, whether written "a b" or ["a", "b"]."""
    pairs = [tuple(merge.split(" ") if isinstance(merge, str) else merge) for merge in merges]
    if bad := next((merge for merge in pairs if len(merge) != 2), None):
        raise ValueError(f"{file}: each merge must be two tokens, got {bad}")
    return pairs


def _merges_in_id_order(regular: dict[bytes, int], merges: list[tuple[str, str]], vocab: dict[str, int]
                        ) -> tuple[list[int], list[tuple[int, int]]] | None:
    """(byte order, merges as id pairs) when ids 0-255 are the bytes and merge i makes id 256 + i; else None."""
    by_id = sorted(regular, key=regular.get)
    if len(merges) != len(by_id) - 256 or any(len(token) != 1 for token in by_id[:256]):
        return None
    pairs = []
    for index, (left, right) in enumerate(merges):
        ids = vocab.get(left), vocab.get(right), vocab.get(left + right)
        if ids[2] != 256 + index or None in ids:
            return None
        pairs.append(ids[:2])
    return [token[0] for token in by_id[:256]], pairs


def _added_tokens(data: dict, file: Path, normalize) -> tuple[dict[str, int], list[str]]:
    """The added tokens ({content: id}), and those among them that are not special: text, which the
    ``tokenizers`` library matches wherever it is written (Qwen3's "<think>", Gemma's runs of spaces).

    They are matched in the text as written. One marked ``normalized`` that the normalizer changes (a run of
    spaces under Gemma's) would be matched in the normalized text instead: a ValueError names it.
    """
    entries = data.get("added_tokens") or []
    for entry in entries:
        if entry.get("normalized") and normalize(entry["content"]) != entry["content"]:
            raise ValueError(f"{file}: the added token {entry['content']!r} is matched after normalization, as "
                             f"{normalize(entry['content'])!r}, which llmscratch does not do")
    return ({entry["content"]: entry["id"] for entry in entries},
            [entry["content"] for entry in entries if not entry.get("special", False)])


def _config_token(file: Path, key: str, known: dict[str, int]) -> str | None:
    """The token tokenizer_config.json beside ``file`` names for ``key`` (eos_token), if it is one of ``known``."""
    config_file = file.parent / "tokenizer_config.json"
    config = read_json_object(config_file) if config_file.is_file() else {}
    check_tokenizer_config(config, config_file)
    token = config.get(key)
    token = token.get("content") if isinstance(token, dict) else token
    return token if token in known else None


def _first_special(data: dict) -> str | None:
    """The special token the post-processor puts first (Llama 3's and Gemma's BOS), or None."""
    processor = data.get("post_processor") or {}
    steps = processor.get("processors", [processor])  # a Sequence of processors, or one
    for step in steps:
        if step.get("type") == "TemplateProcessing" and step.get("single"):
            return (step["single"][0].get("SpecialToken") or {}).get("id")
    return None


# --------------------------------------------------------------------------- SentencePiece-style BPE (Gemma)
def _sentencepiece_bpe(data: dict, file: Path) -> "SentencePieceBPE":
    """Gemma's layout: spaces replaced by "▁", no split (or a split on spaces, which none are left to match),
    BPE with byte fallback; the BOS its post-processor puts first, the EOS tokenizer_config.json names."""
    model = data["model"]
    normalizer, pre_tokenizer = data.get("normalizer") or {}, data.get("pre_tokenizer")
    if (normalizer.get("type"), (normalizer.get("pattern") or {}).get("String"), normalizer.get("content")) != (
            "Replace", " ", SPACE):
        raise ValueError(f"{file}: a BPE with byte fallback is read with Gemma's normalizer (Replace ' ' by "
                         f"'{SPACE}') only, not {normalizer or None}")
    if pre_tokenizer is not None and (pre_tokenizer.get("type"), (pre_tokenizer.get("pattern") or {}).get("String")
                                      ) != ("Split", " "):
        raise ValueError(f"{file}: a BPE with byte fallback is read without a pre-tokenizer (as Gemma's), "
                         f"not with {pre_tokenizer.get('type')}")
    if model.get("ignore_merges"):
        raise ValueError(f"{file}: ignore_merges with byte fallback is not supported")
    merges = _merge_pairs(model.get("merges") or [], file)
    added, added_text = _added_tokens(data, file, lambda text: text.replace(" ", SPACE))
    eos_token = _config_token(file, "eos_token", {**model["vocab"], **added})
    return _named(file, lambda: SentencePieceBPE(model["vocab"], merges, added, model.get("unk_token"), eos_token,
                                                 _first_special(data), file.parent.name or "hf",
                                                 added_text=added_text, fuse_unk=bool(model.get("fuse_unk", False))))
