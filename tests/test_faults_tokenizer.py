"""Bad input to the tokenizer and to train_tokenizer.py: a clear error before any work, nothing lost.

Each row is one fault (issue 12). A script fault must exit non-zero with a message that names
the bad flag or file and leave every file that was there unchanged (no tokenizer trained and
then lost, no half-written output); an API fault must raise a ValueError naming the bad value.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from processes import run as run_process

from llmscratch.text.tokenizer import BPETokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "ch01-tokenization" / "train_tokenizer.py"

TEXT = "the cat sat on the mat; the cat ate the rat. " * 20


def train_tokenizer(*argv: str) -> subprocess.CompletedProcess:
    """The script run as a user runs it, in a fresh interpreter."""
    return run_process([sys.executable, str(SCRIPT), *argv], timeout=120)


def files_under(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with its bytes (None for a folder)."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def write(path: Path, content: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return str(path)


# Each case: (what goes wrong, argv given the folder, what the message must name). The folder
# already holds text.txt, a tokenizer the user saved earlier (saved.json) and notes.txt.
SCRIPT_FAULTS = [
    ("out is a folder", lambda d: ["--out", str(d)], "--out {d}: is a folder"),
    ("out under a file", lambda d: ["--out", str(d / "notes.txt" / "tok.json")], "notes.txt is a file, not a folder"),
    ("out deep under a file", lambda d: ["--out", str(d / "notes.txt" / "sub" / "tok.json")],
     "notes.txt is a file, not a folder"),
    ("empty special token", lambda d: ["--special-tokens", ""], "--special-tokens: special tokens must be non-empty"),
    ("empty among others", lambda d: ["--special-tokens", "<|a|>", ""], "got '' in ['<|a|>', '']"),
    ("repeated special token", lambda d: ["--special-tokens", "<|a|>", "<|b|>", "<|a|>"],
     "['<|a|>'] appear more than once"),
    ("empty input", lambda d: ["--input", write(d / "empty.txt", "")], "--input {d}/empty.txt is empty"),
    ("whitespace-only input", lambda d: ["--input", write(d / "blank.txt", " \n\t\r\n ")],
     "--input {d}/blank.txt is only whitespace"),
    ("one of two inputs empty", lambda d: ["--input", str(d / "text.txt"), write(d / "empty.txt", "")],
     "--input {d}/empty.txt is empty"),
    ("training part blank", lambda d: ["--input", write(d / "tail.txt", " " * 30 + "words"), "--val-fraction", "0.5"],
     "the training part of --input {d}/tail.txt"),
    ("nothing to merge", lambda d: ["--input", write(d / "one.txt", "x"), "--val-fraction", "0"],
     "--input {d}/one.txt is too small"),
    ("not UTF-8", lambda d: ["--input", write(d / "latin1.txt", "caf\xe9".encode("latin-1"))],
     "--input {d}/latin1.txt is not UTF-8"),
    ("missing input", lambda d: ["--input", str(d / "nope.txt")], "--input {d}/nope.txt: no such file"),
    ("vocab size too small", lambda d: ["--vocab-size", "100"], "--vocab-size must be at least 257"),
    ("val fraction out of range", lambda d: ["--val-fraction", "1"], "--val-fraction must be in [0, 1)"),
]


@pytest.mark.parametrize("argv_for, message", [case[1:] for case in SCRIPT_FAULTS],
                         ids=[case[0] for case in SCRIPT_FAULTS])
def test_script_fault_exits_non_zero_naming_it_and_keeps_files(tmp_path, argv_for, message):
    write(tmp_path / "text.txt", TEXT)
    BPETokenizer.train(TEXT, 260).save(tmp_path / "saved.json")
    write(tmp_path / "notes.txt", "my notes")
    argv = ["--input", str(tmp_path / "text.txt"), "--vocab-size", "270", "--out", str(tmp_path / "saved.json")]
    argv += argv_for(tmp_path)  # argparse keeps the last value of a repeated flag
    before = files_under(tmp_path)
    result = train_tokenizer(*argv)
    assert result.returncode != 0
    said = f"{result.stderr}\n{result.stdout}"
    assert message.format(d=tmp_path) in said
    assert "Traceback" not in said
    assert files_under(tmp_path) == before


def test_script_saves_into_a_new_folder_and_the_file_loads(tmp_path):
    text = write(tmp_path / "text.txt", TEXT)
    out = tmp_path / "new" / "folder" / "tok.json"
    result = train_tokenizer("--input", text, "--vocab-size", "270", "--val-fraction", "0",
                             "--special-tokens", "<|a|>", "<|b|>", "--out", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    loaded = BPETokenizer.load(out)
    assert loaded.vocab_size == 270 and loaded.special_tokens == {"<|a|>": 268, "<|b|>": 269}
    assert f"saved {out}" in result.stdout


# --------------------------------------------------------------------- the API
def saved_json(tmp_path: Path, edit) -> Path:
    """A trained tokenizer's file with ``edit(data)`` applied to its parsed JSON."""
    path = tmp_path / "tok.json"
    BPETokenizer.train(TEXT, 270).save(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


def load_edited(edit):
    """A setup that saves an edited tokenizer file and returns the call that loads it."""
    def setup(folder: Path):
        path = saved_json(folder, edit)
        return lambda: BPETokenizer.load(path)
    return setup


def duplicate_first_merge(data):
    data["merges"].append(data["merges"][0])


# Each case: (what goes wrong, a setup that returns the faulty call, what the message must name).
API_FAULTS = [
    ("train: empty special token", lambda d: lambda: BPETokenizer.train(TEXT, 300, special_tokens=["<|a|>", ""]),
     "non-empty strings, got '' in ['<|a|>', '']"),
    ("train: repeated special token", lambda d: lambda: BPETokenizer.train(TEXT, 300, special_tokens=["<|a|>"] * 2),
     "['<|a|>'] appear more than once"),
    ("train: one string, not a list", lambda d: lambda: BPETokenizer.train(TEXT, 300, special_tokens="<|a|>"),
     "a list of strings, got the string '<|a|>'"),
    ("train: pattern skips text", lambda d: lambda: BPETokenizer.train(TEXT + "☃!", 300, pattern="[^☃]+"),
     f"the split pattern '[^☃]+' skips '☃!' at character {len(TEXT)} of the text"),
    ("train: pattern skips the test text", lambda d: lambda: BPETokenizer.train(TEXT, 300, pattern=r"\p{L}+"),
     r"the split pattern '\\p{L}+' skips ', world! I' at character 5 of a test text"),
    ("init: empty special token", lambda d: lambda: BPETokenizer([], special_tokens={"": 256}),
     "non-empty strings, got ''"),
    ("init: repeated merge", lambda d: lambda: BPETokenizer([(97, 98), (32, 256), (97, 98)]),
     "merge 2 (97, 98) repeats merge 0"),
    ("init: pattern matches nothing", lambda d: lambda: BPETokenizer([], pattern="qqq"),
     "the split pattern 'qqq' skips 'Hello, wor' at character 0"),
    ("init: pattern matches only empty strings", lambda d: lambda: BPETokenizer([], pattern="x*"),
     "the split pattern 'x*' skips"),
    ("init: capture groups", lambda d: lambda: BPETokenizer([], pattern=r"(\w+)|\s+|."),
     r"the split pattern '(\\w+)|\\s+|.' has capture groups"),
    ("init: not a regex", lambda d: lambda: BPETokenizer([], pattern="[a-"),
     "the split pattern '[a-' is not a regular expression"),
    ("encode: pattern leaves part of the text",
     lambda d: lambda: BPETokenizer([], pattern="[^☃]+").encode("snow ☃ man"),
     "skips '☃ man' at character 5"),
    ("load: repeated merge", load_edited(duplicate_first_merge),
     "tok.json is a corrupt tokenizer file: merge 14 ("),
    ("load: pattern matches nothing", load_edited(lambda data: data.update(pattern="qqq")),
     "tok.json is a corrupt tokenizer file: the split pattern 'qqq' skips"),
    ("load: empty special token", load_edited(lambda data: data.update(special_tokens={"": 270})),
     "tok.json is a corrupt tokenizer file: special tokens must be non-empty"),
]


@pytest.mark.parametrize("setup, message", [case[1:] for case in API_FAULTS], ids=[case[0] for case in API_FAULTS])
def test_api_fault_is_a_value_error_naming_it(tmp_path, setup, message):
    call = setup(tmp_path)
    before = files_under(tmp_path)
    with pytest.raises(ValueError) as error:
        call()
    assert message in str(error.value)
    assert files_under(tmp_path) == before


# --------------------------------------------------------------------- hub files that are not what they claim
# Issue 50, item 4: each damaged field of a tokenizer.json or tokenizer_config.json is one ValueError naming the file
# and the field (never a KeyError, AttributeError or TypeError from deep inside), and a split pattern that
# backtracks catastrophically (item 3) is refused when the file is read, or stopped when it meets such a text.
@pytest.fixture(scope="module")
def hub_document():
    """A Qwen-style tokenizer.json written by the tokenizers library (added tokens, a Split, NFC), as JSON."""
    from test_hf_tokenizer import qwen_style

    return json.loads(qwen_style().to_str())


def first_token(data):
    return next(iter(data["model"]["vocab"]))


def set_field(path: str, value):
    """An edit that sets the field at ``path`` (keys and list indexes, dotted) to ``value``."""
    def edit(data):
        *parents, last = [int(part) if part.isdigit() else part for part in path.split(".")]
        for part in parents:
            data = data[part]
        data[last] = value
    return edit


TOKENIZER_JSON_FAULTS = [  # (what goes wrong, the edit, what the message says after "tokenizer.json: ")
    ("added token without content", lambda d: d["added_tokens"][3].pop("content"), "added_tokens[3] has no 'content'"),
    ("added token a string", set_field("added_tokens.1", "<|im_end|>"),
     'added_tokens[1] should be an object, got the string "<|im_end|>"'),
    ("post_processor a string", set_field("post_processor", "TemplateProcessing"),
     "post_processor should be an object, got the string"),
    ("pre_tokenizer a list", set_field("pre_tokenizer", ["Split", "ByteLevel"]), "pre_tokenizer should be an object"),
    ("integer merge", set_field("model.merges.5", 5),
     "model.merges[5] should be a string 'left right' or a pair of strings, got the integer 5"),
    ("string vocabulary id", lambda d: d["model"]["vocab"].update({first_token(d): "5"}),
     "should be an integer, got the string \"5\""),
    # held out: the same kinds of damage elsewhere
    ("added token without id", lambda d: d["added_tokens"][0].pop("id"), "added_tokens[0] has no 'id'"),
    ("added token id a string", set_field("added_tokens.2.id", "702"), "added_tokens[2].id should be an integer"),
    ("added token id a bool", set_field("added_tokens.2.id", True),
     "added_tokens[2].id should be an integer, got true"),
    ("added token content a number", set_field("added_tokens.0.content", 7), "added_tokens[0].content should be a"),
    ("added token special a string", set_field("added_tokens.0.special", "yes"), "added_tokens[0].special should be"),
    ("added_tokens an object", set_field("added_tokens", {"<|im_end|>": 702}), "added_tokens should be a list"),
    ("normalizer a number", set_field("normalizer", 5), "normalizer should be an object, got the integer 5"),
    ("normalizers a string", set_field("normalizer", {"type": "Sequence", "normalizers": "NFC"}),
     "normalizer.normalizers should be a list"),
    ("decoder a string", set_field("decoder", "ByteLevel"), "decoder should be an object"),
    ("pre-tokenizer step a string", set_field("pre_tokenizer.pretokenizers.0", "Split"),
     "pre_tokenizer.pretokenizers[0] should be an object"),
    ("split pattern a string", set_field("pre_tokenizer.pretokenizers.0.pattern", r"\s+"),
     "pre_tokenizer.pretokenizers[0].pattern should be an object"),
    ("split regex a number", set_field("pre_tokenizer.pretokenizers.0.pattern", {"Regex": 5}),
     "pre_tokenizer.pretokenizers[0].pattern.Regex should be a string"),
    ("use_regex a string", set_field("pre_tokenizer.pretokenizers.1.use_regex", "false"),
     "pre_tokenizer.pretokenizers[1].use_regex should be true or false"),
    ("post-processor piece a string", set_field("post_processor", {"type": "TemplateProcessing", "single": ["<s>"]}),
     "post_processor.single[0] should be an object"),
    ("post-processor token id a number",
     set_field("post_processor", {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": 1}}]}),
     "post_processor.single[0].SpecialToken.id should be a string"),
    ("processors an object", set_field("post_processor", {"type": "Sequence", "processors": {}}),
     "post_processor.processors should be a list"),
    ("merge of three", set_field("model.merges.2", ["a", "b", "c"]), "model.merges[2] should be"),
    ("merge of a string and a number", set_field("model.merges.2", ["a", 5]), "model.merges[2] should be"),
    ("merges an object", set_field("model.merges", {"a": "b"}), "model.merges should be a list"),
    ("vocabulary a list", set_field("model.vocab", [["a", 0]]), "model.vocab should be an object, got a list"),
    ("vocabulary id a float", lambda d: d["model"]["vocab"].update({first_token(d): 1.5}), "should be an integer"),
    ("no vocabulary", lambda d: d["model"].pop("vocab"), "model has no 'vocab'"),
    ("ignore_merges a string", set_field("model.ignore_merges", "no"), "model.ignore_merges should be true or false"),
    ("byte_fallback a number", set_field("model.byte_fallback", 1), "model.byte_fallback should be true or false"),
    ("unk_token a number", set_field("model.unk_token", 0), "model.unk_token should be a string"),
    ("added token empty", set_field("added_tokens.0.content", ""), "special tokens must be non-empty strings"),
    ("post-processor names no special token",
     set_field("post_processor", {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}}]}),
     "bos_token '<s>' is not one of the special tokens"),
]


