"""ch03-architecture/generate.py end to end: our checkpoints and a Hugging Face folder, text and errors."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must never reach for the hub here

import transformers  # noqa: E402  (a test-only dependency, in requirements.txt)
from model_fixtures import randomize  # noqa: E402

from llmscratch.assets import read_moby_dick  # noqa: E402
from llmscratch.model.checkpoint import export_model, save_checkpoint  # noqa: E402
from llmscratch.model.config import GPTConfig  # noqa: E402
from llmscratch.model.generate import generate_text  # noqa: E402
from llmscratch.model.gpt import GPT
from llmscratch.model.quantize import quantize  # noqa: E402
from llmscratch.model.weights import load_model_and_tokenizer, save_hf  # noqa: E402
from llmscratch.text.tokenizer import BPETokenizer  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "ch03-architecture" / "generate.py"
PROMPT = "Call me Ishmael. Some years ago"


def run(*argv: str) -> subprocess.CompletedProcess:
    """The script in a fresh interpreter; stdout kept as bytes (text mode would rewrite '\\r')."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, argv)], capture_output=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """A tiny Llama-style model with its own tokenizer, saved both ways a training run saves it."""
    folder = tmp_path_factory.mktemp("run")
    tokenizer = BPETokenizer.train(read_moby_dick()[:20_000], 320, special_tokens=["<|endoftext|>"])
    config = GPTConfig.from_preset("llama-tiny", vocab_size=tokenizer.vocab_size, context_length=64, d_model=32,
                                   n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    model = GPT(config)
    randomize(model, seed=0, scale=0.3)
    export_model(model, folder / "model.safetensors", tokenizer)
    save_checkpoint(folder / "checkpoint.pt", {"model": model.state_dict(), "model_config": config.to_dict(),
                                               "tokenizer": tokenizer.to_json()})
    return folder, model.eval(), tokenizer


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory):
    """A tiny random transformers GPT-2 with GPT-2's vocabulary, saved as a Hugging Face folder."""
    folder = tmp_path_factory.mktemp("hf")
    config = transformers.GPT2Config(vocab_size=50257, n_positions=64, n_embd=16, n_layer=1, n_head=2,
                                     bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(config).eval()
    randomize(model, seed=1, scale=0.3)
    model.save_pretrained(folder)
    return folder, model


def test_greedy_text_from_a_hugging_face_folder_is_transformers_text(hf_gpt2):
    folder, reference = hf_gpt2
    result = run(folder, "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "30", "--ignore-eos")
    assert result.returncode == 0, result.stderr.decode()
    tokenizer = BPETokenizer.gpt2()
    idx = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        expected = reference.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=30, do_sample=False)
    assert expected.shape[1] == idx.shape[1] + 30
    assert result.stdout.decode("utf-8") == tokenizer.decode(expected[0].tolist()) + "\n"


def test_sampled_text_from_a_run_folder_is_generate_text(ours):
    folder, model, tokenizer = ours
    result = run(folder, "--prompt", PROMPT, "--max-new-tokens", "40", "--temperature", "1.0",
                 "--top-k", "50", "--top-p", "0.9", "--seed", "7")
    assert result.returncode == 0, result.stderr.decode()
    expected = generate_text(model, tokenizer, PROMPT, 40, temperature=1.0, top_k=50, top_p=0.9,
                             eos_id=tokenizer.eot_token, generator=torch.Generator().manual_seed(7))
    assert len(expected) > len(PROMPT) + 20
    assert result.stdout.decode("utf-8") == expected + "\n"


@pytest.mark.parametrize("target", ["model.safetensors", "checkpoint.pt"])
def test_both_saved_forms_hold_the_trained_model_and_its_tokenizer(ours, target):
    folder, model, tokenizer = ours
    loaded, loaded_tokenizer = load_model_and_tokenizer(folder / target)
    assert loaded.config == model.config and loaded_tokenizer.to_json() == tokenizer.to_json()
    state = model.state_dict()
    assert loaded.state_dict().keys() == state.keys()
    assert all(torch.equal(p, state[name]) for name, p in loaded.state_dict().items())
    greedy = run(folder / target, "--prompt", PROMPT, "--max-new-tokens", "25", "--temperature", "0")
    assert greedy.returncode == 0, greedy.stderr.decode()
    expected = generate_text(model, tokenizer, PROMPT, 25, eos_id=tokenizer.eot_token)
    assert greedy.stdout.decode("utf-8") == expected + "\n"


@pytest.mark.slow
def test_options_greedy_seed_dtype_and_empty_prompt(ours):
    """Each from the command line (the two saved forms hold the same model: the test above)."""
    folder, model, tokenizer = ours
    greedy = generate_text(model, tokenizer, PROMPT, 25, eos_id=tokenizer.eot_token)

    def output(*argv):
        result = run(folder / "model.safetensors", "--max-new-tokens", "25", *argv)
        assert result.returncode == 0, result.stderr.decode()
        return result.stdout.decode("utf-8")

    assert output("--prompt", PROMPT, "--temperature", "0") == greedy + "\n"
    assert output("--prompt", PROMPT, "--top-k", "1") == greedy + "\n"  # k=1 is greedy
    first, again = (output("--prompt", PROMPT, "--seed", "3", "--temperature", "1.5") for _ in range(2))
    assert first == again and first != output("--prompt", PROMPT, "--seed", "4", "--temperature", "1.5")
    bf16 = output("--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "25", "--dtype", "bfloat16")
    assert bf16.startswith(PROMPT) and len(bf16) > len(PROMPT) + 10
    unconditional = output("--temperature", "0", "--ignore-eos")
    start = tokenizer.decode([tokenizer.eot_token])
    assert unconditional == generate_text(model, tokenizer, start, 25)[len(start):] + "\n"


def test_help_explains_every_flag():
    result = run("--help")
    assert result.returncode == 0
    text = result.stdout.decode()
    for flag in ("--prompt", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--eos-id",
                 "--ignore-eos", "--tokenizer", "--dtype", "--device"):
        assert flag in text


@pytest.mark.slow
def test_a_bad_path_or_file_is_a_clear_error_not_a_traceback(tmp_path):
    nowhere = run(tmp_path / "nowhere")
    assert nowhere.returncode == 2 and b"nowhere: no such file or folder" in nowhere.stderr
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    junk = run(tmp_path / "junk.pt", "--max-new-tokens", "3")
    assert junk.returncode == 1 and b"is not a readable llmscratch checkpoint" in junk.stderr
    assert b"Traceback" not in junk.stderr


@pytest.mark.parametrize("argv, message", [
    (["--top-p", "1.5"], r"--top-p must be in \(0, 1\], got 1.5"),
    (["--top-p", "0"], r"--top-p must be in \(0, 1\], got 0.0"),
    (["--temperature", "-1"], r"--temperature must be >= 0 \(0 is greedy\), got -1.0"),
    (["--top-k", "0"], r"--top-k must be at least 1, got 0"),
    (["--max-new-tokens", "-5"], r"--max-new-tokens must be >= 0, got -5"),
    (["--eos-id", "3", "--ignore-eos"], r"--eos-id and --ignore-eos contradict"),
    (["--dtype", "int8"], r"invalid choice: 'int8'"),
    (["--device", "toaster"], r"--device: device 'toaster' is not a device name"),
    (["--tokenizer", "missing.json"], r"--tokenizer missing.json: no such file"),
])
def test_bad_flags_are_named(ours, argv, message):
    folder, _, _ = ours
    result = run(folder, *argv)
    assert result.returncode == 2
    assert re.search(message, result.stderr.decode())


@pytest.mark.parametrize("max_new_tokens", ["100000", "4097", str(10**12)])
def test_more_new_tokens_than_64_contexts_is_refused_naming_the_context(ours, max_new_tokens):
    # The model slides its window past its context without end, every token rerunning a whole window: 100,000
    # tokens of a 64-token model were accepted without a word.
    folder, _, _ = ours
    result = run(folder, "--prompt", PROMPT, "--max-new-tokens", max_new_tokens)
    assert result.returncode == 2, result.stderr.decode()
    message = result.stderr.decode()
    assert f"--max-new-tokens {int(max_new_tokens):,} is more than 64 times the model's context of 64 tokens " \
           f"(4,096)" in message and "ask for at most 4,096" in message


def test_going_past_the_context_is_said_and_still_the_text_of_generate_text(ours):
    folder, model, tokenizer = ours
    result = run(folder, "--prompt", PROMPT, "--max-new-tokens", "70", "--temperature", "0", "--ignore-eos")
    assert result.returncode == 0, result.stderr.decode()
    n_prompt = len(tokenizer.encode(PROMPT))
    assert (f"note: {n_prompt} prompt tokens and 70 new ones are more than the model's context of 64: past it each "
            f"new token reads only the last 64") in result.stderr.decode()
    assert result.stdout.decode("utf-8") == generate_text(model, tokenizer, PROMPT, 70) + "\n"
    within = run(folder, "--prompt", PROMPT, "--max-new-tokens", "5", "--temperature", "0")
    assert within.returncode == 0 and b"note" not in within.stderr, within.stderr.decode()


@pytest.mark.parametrize("scheme, dtype, described", [("int4", "float32", "int4 weights (group 16, int8 head)"),
                                                      ("int8", "bfloat16", "int8 weights")])
def test_a_quantized_model_is_announced_as_its_scheme_not_its_dtype(ours, tmp_path, scheme, dtype, described):
    folder, model, tokenizer = ours
    path = tmp_path / f"{scheme}.safetensors"
    export_model(quantize(model, scheme, group_size=16), path, tokenizer)
    result = run(path, "--prompt", PROMPT, "--max-new-tokens", "5", "--temperature", "0", "--dtype", dtype)
    assert result.returncode == 0, result.stderr.decode()
    assert f"note: {path} holds {described}; --dtype {dtype} is the precision of the rest" in result.stderr.decode()
    plain = run(folder, "--prompt", PROMPT, "--max-new-tokens", "5", "--temperature", "0")
    assert b"holds" not in plain.stderr  # a float model: no note


@pytest.mark.slow
def test_bad_content_is_named(ours, hf_gpt2, tmp_path):
    folder, model, tokenizer = ours

    def error(*argv):
        result = run(*argv)
        assert result.returncode == 1 and b"Traceback" not in result.stderr, result.stderr.decode()
        return result.stderr.decode()

    assert "eos_id=99999" in error(folder, "--eos-id", "99999")
    (tmp_path / "empty").mkdir()
    assert "holds no model.safetensors or checkpoint.pt" in error(tmp_path / "empty")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig.from_preset("llama-tiny", vocab_size=300, context_length=32)), tmp_path / "llama")
    assert "pass --tokenizer" in error(tmp_path / "llama")
    # GPT-2's 50,257-token tokenizer with a model of 320 tokens: not made for each other.
    tokenizer_file = tmp_path / "gpt2.json"
    BPETokenizer.gpt2().save(tokenizer_file)
    assert re.search(r"50,257 .*\b320\b", error(folder, "--tokenizer", tokenizer_file))
