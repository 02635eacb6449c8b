"""Bad input to the tokenizer and to train_tokenizer.py: a clear error before any work, nothing lost.

Each row is one fault (issue 12). A script fault must exit non-zero with a message that names
the bad flag or file and leave every file that was there unchanged (no tokenizer trained and
then lost, no half-written output); an API fault must raise a ValueError naming the bad value.
"""

import json
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