@pytest.mark.parametrize("edit, message", [case[1:] for case in TOKENIZER_JSON_FAULTS],
                         ids=[case[0] for case in TOKENIZER_JSON_FAULTS])
def test_a_damaged_tokenizer_json_is_named_by_file_and_field(tmp_path, hub_document, edit, message):
    from llmscratch.text.hf_tokenizer import load_tokenizer, tokenizer_from_hf

    document = json.loads(json.dumps(hub_document))
    edit(document)
    write(tmp_path / "tokenizer.json", json.dumps(document))
    for load in (tokenizer_from_hf, load_tokenizer):
        with pytest.raises(ValueError) as error:
            load(tmp_path / "tokenizer.json")
        assert f"{tmp_path / 'tokenizer.json'}: " in str(error.value) and message in str(error.value)
        assert "\n" not in str(error.value)


CONFIG_FAULTS = [  # (what goes wrong, tokenizer_config.json, what the message says after "tokenizer_config.json: ")
    ("eos_token without content", {"eos_token": {"special": True}},
     "eos_token should be a string, or an object with a string 'content', got an object"),
    ("bos_token a number", {"bos_token": 1}, "bos_token should be a string, or an object"),
    ("chat_template a number", {"chat_template": 5}, "chat_template should be Jinja text"),
    ("chat_template a list of strings", {"chat_template": ["{{ 1 }}"]}, "chat_template should be Jinja text"),
    ("named template without text", {"chat_template": [{"name": "default"}]}, "chat_template should be Jinja text"),
    ("added_tokens_decoder entry a string", {"added_tokens_decoder": {"702": "<|im_end|>"}},
     "added_tokens_decoder['702'] should be an object"),
    ("added_tokens_decoder entry without content", {"added_tokens_decoder": {"702": {"special": True}}},
     "added_tokens_decoder['702'] has no 'content'"),
    ("added_tokens_decoder key not an id", {"added_tokens_decoder": {"x": {"content": "<|im_end|>"}}},
     "added_tokens_decoder has the key 'x', which is not a token id"),
    ("added_tokens_decoder a list", {"added_tokens_decoder": []}, "added_tokens_decoder should be an object"),
]


