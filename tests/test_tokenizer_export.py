"""Our tokenizers exported as Hugging Face tokenizer folders (llmscratch.text.hf_export): the ``tokenizers``
library, transformers' AutoTokenizer and our own reader give the package's ids; the instruction models' chat
template renders as format_chat does; a pretraining run names its own tokenizer file apart from tokenizer.json."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scripts import run_script
from test_hf_tokenizer import gemma_folder, llama3_style, qwen_style
from tiny_training import PRETRAIN_FLAGS, TEXT
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from llmscratch.cli import resolve_model
from llmscratch.finetuning.instruct import CHAT_TEMPLATE, format_chat
from llmscratch.model.generate import with_bos
from llmscratch.model.weights import load_model_and_tokenizer
from llmscratch.text.chat_template import ChatTemplate
from llmscratch.text.data import held_out_moby_dick
from llmscratch.text.hf_export import save_tokenizer_hf
from llmscratch.text.hf_tokenizer import load_tokenizer, tokenizer_from_hf
from llmscratch.text.tokenizer import GPT2_SPLIT_PATTERN, BPETokenizer
from llmscratch.training.pretraining import OLD_TOKENIZER_FILE, TOKENIZER_FILE, read_run_flags

KINDS = ["bundled", "gpt2", "qwen", "llama3", "gemma"]
# Characters Python's Unicode knows (the tokenizers library's regex engine knows no later letters), mixed with
# what tokenizers stumble on: emoji sequences, CJK, combining marks, whitespace runs, digits, special tokens.
PIECES = st.sampled_from(["😀", "👩‍👩‍👧", "中文", "日本", "e\u0301", "\u0301", "  ", "\t", "\n\n", "\r\n", "   x", "2026",
                          "'s", "'LL", " <|endoftext|>", "<|im_end|>", "<think>", "<end_of_turn>", "\u00a0", "ﬁ"])
TEXTS = st.lists(st.one_of(st.text(st.characters(blacklist_categories=("Cs", "Cn")), max_size=12), PIECES),
                 max_size=8).map("".join)


def source_tokenizer(kind: str, folder):
    """The package's tokenizer of each kind: the bundled 4,096-token one, GPT-2's, and three read from files the
    tokenizers library wrote (Qwen's layout, Llama 3's rank order with a BOS, Gemma's byte fallback)."""
    if kind == "bundled":
        return load_model_and_tokenizer(resolve_model("base")[1])[1]
    if kind == "gpt2":
        return BPETokenizer.gpt2()
    (folder / kind).mkdir()
    if kind == "gemma":
        return tokenizer_from_hf(gemma_folder(folder / kind))
    (llama3_style(folder) if kind == "llama3" else qwen_style()).save(str(folder / kind / "tokenizer.json"))
    return tokenizer_from_hf(folder / kind)


@pytest.fixture(scope="module", params=KINDS)
def exported(request, tmp_path_factory):
    """(ours, the tokenizers library's, transformers', ours read back) for one exported folder."""
    folder = tmp_path_factory.mktemp(request.param)
    ours = source_tokenizer(request.param, folder)
    save_tokenizer_hf(ours, folder / "export", model_max_length=256)
    return (ours, Tokenizer.from_file(str(folder / "export" / "tokenizer.json")),
            AutoTokenizer.from_pretrained(folder / "export"), tokenizer_from_hf(folder / "export"))


def assert_same_ids(exported, text: str) -> None:
    ours, library, transformers_tokenizer, again = exported
    expected = ours.encode(text, allowed_special="all")
    assert library.encode(text, add_special_tokens=False).ids == expected
    assert transformers_tokenizer.encode(text, add_special_tokens=False) == expected
    assert again.encode(text, allowed_special="all") == expected
    # With its special tokens added, transformers starts with the BOS where the package's prompts do.
    assert transformers_tokenizer.encode(text) == with_bos(ours, expected)
    assert transformers_tokenizer.decode(expected) == ours.decode(expected)


def test_the_held_out_tenth_of_moby_dick_encodes_as_ours(exported):
    assert_same_ids(exported, held_out_moby_dick())


def test_special_tokens_written_in_the_text_are_special_tokens(exported):
    ours = exported[0]
    for token in ours.special_tokens:
        text = f"Call me{token}Ishmael {token}\n{token}{token}."
        assert_same_ids(exported, text)
        assert ours.special_tokens[token] in exported[1].encode(text, add_special_tokens=False).ids


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(TEXTS)
def test_arbitrary_text_encodes_as_ours(exported, text):
    assert_same_ids(exported, text)


def test_reading_the_export_back_gives_the_same_tokenizer(exported):
    ours, _, transformers_tokenizer, again = exported
    assert type(again) is type(ours)
    assert (again.special_tokens, again.eot_token, again.bos_id, again.added_text) == (
        ours.special_tokens, ours.eot_token, ours.bos_id, ours.added_text)
    if isinstance(ours, BPETokenizer):
        assert (again.merges, again.vocab, again.pattern, again.normalization, again.whole_chunks) == (
            ours.merges, ours.vocab, ours.pattern, ours.normalization, ours.whole_chunks)
    else:
        assert (again.token_ids, again.merge_list, again.unk_token) == (ours.token_ids, ours.merge_list,
                                                                       ours.unk_token)
    assert transformers_tokenizer.eos_token_id == ours.eot_token
    assert transformers_tokenizer.bos_token_id == ours.bos_id
    assert transformers_tokenizer.model_max_length == 256


def test_the_folder_names_the_roles_and_the_stop_ids(tmp_path):
    tokenizer = source_tokenizer("llama3", tmp_path)  # a BOS, and its end token named by the folder
    save_tokenizer_hf(tokenizer, tmp_path / "export", chat_template=CHAT_TEMPLATE, model_max_length=64)
    config = json.loads((tmp_path / "export" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["model_max_length"] == 64
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|endoftext|>")
    assert config["chat_template"] == CHAT_TEMPLATE
    generation = json.loads((tmp_path / "export" / "generation_config.json").read_text(encoding="utf-8"))
    assert generation == {"eos_token_id": tokenizer.eot_token, "bos_token_id": tokenizer.bos_id} == {
        "eos_token_id": 700, "bos_token_id": 701}
    bundled = source_tokenizer("bundled", tmp_path)  # no BOS: none in either file
    save_tokenizer_hf(bundled, tmp_path / "bundled")
    config = json.loads((tmp_path / "bundled" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "bos_token" not in config and "chat_template" not in config and "model_max_length" not in config
    assert json.loads((tmp_path / "bundled" / "generation_config.json").read_text()) == {"eos_token_id": 4095}


# --------------------------------------------------------------------------- what a tokenizer.json cannot hold
def repeated_bytes() -> BPETokenizer:
    """Two ids with the same bytes: "abc" made as ab + c and as a + bc (a BPE trained elsewhere may do this)."""
    return BPETokenizer([(97, 98), (256, 99), (98, 99), (97, 258)])


def tokenizer_with_pattern(pattern: str) -> BPETokenizer:
    return BPETokenizer.train(TEXT[:5_000], 300, pattern=pattern, special_tokens=["<|endoftext|>"])


@pytest.mark.parametrize("make, message", [
    (repeated_bytes, r"ids 257 and 259 are the same bytes b'abc'"),
    (lambda: BPETokenizer([(97, 98)], special_tokens={"ab": 257}), r"the special token 'ab' is also the text of"),
    # The regex module's \N{...} is no escape to the tokenizers library's Oniguruma: it would split otherwise.
    (lambda: tokenizer_with_pattern(GPT2_SPLIT_PATTERN.replace(" ?\\p{L}+", "\\N{SPACE}?\\p{L}+")),
     r"the tokenizers library's regex engine splits text by the pattern .* otherwise than the regex module"),
    (lambda: tokenizer_with_pattern(r"\p{L}+|\p{N}+|\h+|\s|[^\s\p{L}\p{N}]+"),  # \h: horizontal space, or hex?
     r"chunk \d+ is \[' '\] there, \['  '\] here"),
    (lambda: tokenizer_with_pattern(r"(?V1)[\p{L}--\p{Lu}]+|\p{Lu}|\p{N}+|\s+|[^\s\p{L}\p{N}]+"),  # set difference
     r"the tokenizers library cannot read this tokenizer .*undefined group option"),
    (lambda: "gpt2", r"a str cannot be written as a tokenizer.json"),
])
def test_what_a_tokenizer_json_cannot_hold_is_refused_before_anything_is_written(tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        save_tokenizer_hf(make(), tmp_path / "export")
    assert not (tmp_path / "export").exists()


# --------------------------------------------------------------------------- the chat template
CONVERSATIONS = [
    [{"role": "user", "content": "Name a whale."}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a whale."}],
    [{"role": "user", "content": "Name a whale."}, {"role": "assistant", "content": "Moby Dick."},
     {"role": "user", "content": "And another?"}],
    [{"role": "system", "content": "Be brief.\n"}, {"role": "user", "content": "a\n\nb"},
     {"role": "assistant", "content": "  c  "}, {"role": "user", "content": "{{ 'not' }} {% a jinja %} 'q' \"q\""},
     {"role": "assistant", "content": ""}, {"role": "user", "content": "ünïcödé 中文 😀\\n"}],
    [{"role": "user", "content": "first"}, {"role": "user", "content": "second"}],
]
REFUSED = [
    [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}],
    [{"role": "assistant", "content": "first"}, {"role": "user", "content": "a"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "assistant", "content": "c"},
     {"role": "user", "content": "d"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    [{"role": "system", "content": "s"}],
    [{"role": "tool", "content": "42"}, {"role": "user", "content": "a"}],
]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """transformers' tokenizer of an exported folder that holds CHAT_TEMPLATE."""
    folder = tmp_path_factory.mktemp("chat")
    save_tokenizer_hf(source_tokenizer("bundled", folder), folder, chat_template=CHAT_TEMPLATE)
    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.timeout(120)  # a worker process renders the template
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_the_chat_template_renders_what_format_chat_does(chat_tokenizer, messages):
    expected = format_chat(messages)
    assert chat_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    assert ChatTemplate(CHAT_TEMPLATE).render(messages) == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("messages", REFUSED)
def test_the_chat_template_refuses_what_format_chat_refuses(chat_tokenizer, messages):
    with pytest.raises(ValueError) as refused:
        format_chat(messages)
    reason = str(refused.value)
    with pytest.raises(Exception, match=reason.replace("(", r"\(").replace(")", r"\)")):  # jinja2's TemplateError
        chat_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        ChatTemplate(CHAT_TEMPLATE).render(messages)


# --------------------------------------------------------------------------- the run folder's own tokenizer file
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_folder_names_its_own_tokenizer_file_and_an_old_one_still_resumes(tmp_path):
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    run = tmp_path / "run"
    assert run_script("pretrain", ["--data", str(tmp_path / "text.txt"), "--out-dir", str(run), "--max-steps", "2",
                                   *PRETRAIN_FLAGS]) == 0
    assert (run / TOKENIZER_FILE).is_file() and not (run / "tokenizer.json").exists()
    tokenizer = load_tokenizer(run / TOKENIZER_FILE)
    assert read_run_flags(run)["tokenizer"] == str(run / TOKENIZER_FILE)
    # The folder as a run from before the new name left it: our format under tokenizer.json.
    (run / TOKENIZER_FILE).rename(run / OLD_TOKENIZER_FILE)
    flags = json.loads((run / "run.json").read_text(encoding="utf-8"))
    (run / "run.json").write_text(json.dumps({**flags, "tokenizer": str(run / OLD_TOKENIZER_FILE)}), encoding="utf-8")
    assert read_run_flags(run)["tokenizer"] == str(run / OLD_TOKENIZER_FILE)
    assert run_script("pretrain", ["--out-dir", str(run), "--resume", "--max-steps", "3"]) == 0
    # Resumed with the same tokenizer, now under its own name: no tokenizer.json in our format is left.
    assert load_tokenizer(run / TOKENIZER_FILE).to_json() == tokenizer.to_json()
    assert not (run / OLD_TOKENIZER_FILE).exists()


@pytest.mark.timeout(300)
def test_a_hugging_face_tokenizer_json_beside_a_run_is_kept(tmp_path):
    """Only our own old file is taken for the run's: an exported tokenizer.json in the folder stays as it is."""
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    run = tmp_path / "run"
    assert run_script("pretrain", ["--data", str(tmp_path / "text.txt"), "--out-dir", str(run), "--max-steps", "2",
                                   *PRETRAIN_FLAGS]) == 0
    save_tokenizer_hf(load_tokenizer(run / TOKENIZER_FILE), run)
    exported = (run / "tokenizer.json").read_text(encoding="utf-8")
    assert run_script("pretrain", ["--out-dir", str(run), "--resume", "--max-steps", "3"]) == 0
    assert (run / "tokenizer.json").read_text(encoding="utf-8") == exported
    assert tokenizer_from_hf(run).merges == load_tokenizer(run / TOKENIZER_FILE).merges
