"""Our tokenizers written as a Hugging Face tokenizer folder, so that a model exported with one runs in
transformers, vLLM and anything else that reads ``tokenizer.json`` (the inverse of ``hf_tokenizer``).

Three files: ``tokenizer.json`` in the ``tokenizers`` library's format, ``tokenizer_config.json`` (the
special tokens' roles, the context length, a chat template) and ``generation_config.json`` (the ids a reply
ends on). A ``BPETokenizer`` is written as byte-level BPE (Qwen's layout: a Split on its own pattern, then
bytes as characters, the merges in order); a ``SentencePieceBPE`` as Gemma's (spaces as "▁", byte fallback).
Where the ``tokenizers`` library is installed, the written tokenizer is first tried in it on a probe text,
so that one it would read differently (a split pattern its regex engine takes otherwise) is refused by name.

One limit stays: the ``tokenizers`` library's regex engine knows Unicode as of version 14, the ``regex``
module a later one, so letters assigned since (none in any text of the course) may split differently.
"""

import json
import os
from pathlib import Path

from llmscratch.files import write_text_atomically
from llmscratch.text.checks import compile_split_pattern, split_covering
from llmscratch.text.hf_tokenizer import byte_level_alphabet
from llmscratch.text.sentencepiece import SPACE, SentencePieceBPE
from llmscratch.text.tokenizer import ENDOFTEXT, BPETokenizer

__all__ = ["save_tokenizer_hf", "tokenizer_document"]

# Tried in the tokenizers library before anything is written: letters, digits, punctuation, whitespace runs,
# contractions, accents composed and not, emoji sequences, CJK, control characters.
PROBE_TEXT = ("Hello, world! It's 2026: 3.14159 + 1234567 = ?  DON'T we'll ünïcödé café cafe\u0301 中文 日本語 한국어 "
              "😀👩‍👩‍👧 a_b-c.d/e\\f (x) [y] {'q': \"q\"}\t\n\r\n\n   indented\u00a0\u2028\x00\x1b\x7f\u200b end  ")


