"""Hugging Face tokenizer.json files read as BPETokenizer (llmscratch.text.hf_tokenizer), each against the
``tokenizers`` library encoding the same file. The files are trained here, offline, in the layouts the hubs
use: Qwen2/Qwen3's (a Split regex, NFC, a merge list in id order, added tokens), GPT-2's (ByteLevel's own
regex) and Llama 3's (a vocabulary in tiktoken's rank order, several merges per token, ignore_merges)."""

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from llmscratch.assets import read_moby_dick
from llmscratch.model.config import GPTConfig
from llmscratch.model.generate import with_bos
from llmscratch.model.gpt import GPT
from llmscratch.model.weights import load_model_and_tokenizer, save_hf
from llmscratch.text.hf_tokenizer import byte_level_alphabet, load_tokenizer, tokenizer_from_hf
from llmscratch.text.sentencepiece import SentencePieceBPE
from llmscratch.text.tokenizer import BPETokenizer

# Qwen2's and Qwen3's split pattern (one digit per chunk, case-insensitive contractions, newlines kept apart).
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT_TOKENS = ["<think>", "</think>"]  # as Qwen3's: added tokens that are not special
TEXTS = [
    "Call me Ishmael. Some years ago--never mind how long precisely--having little or no money in my purse,",
    "DON'T SHOUT, it's 2026: 3.14159 + 1234567 = ?\n\n\n  \tindented\r\n",
    "ünïcödé 中文 日本語 한국어 😀👩‍👩‍👧 café (NFC) and cafe\u0301 (NFD)",
    "def f(x):\n    return {'a': [1, 2]}  # code\n",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm</think>\nSo.",
    "   leading and trailing spaces   ", "", "\u00a0\u2028\x00\x7f",
]


def training_text() -> list[str]:
    moby = read_moby_dick()[:60_000]
    return [moby[i:i + 2_000] for i in range(0, len(moby), 2_000)] + TEXTS * 3


def trained(pre_tokenizer, normalizer=None, vocab_size=700) -> Tokenizer:
    """A byte-level BPE trained by ``tokenizers``; the added tokens come after the vocabulary, as on the hub."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(training_text(), trainer)
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.add_tokens(TEXT_TOKENS)  # added, not special: text, matched wherever it is written
    return tokenizer


def qwen_style() -> Tokenizer:
    return trained(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), normalizers.NFC())


def gpt2_style() -> Tokenizer:
    return trained(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), vocab_size=600)


def llama3_style(tmp_path) -> Tokenizer:
    """The Qwen-style vocabulary re-listed as a tiktoken conversion lists it: every split of each token into
    two tokens is a merge, the merges sorted by the rank (id) of what they make, and ignore_merges on."""
    document = json.loads(qwen_style().to_str())
    vocab = document["model"]["vocab"]
    merges = sorted(((left, right) for token, rank in vocab.items() for i in range(1, len(token))
                     if (left := token[:i]) in vocab and (right := token[i:]) in vocab
                     and vocab[left] < rank and vocab[right] < rank),
                    key=lambda pair: (vocab[pair[0] + pair[1]], vocab[pair[0]], vocab[pair[1]]))
    document["model"].update(merges=[list(pair) for pair in merges], ignore_merges=True)
    document["normalizer"] = None
    start = SPECIALS[1]  # as Llama 3's <|begin_of_text|>: the post-processor puts it first
    added = {entry["content"]: entry["id"] for entry in document["added_tokens"]}
    document["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": start, "type_id": 0}},
                                                  {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {start: {"id": start, "ids": [added[start]], "tokens": [start]}}}]}
    path = tmp_path / "llama3.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    return Tokenizer.from_file(str(path))


@pytest.fixture(scope="module", params=["qwen", "gpt2", "llama3"])
def pair(request, tmp_path_factory):
    """(the tokenizers library's tokenizer, ours read from its saved tokenizer.json)."""
    folder = tmp_path_factory.mktemp(request.param)
    reference = llama3_style(folder) if request.param == "llama3" else (
        qwen_style() if request.param == "qwen" else gpt2_style())
    reference.save(str(folder / "tokenizer.json"))
    return reference, tokenizer_from_hf(folder)


def assert_same(pair, text: str) -> None:
    reference, ours = pair
    expected = reference.encode(text, add_special_tokens=False).ids
    assert ours.encode(text, allowed_special="all") == expected, text
    assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=False)
    with_start = reference.encode(text).ids  # its post-processor's BOS added
    if ours.bos_id is not None and with_start[1:2] == [ours.bos_id]:
        with_start = with_start[1:]  # a text that starts with the BOS already: ours keeps one, not two
    assert with_bos(ours, ours.encode(text, allowed_special="all")) == with_start