@pytest.mark.parametrize("config, message", [case[1:] for case in CONFIG_FAULTS],
                         ids=[case[0] for case in CONFIG_FAULTS])
def test_a_damaged_tokenizer_config_is_named_by_file_and_field(tmp_path, hub_document, config, message):
    from llmscratch.text.chat_template import ChatTemplate
    from llmscratch.text.hf_tokenizer import tokenizer_from_hf

    write(tmp_path / "tokenizer.json", json.dumps(hub_document))
    write(tmp_path / "tokenizer_config.json", json.dumps(config))
    for load in (tokenizer_from_hf, ChatTemplate.from_hf):
        with pytest.raises(ValueError) as error:
            load(tmp_path)
        assert f"{tmp_path / 'tokenizer_config.json'}: {message}" in str(error.value)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_json_nested_past_pythons_limit_is_named_not_a_recursion_error(tmp_path, hub_document, name):
    """'[' * 100000: json.loads raises RecursionError, not JSONDecodeError; it is a damaged file all the same."""
    from llmscratch.text.chat_template import ChatTemplate
    from llmscratch.text.hf_tokenizer import load_tokenizer, tokenizer_from_hf

    write(tmp_path / "tokenizer.json", json.dumps(hub_document))
    config = {"chat_template": "{{ messages }}", "eos_token": "<|im_end|>"}
    write(tmp_path / "tokenizer_config.json", json.dumps(config))
    tokenizer = tokenizer_from_hf(tmp_path)
    write(tmp_path / name, "[" * 100_000 + "]" * 100_000)
    readers = {"tokenizer.json": [lambda: tokenizer_from_hf(tmp_path), lambda: load_tokenizer(tmp_path / name)],
               "tokenizer_config.json": [lambda: tokenizer_from_hf(tmp_path), lambda: ChatTemplate.from_hf(tmp_path)],
               "generation_config.json": [lambda: ChatTemplate.from_hf(tmp_path, tokenizer)]}[name]
    for read in readers:
        with pytest.raises(ValueError, match="recursion") as error:
            read()
        assert str(tmp_path / name) in str(error.value)