def save_tokenizer_hf(tokenizer: "BPETokenizer | SentencePieceBPE", folder: str | os.PathLike, *,
                      chat_template: str | None = None, model_max_length: int | None = None) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` into ``folder``.

    ``AutoTokenizer.from_pretrained(folder)`` then encodes as ``tokenizer.encode(text, allowed_special="all")``
    does (with ``add_special_tokens=False``; with it, the BOS is added as ``with_bos`` adds it), and
    ``tokenizer_from_hf(folder)`` reads back the same tokenizer. A tokenizer the format cannot hold is a
    ValueError naming why, raised before any file is written; each file is written atomically.
    """
    if model_max_length is not None and (not isinstance(model_max_length, int) or model_max_length < 1):
        raise ValueError(f"model_max_length must be a positive number of tokens, got {model_max_length!r}")
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError(f"chat_template must be Jinja text, got {type(chat_template).__name__}")
    document = tokenizer_document(tokenizer)
    _try_in_tokenizers_library(document, tokenizer)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomically(folder / "tokenizer.json", json.dumps(document, ensure_ascii=False) + "\n")
    write_text_atomically(folder / "tokenizer_config.json",
                          json.dumps(_config(tokenizer, chat_template, model_max_length), ensure_ascii=False,
                                     indent=2) + "\n")
    ends = {"eos_token_id": tokenizer.eot_token, "bos_token_id": tokenizer.bos_id}
    write_text_atomically(folder / "generation_config.json",
                          json.dumps({key: value for key, value in ends.items() if value is not None}, indent=2) + "\n")


def tokenizer_document(tokenizer: "BPETokenizer | SentencePieceBPE") -> dict:
    """The ``tokenizer.json`` document (a dict) that holds ``tokenizer``."""
    if isinstance(tokenizer, SentencePieceBPE):
        return _sentencepiece_document(tokenizer)
    if isinstance(tokenizer, BPETokenizer):
        return _byte_level_document(tokenizer)
    raise ValueError(f"a {type(tokenizer).__name__} cannot be written as a tokenizer.json; a BPETokenizer or a "
                     "SentencePieceBPE can (tiktoken's GPT-2: use BPETokenizer.gpt2())")


def _byte_level_document(tokenizer: BPETokenizer) -> dict:
    """Qwen's layout: a Split on the tokenizer's pattern, each chunk's bytes as characters, BPE by the merge list
    (merge i makes id 256 + i), the special tokens added after the vocabulary."""
    to_char = {byte: char for char, byte in byte_level_alphabet().items()}
    vocab: dict[str, int] = {}
    for token_id, token in sorted(tokenizer.vocab.items()):
        text = "".join(to_char[byte] for byte in token)
        if text in vocab:  # a dict of tokens holds each text once: the merges could not tell the two apart
            raise ValueError(f"ids {vocab[text]} and {token_id} are the same bytes {token!r}; a tokenizer.json "
                             "keeps each token once")
        vocab[text] = token_id
    if clash := next((token for token in tokenizer.special_tokens if token in vocab), None):
        raise ValueError(f"the special token {clash!r} is also the text of token {vocab[clash]}; a tokenizer.json "
                         "would give both one id")
    text_of = {token_id: text for text, token_id in vocab.items()}
    merges = [[text_of[left], text_of[right]]
              for (left, right), _ in sorted(tokenizer.merges.items(), key=lambda item: item[1])]
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": _added_tokens(tokenizer),
        "normalizer": None if tokenizer.normalization is None else {"type": tokenizer.normalization},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": tokenizer.pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": _bos_first(tokenizer),
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": tokenizer.whole_chunks, "vocab": vocab, "merges": merges},
    }


def _sentencepiece_document(tokenizer: SentencePieceBPE) -> dict:
    """Gemma's layout: spaces replaced by "▁", the text one word, BPE over characters with byte fallback."""
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": _added_tokens(tokenizer),
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
        "pre_tokenizer": None,
        "post_processor": _bos_first(tokenizer),
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": tokenizer.unk_token, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": tokenizer.fuse_unk, "byte_fallback": True,
                  "ignore_merges": False, "vocab": tokenizer.token_ids,
                  "merges": [list(pair) for pair in tokenizer.merge_list]},
    }


def _added_tokens(tokenizer) -> list[dict]:
    """The special tokens, matched in the text as written (not normalized). Those that are text (``added_text``)
    are not special, so that decoding with skip_special_tokens keeps them, as Qwen3's "<think>"."""
    return [{"id": token_id, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": token not in tokenizer.added_text}
            for token, token_id in sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])]


def _bos_first(tokenizer) -> dict | None:
    """A post-processor that puts the BOS first, as Llama 3's and Gemma's do; None for a tokenizer without one."""
    if tokenizer.bos_token is None:
        return None
    bos = tokenizer.bos_token
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [tokenizer.bos_id], "tokens": [bos]}}}


def _config(tokenizer, chat_template: str | None, model_max_length: int | None) -> dict:
    """tokenizer_config.json: transformers' generic fast tokenizer, and the roles of the special tokens. The
    package pads with the end token (``instruct.collate``), so the pad token is the EOS."""
    eos = tokenizer.eos_token or (ENDOFTEXT if ENDOFTEXT in tokenizer.special_tokens else None)
    roles = {"bos_token": tokenizer.bos_token, "eos_token": eos, "pad_token": eos,
             "unk_token": getattr(tokenizer, "unk_token", None)}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **{key: token for key, token in roles.items() if token},
              "clean_up_tokenization_spaces": False}
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def _try_in_tokenizers_library(document: dict, tokenizer) -> None:
    """Refuse a document the ``tokenizers`` library reads otherwise: one it fails to load, a split pattern its
    regex engine (Oniguruma, which lacks some of the ``regex`` module's syntax) splits ``PROBE_TEXT`` by
    otherwise, or other ids on it. Without the library installed there is nothing to try it in, and the
    document is written as it is."""
    try:
        from tokenizers import Regex, Tokenizer, pre_tokenizers
    except ImportError:
        return
    pattern = getattr(tokenizer, "pattern", None)  # a SentencePieceBPE splits by none
    try:
        loaded = Tokenizer.from_str(json.dumps(document))
        split = pattern and pre_tokenizers.Split(Regex(pattern), behavior="isolated").pre_tokenize_str(PROBE_TEXT)
    except Exception as err:  # noqa: BLE001 (the library raises plain Exception: a pattern it cannot compile)
        raise ValueError(f"the tokenizers library cannot read this tokenizer ({err}); its split pattern is "
                         f"{pattern!r}") from None
    if split and (theirs := [piece for piece, _ in split]) != (ours := split_covering(
            compile_split_pattern(pattern), PROBE_TEXT)):
        at = next(i for i, (a, b) in enumerate(zip([*theirs, None], [*ours, None])) if a != b)
        raise ValueError(f"the tokenizers library's regex engine splits text by the pattern {pattern!r} otherwise "
                         f"than the regex module: chunk {at} is {theirs[at:at + 1]} there, {ours[at:at + 1]} here")
    expected = tokenizer.encode(PROBE_TEXT, allowed_special="all")
    got = loaded.encode(PROBE_TEXT, add_special_tokens=False).ids
    if got != expected:
        at = next(i for i, (a, b) in enumerate(zip([*got, None], [*expected, None])) if a != b)
        raise ValueError(f"the tokenizers library would encode this tokenizer's text differently: from token {at}, "
                         f"{tokenizer.decode(expected[at:at + 3])!r} as {got[at:at + 3]}, not {expected[at:at + 3]}")