@pytest.mark.parametrize("text", TEXTS + [read_moby_dick()[200_000:230_000]])
def test_encodes_as_the_tokenizers_library_does(pair, text):
    assert_same(pair, text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_encodes_arbitrary_text_as_the_tokenizers_library_does(pair, text):
    assert_same(pair, text)


def test_the_layouts_take_both_paths_and_keep_their_choices(tmp_path):
    qwen = tokenizer_from_hf(_saved(qwen_style(), tmp_path / "qwen"))
    llama3 = tokenizer_from_hf(_saved(llama3_style(tmp_path), tmp_path / "llama3"))
    assert (qwen.normalization, qwen.whole_chunks, qwen.bos_id) == ("NFC", False, None)
    assert (llama3.normalization, llama3.whole_chunks, llama3.bos_id) == (None, True, 701)
    assert qwen.merges == llama3.merges  # the merge list read as it is, and recovered from the ranks
    assert qwen.special_tokens == {token: 700 + i for i, token in enumerate(SPECIALS + TEXT_TOKENS)}
    assert qwen.eot_token == 700
    again = BPETokenizer.from_json(qwen.to_json())  # our own file keeps both choices
    assert (again.normalization, again.whole_chunks, again.merges) == ("NFC", False, qwen.merges)
    assert again.encode("cafe\u0301") == qwen.encode("caf\u00e9")
    assert BPETokenizer.from_json(llama3.to_json()).bos_token == SPECIALS[1]


def test_added_text_is_itself_wherever_it_is_written_and_special_tokens_only_where_allowed(pair, tmp_path):
    reference, ours = pair
    text = "a<think>b</think> <|im_end|>"
    expected = reference.encode(text, add_special_tokens=False).ids
    assert ours.encode(text, allowed_special="all") == expected
    with pytest.raises(ValueError, match="special token '<\\|im_end\\|>'"):  # <think> is no reason to refuse
        ours.encode(text)
    as_text = ours.encode(text, disallowed_special=())
    assert as_text[: len(expected) - 1] == expected[:-1] and as_text[-1] != expected[-1]  # <|im_end|> as text
    assert ours.added_text == {"<think>", "</think>"}


def test_the_folders_eos_token_ends_a_text(tmp_path):
    folder = _saved(qwen_style(), tmp_path / "qwen3")
    assert tokenizer_from_hf(folder).eot_token == 700  # <|endoftext|>
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}),
                                                  encoding="utf-8")
    tokenizer = tokenizer_from_hf(folder)
    assert tokenizer.eot_token == 702 and BPETokenizer.from_json(tokenizer.to_json()).eot_token == 702
    assert BPETokenizer.from_json(tokenizer.to_json()).added_text == {"<think>", "</think>"}


def test_the_byte_alphabet_is_gpt2s():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["Ġ"] == 32 and alphabet["Ċ"] == 10 and alphabet["!"] == 33 and alphabet["ÿ"] == 255
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())