@pytest.mark.parametrize("merge, message", [
    (["zz9", "qq8"], "merges[0] joins 'zz9', which is not in the vocabulary"),
    ("a qq8", "merges[0] joins 'qq8', which is not in the vocabulary"),
])
def test_a_merge_of_tokens_the_vocabulary_lacks_is_named(tmp_path, hub_document, merge, message):
    from llmscratch.text.hf_tokenizer import tokenizer_from_hf

    document = json.loads(json.dumps(hub_document))
    document["model"]["merges"][0] = merge  # either way a file may write a merge: a pair, or "left right"
    write(tmp_path / "tokenizer.json", json.dumps(document))
    with pytest.raises(ValueError, match=re.escape(f"tokenizer.json: {message}")):
        tokenizer_from_hf(tmp_path)


def test_a_tokenizer_json_that_is_a_folder_is_named(tmp_path):
    from llmscratch.text.hf_tokenizer import load_tokenizer

    (tmp_path / "tokenizer.json").mkdir()
    with pytest.raises(ValueError, match="is a folder, not a tokenizer file"):
        load_tokenizer(tmp_path / "tokenizer.json")


def with_split(document: dict, pattern: str) -> dict:
    document = json.loads(json.dumps(document))
    document["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": pattern}
    return document


@pytest.mark.parametrize("prefix", [r"(?:a|a)+$|", r"(?:\s|\s)+$|", r"(?:x|x|xy)*z|", r"(?:ab|a(?:b))+$|"])
def test_a_split_pattern_that_backtracks_catastrophically_is_refused_when_read(tmp_path, hub_document, prefix):
    """The issue's pattern (which took generate.py past 90 s on 'a' * 34 + 'b'), and others of its kind, before a
    Qwen pattern that keeps the split covering: refused as the folder is read, naming the file and the pattern."""
    from test_hf_tokenizer import QWEN_PATTERN

    from llmscratch.text.hf_tokenizer import tokenizer_from_hf

    pattern = prefix + QWEN_PATTERN
    write(tmp_path / "tokenizer.json", json.dumps(with_split(hub_document, pattern)))
    with pytest.raises(ValueError, match="backtracks catastrophically") as error:
        tokenizer_from_hf(tmp_path)
    assert str(error.value).startswith(f"{tmp_path / 'tokenizer.json'}: the split pattern {pattern!r}")