def _saved(tokenizer: Tokenizer, folder) -> object:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def _edited(tmp_path, edit) -> object:
    document = json.loads(qwen_style().to_str())
    edit(document)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["model"].update(byte_fallback=True), "read with Gemma's normalizer"),
    (lambda d: d["model"].update(type="WordPiece"), "a WordPiece tokenizer"),
    (lambda d: d.update(pre_tokenizer={"type": "Whitespace"}), "pre-tokenizer ['Whitespace'] is not supported"),
    (lambda d: d["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True), "adds a prefix space"),
    (lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(behavior="Removed"), "Split pre-tokenizer"),
    (lambda d: d["pre_tokenizer"]["pretokenizers"][1].pop("use_regex"), "Split pre-tokenizer"),  # true by default
    (lambda d: d.update(normalizer={"type": "Lowercase"}), "normalizer ['Lowercase'] is not supported"),
    (lambda d: d["added_tokens"][0].update(id=5), "added tokens' ids"),
    (lambda d: d["model"]["vocab"].update({"\u4e2d": 9999}), "stands for no byte"),
    (lambda d: d["model"]["merges"].reverse(), "neither in id order nor in rank order"),
    (lambda d: d.pop("model"), "has no 'model' object"),
])
def test_what_it_cannot_read_is_named(tmp_path, edit, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tokenizer_from_hf(_edited(tmp_path, edit))


def test_a_hugging_face_folder_loads_with_its_own_tokenizer(tmp_path):
    """load_model_and_tokenizer (generate.py, the server) finds tokenizer.json beside config.json."""
    folder = _saved(qwen_style(), tmp_path / "qwen3")
    config = GPTConfig.from_preset("qwen3-0.6b", vocab_size=768, context_length=64, d_model=32, n_layers=1,
                                   n_heads=2, n_kv_heads=1, head_size=16, d_ff=64)
    save_hf(GPT(config), folder)
    model, tokenizer = load_model_and_tokenizer(folder)
    assert tokenizer.vocab_size == 705 and tokenizer.normalization == "NFC"
    assert model.config.vocab_size == 768
    (folder / "tokenizer.json").rename(tmp_path / "elsewhere.json")  # given with --tokenizer instead
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_model_and_tokenizer(folder)
    assert load_model_and_tokenizer(folder, tmp_path / "elsewhere.json")[1].merges == tokenizer.merges
    (folder / "tokenizer.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ValueError, match="has no 'model' object"):
        load_model_and_tokenizer(folder)


def test_gpt2s_own_tokenizer_json_reads_back_as_gpt2(tmp_path):
    """GPT-2's vocabulary laid out as the hub's tokenizer.json (50,000 merges, <|endoftext|> both in the vocab
    and added), written from the bundled ranks: ours, the tokenizers library and tiktoken agree on a novel."""
    gpt2 = BPETokenizer.gpt2()
    to_char = {byte: char for char, byte in byte_level_alphabet().items()}
    text_of = {i: "".join(to_char[b] for b in token) for i, token in gpt2.vocab.items()}
    document = {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
        "added_tokens": [{"id": 50256, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": True, "special": True}],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {**{text: i for i, text in text_of.items()}, "<|endoftext|>": 50256},
                  "merges": [f"{text_of[left]} {text_of[right]}" for left, right in gpt2.merges]},
    }
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(document, ensure_ascii=False), encoding="utf-8")
    ours, reference = tokenizer_from_hf(path), Tokenizer.from_file(str(path))
    assert ours.merges == gpt2.merges and ours.special_tokens == {"<|endoftext|>": 50256}
    text = read_moby_dick()[:100_000] + "<|endoftext|>" + TEXTS[2]
    expected = gpt2.encode(text, allowed_special="all")
    assert ours.encode(text, allowed_special="all") == expected
    assert reference.encode(text, add_special_tokens=False).ids == expected


# --------------------------------------------------------------------------- Gemma: BPE with byte fallback
def gemma_folder(folder):
    """A Gemma-style tokenizer folder written by transformers' own GemmaTokenizer (its normalizer, split,
    byte fallback and decoder): <pad> <eos> <bos> <unk>, the 256 byte tokens, then pieces over characters
    learned from Moby-Dick with only 60 characters kept (the rest fall back to bytes), two turn markers
    added; the post-processor puts <bos> first, as Gemma's does."""
    from tokenizers import AddedToken, Tokenizer, models, trainers
    from transformers import GemmaTokenizer

    text = read_moby_dick()[:50_000].replace(" ", "\u2581")
    pieces = Tokenizer(models.BPE())
    pieces.train_from_iterator([text[i:i + 2000] for i in range(0, len(text), 2000)],
                               trainers.BpeTrainer(vocab_size=500, limit_alphabet=60, show_progress=False))
    document = json.loads(pieces.to_str())
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"])}
    vocab.update({f"<0x{b:02X}>": 4 + b for b in range(256)})
    for token in sorted(document["model"]["vocab"], key=document["model"]["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(merge) for merge in document["model"]["merges"]]
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    # As Gemma's runs of spaces and HTML tags: added, not special, matched as written (as transformers' converter
    # adds SentencePiece's user-defined pieces)
    tokenizer.add_tokens([AddedToken(text, normalized=False, special=False) for text in ("  ", "<h1>")])
    tokenizer.save_pretrained(str(folder))
    saved = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    saved["post_processor"] = {"type": "TemplateProcessing",
                               "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}},
                                          {"Sequence": {"id": "A", "type_id": 0}}],
                               "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                               "special_tokens": {"<bos>": {"id": "<bos>", "ids": [2], "tokens": ["<bos>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(saved, ensure_ascii=False), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = gemma_folder(tmp_path_factory.mktemp("gemma"))
    return Tokenizer.from_file(str(folder / "tokenizer.json")), tokenizer_from_hf(folder)


@pytest.mark.parametrize("text", TEXTS + ["  double  spaces and \u2581 itself", read_moby_dick()[200_000:215_000]])
def test_gemma_encodes_as_the_tokenizers_library_does(gemma, text):
    reference, ours = gemma
    expected = reference.encode(text, add_special_tokens=False).ids
    assert ours.encode(text, allowed_special="all") == expected
    assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=False)
    assert [ours.bos_id, *ours.encode(text, allowed_special="all")] == reference.encode(text).ids


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_gemma_encodes_arbitrary_text_as_the_tokenizers_library_does(gemma, text):
    reference, ours = gemma
    assert ours.encode(text, allowed_special="all") == reference.encode(text, add_special_tokens=False).ids


def test_gemma_keeps_its_roles_and_its_file(gemma, tmp_path):
    _, ours = gemma
    assert isinstance(ours, SentencePieceBPE)
    assert (ours.eot_token, ours.bos_id, ours.special_tokens["<end_of_turn>"]) == (1, 2, 762)
    assert ours.vocab_size == 765 and len(ours.encode("\u00e9\u00e9\u00e9")) > 3  # é is no piece: its bytes
    assert ours.encode("x  <h1>y") == ours.encode("x") + [763, 764] + ours.encode("y")  # added text: itself
    with pytest.raises(ValueError, match="special token '<end_of_turn>'"):
        ours.encode("<end_of_turn>")
    ours.save(tmp_path / "gemma.json")  # as a checkpoint keeps it
    again = load_tokenizer(tmp_path / "gemma.json")
    text = TEXTS[2] + "<end_of_turn>"
    assert again.encode(text, allowed_special="all") == ours.encode(text, allowed_special="all")
    assert (again.eot_token, again.bos_id) == (1, 2)


def test_an_added_token_matched_after_gemmas_normalizer_is_named(tmp_path):
    folder = gemma_folder(tmp_path)
    saved = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    next(entry for entry in saved["added_tokens"] if entry["content"] == "  ")["normalized"] = True
    (folder / "tokenizer.json").write_text(json.dumps(saved), encoding="utf-8")
    with pytest.raises(ValueError, match="the added token '  ' is matched after normalization, as '\u2581\u2581'"):
        tokenizer_from_hf(folder)


def test_a_llama2_style_normalizer_is_named(tmp_path):
    folder = gemma_folder(tmp_path)
    saved = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    saved["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                               saved["normalizer"]]}
    (folder / "tokenizer.json").write_text(json.dumps(saved), encoding="utf-8")
    with pytest.raises(ValueError, match="read with Gemma's normalizer"):
        tokenizer_from_hf(folder)


def test_a_gemma_folder_loads_with_its_tokenizer_and_prompts_start_with_bos(tmp_path):
    from llmscratch.finetuning.instruct import encode_records
    from llmscratch.model.generate import prompt_ids
    from llmscratch.training.evaluation import token_byte_lengths

    folder = gemma_folder(tmp_path)
    config = GPTConfig.from_preset("gemma3-1b", vocab_size=800, context_length=64, d_model=32, n_layers=2,
                                   n_heads=2, n_kv_heads=1, head_size=16, d_ff=64, sliding_window=8,
                                   layer_types=("sliding", "full"))
    save_hf(GPT(config), folder)
    model, tokenizer = load_model_and_tokenizer(folder)
    assert isinstance(tokenizer, SentencePieceBPE) and model.config.vocab_size == 800
    assert prompt_ids(tokenizer, "Call me") == [2, *tokenizer.encode("Call me")]
    assert prompt_ids(tokenizer, "<bos>Call me") == [2, *tokenizer.encode("Call me")]  # not twice
    record = {"instruction": "Say hi.", "input": "", "output": "hi"}
    assert encode_records([record], tokenizer)[0][0][:1] == [2]  # finetuning reads prompts as serving does
    lengths = token_byte_lengths(tokenizer, 800)
    assert lengths[2] == 0 and lengths[4] == 1 and lengths[tokenizer.encode("Call")[0]] == len(
        tokenizer.decode(tokenizer.encode("Call")[:1]).encode())


@pytest.mark.parametrize("fuse_unk", [True, False])
def test_unknowns_fuse_as_asked_and_a_merge_listed_twice_takes_its_later_rank(fuse_unk):
    vocab = {"<unk>": 0, "a": 1, "b": 2, "c": 3, "ab": 4, "bc": 5, "abc": 6}
    merges = [("a", "b"), ("b", "c"), ("a", "b")]
    reference = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=fuse_unk, byte_fallback=True))
    ours = SentencePieceBPE(vocab, merges, {"<unk>": 0}, unk_token="<unk>", fuse_unk=fuse_unk)
    for text in ("abc", "xyzab", "cxab"):
        assert ours.encode(text) == reference.encode(text).ids, text