def test_generate_reads_no_folder_whose_split_pattern_backtracks(tmp_path, hub_document):
    """ch03-architecture/generate.py (and the server) load a hub folder with load_model_and_tokenizer."""
    from llmscratch.model.config import GPTConfig
    from llmscratch.model.gpt import GPT
    from llmscratch.model.weights import load_model_and_tokenizer, save_hf

    config = GPTConfig.from_preset("qwen3-0.6b", vocab_size=768, context_length=64, d_model=32, n_layers=1,
                                   n_heads=2, n_kv_heads=1, head_size=16, d_ff=64)
    save_hf(GPT(config), tmp_path)
    write(tmp_path / "tokenizer.json", json.dumps(with_split(hub_document, r"(?:a|a)+$|(?s:.)")))
    with pytest.raises(ValueError, match=r"tokenizer.json: the split pattern '\(\?:a\|a\)\+\$\|\(\?s:\.\)' backtracks"):
        load_model_and_tokenizer(tmp_path)


@pytest.mark.parametrize("pattern, text", [
    (r"\s*\s*\s*x|(?s:.)", " " * 3000 + "!"),  # cubic in a run of spaces: no short text shows it
    (r"(?:\s*\s*\s*\s*y)|\p{L}+|(?s:.)", "\t" * 2000 + "z"),
])
def test_a_split_that_runs_away_on_a_text_stops_with_an_error(pattern, text):
    tokenizer = BPETokenizer([], pattern=pattern)  # it passes the tries when it is read
    assert tokenizer.encode("a b") == list(b"a b")
    with pytest.raises(ValueError, match=rf"the split pattern .* took more than 1\.0 s to split the text "
                                         rf"\({len(text):,} characters\): it backtracks catastrophically"):
        tokenizer.encode(text)


def test_the_hub_patterns_split_without_a_time_limit():
    """GPT-2's, Llama 3's and Qwen's patterns split in linear time: no timeout slows their splits (about half)."""
    from test_hf_tokenizer import QWEN_PATTERN

    from llmscratch.text.checks import LINEAR_PATTERNS
    from llmscratch.text.tokenizer import GPT2_SPLIT_PATTERN

    assert {GPT2_SPLIT_PATTERN, QWEN_PATTERN, QWEN_PATTERN.replace(r"\p{N}|", r"\p{N}{1,3}|")} == LINEAR_PATTERNS
