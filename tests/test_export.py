"""Exports that run in transformers: save_hf for every shape the course makes (the bundled model, a relu2 run, GPT-2,
Llama, Qwen3, Gemma 3, the mixtures of experts, LoRA-merged and quantized models), shapes with no home refused
before anything is written, and ch07-deployment/export.py run whole (offline)."""

import json
import os

import pytest
import torch
from model_fixtures import LATER_SHAPES, randomize
from scripts import run_script
from tiny_training import tokenizer as tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must never reach for the hub here

import transformers  # noqa: E402  (a test-only dependency, in requirements.txt)

from llmscratch.cli import resolve_model  # noqa: E402
from llmscratch.finetuning.config import LoRAConfig  # noqa: E402
from llmscratch.finetuning.instruct import format_chat  # noqa: E402
from llmscratch.finetuning.lora import apply_lora, lora_layers, merge_lora  # noqa: E402
from llmscratch.model.checkpoint import export_model  # noqa: E402
from llmscratch.model.config import GPTConfig  # noqa: E402
from llmscratch.model.generate import generate  # noqa: E402
from llmscratch.model.gpt import GPT  # noqa: E402
from llmscratch.model.quantize import quantize  # noqa: E402
from llmscratch.model.weights import load_model_and_tokenizer, save_hf  # noqa: E402

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]
NEW_TOKENS = 20
# Two computations of the same float32 logits differ by rounding: about eps per operation, a few hundred
# operations deep in these models; so 2**8 eps of the largest logit
ROUNDINGS = 2 ** 8


def tiny(seed: int = 0, **changes) -> GPT:
    """A random model of the shape pretrain.py makes by default (Llama with a squared-ReLU MLP), with changes."""
    fields = dict(vocab_size=211, context_length=48, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                  norm="rmsnorm", mlp="relu2", position="rope", qkv_bias=False, bias=False, tie_embeddings=False)
    model = GPT(GPTConfig(**{**fields, **changes})).eval()
    randomize(model, seed=seed, scale=0.2)  # 0.2: greedy decoding does not settle on one token
    return model


def gpt2(**changes) -> GPT:
    return tiny(**{**dict(norm="layernorm", mlp="gelu", position="learned", qkv_bias=True, bias=True,
                          n_kv_heads=None), **changes})


def later(kind: str, **changes) -> GPT:
    return tiny(**{**LATER_SHAPES[kind], "context_length": 48, **changes})


MODELS = {
    "relu2-untied": tiny,
    "relu2-tied-biases": lambda: tiny(seed=1, tie_embeddings=True, bias=True, qkv_bias=True),
    "relu2-linear-rope-mha": lambda: tiny(seed=2, n_kv_heads=None, rope_scaling=2.0, rope_theta=500.0),
    "gelu-llama-shape": lambda: tiny(seed=3, mlp="gelu"),
    "gpt2": gpt2,
    "gpt2-relu2": lambda: gpt2(mlp="relu2", d_ff=80),  # pretrain.py --preset gpt2-small: relu2 by default
    "llama": lambda: tiny(mlp="swiglu"),
    "qwen3": lambda: tiny(mlp="swiglu", qk_norm=True, head_size=16),
    "gemma3": lambda: later("gemma"),
    "qwen3-moe": lambda: later("moe", shared_experts=0, qk_norm=True),
    "mixtral": lambda: later("moe", shared_experts=0, dense_layers=()),
}


def tolerance(logits: torch.Tensor) -> float:
    return ROUNDINGS * torch.finfo(torch.float32).eps * logits.abs().max().item()


def assert_runs_the_same(ours: GPT, folder, prompt: torch.Tensor | None = None) -> transformers.PreTrainedModel:
    """transformers loads the folder; its logits equal ours within float32 rounding and its greedy tokens are ours."""
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    vocab_size = ours.config.vocab_size
    if prompt is None:
        prompt = torch.randint(vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(prompt)
        assert (theirs(prompt).logits - expected).abs().max().item() <= tolerance(expected)
        got = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
    ours_tokens = generate(ours, prompt, NEW_TOKENS, temperature=0.0)
    assert torch.equal(got, ours_tokens)
    assert len(set(ours_tokens[0, prompt.size(1):].tolist())) > 3  # a model stuck on one token would hide a fault
    return theirs


def hf_config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


# --------------------------------------------------------------------------- save_hf
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_every_course_shape_runs_the_same_in_transformers(tmp_path, kind):
    ours = MODELS[kind]()
    save_hf(ours, tmp_path)
    assert_runs_the_same(ours, tmp_path)


def test_the_bundled_model_exports_as_arcee_and_generates_its_own_tokens(tmp_path):
    model, tokenizer = load_model_and_tokenizer(resolve_model("base")[1])
    save_hf(model.eval(), tmp_path)
    config = hf_config(tmp_path)
    assert (config["model_type"], config["architectures"], config["hidden_act"]) == ("arcee", ["ArceeForCausalLM"],
                                                                                   "relu2")
    assert config["bos_token_id"] is None and config["eos_token_id"] is None  # not Arcee's 128000 and 128001
    prompt = torch.tensor([tokenizer.encode("Call me Ishmael. Some years ago")])
    assert_runs_the_same(model, tmp_path, prompt)


def test_a_lora_merged_model_exports_its_merged_weights(tmp_path):
    model = tiny(tie_embeddings=True)
    apply_lora(model, LoRAConfig(rank=4, targets=("blocks.*.attn.qkv", "blocks.*.mlp.fc", "lm_head")))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_b.copy_(0.1 * torch.randn(layer.lora_b.shape, generator=generator))
    with pytest.raises(ValueError, match=r"LoRA adapters \(blocks\.0\.attn\.qkv.*merge them"):
        save_hf(model, tmp_path / "unmerged")
    assert not (tmp_path / "unmerged").exists()
    merge_lora(model)
    save_hf(model, tmp_path / "merged")
    # The head, merged apart from the embedding it was tied to, is written apart from it
    assert hf_config(tmp_path / "merged")["tie_word_embeddings"] is False
    assert_runs_the_same(model.eval(), tmp_path / "merged")


@pytest.mark.parametrize("scheme, group_size, head", [("int8", 64, True), ("int4", 16, False), ("int4", 48, True)])
def test_a_quantized_model_exports_dequantized(tmp_path, scheme, group_size, head):
    # It raised a bare KeyError ('blocks.0.attn.qkv.weight')
    quantized = quantize(tiny(tie_embeddings=True), scheme, group_size, head=head)
    save_hf(quantized, tmp_path)
    config = hf_config(tmp_path)
    assert config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] is not head  # a quantized head is no longer the embedding
    assert_runs_the_same(quantized, tmp_path)


NO_HOME = {  # a shape no Hugging Face family holds -> what the refusal names
    "qk-norm-relu2": (lambda: tiny(qk_norm=True), "looks like arcee but it has qk_norm"),
    "sliding-relu2": (lambda: tiny(sliding_window=8), "it has sliding layers"),
    "rmsnorm-learned": (lambda: tiny(position="learned"), "norm=rmsnorm with position=learned"),
    "layernorm-rope": (lambda: tiny(norm="layernorm"), "norm=layernorm with position=rope"),
    "gpt2-no-biases": (lambda: gpt2(bias=False, qkv_bias=False), "looks like gpt2 but it lacks biases"),
    "gpt2-swiglu": (lambda: gpt2(mlp="swiglu"), "its mlp is swiglu"),
    "gpt2-gqa": (lambda: gpt2(n_kv_heads=2), "grouped-query attention"),
    "pruned-heads": (lambda: tiny(n_heads=5, n_kv_heads=1, head_size=12), "d_model=48 is not a multiple of n_heads=5"),
    "shared-experts": (lambda: later("moe"), "shared experts"),
    "qkv-bias-only": (lambda: tiny(mlp="swiglu", qkv_bias=True), "qkv_bias=True differs from bias=False"),
}


@pytest.mark.parametrize("kind", sorted(NO_HOME))
def test_a_shape_with_no_home_is_refused_before_anything_is_written(tmp_path, kind):
    make, named = NO_HOME[kind]
    out = tmp_path / "new" / "export"
    with pytest.raises(ValueError, match=named):
        save_hf(make(), out)
    assert not (tmp_path / "new").exists()  # it used to leave an empty folder


def test_a_failed_write_leaves_no_folder_it_made(tmp_path, monkeypatch):
    def full_disk(path, text):
        raise OSError("disk full")

    monkeypatch.setattr("llmscratch.model.weights.write_text_atomically", full_disk)
    with pytest.raises(OSError, match="disk full"):
        save_hf(tiny(mlp="swiglu"), tmp_path / "export")  # a shape save_hf always took
    assert not (tmp_path / "export").exists()


# --------------------------------------------------------------------------- the script
def export(*argv) -> int | str:
    """ch07-deployment/export.py as ``python export.py ARGV...`` runs it, in this process: its exit status."""
    return run_script("export", list(argv))


@pytest.fixture(scope="module")
def instructions_folder(tmp_path_factory):
    """A folder holding runs/instructions/model.safetensors (where ch05 writes it): the bundled model changed a
    little, as finetuning changes it."""
    folder = tmp_path_factory.mktemp("course")
    model, tokenizer = load_model_and_tokenizer(resolve_model("base")[1])
    with torch.no_grad():
        model.blocks[0].mlp.fc.weight.mul_(1.1)
    export_model(model, folder / "runs" / "instructions" / "model.safetensors", tokenizer)
    return folder


def test_the_script_exports_the_bundled_model_with_its_tokenizer(tmp_path, capsys):
    out = tmp_path / "base"
    assert export("--out", out) == 0, capsys.readouterr().err
    model, tokenizer = load_model_and_tokenizer(resolve_model("base")[1])
    text = "Call me Ishmael. Some years ago"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer(text)["input_ids"] == tokenizer.encode(text)
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())  # a base model chats not
    assert_runs_the_same(model.eval(), out, torch.tensor([tokenizer.encode(text)]))


def test_the_instruction_model_exports_with_the_course_chat_template(instructions_folder, tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.chdir(instructions_folder)
    out = tmp_path / "instructions"
    assert export("--model", "instructions", "--out", out) == 0, capsys.readouterr().err
    assert "with ch05's chat template" in capsys.readouterr().out
    messages = [{"role": "user", "content": "Name a whale."}]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        format_chat(messages)
    model, tokenizer = load_model_and_tokenizer(instructions_folder / "runs" / "instructions")
    assert_runs_the_same(model.eval(), out, torch.tensor([tokenizer.encode(format_chat(messages))]))


def test_an_earlier_export_is_replaced_and_a_folder_of_other_files_refused(tmp_path, capsys):
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_text("an earlier export")
    assert export("--out", out) == 0, capsys.readouterr().err
    assert hf_config(out)["model_type"] == "arcee"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.txt").write_text("mine")
    assert export("--out", notes) == 2
    assert "holds files that are not those of an earlier export (thesis.txt)" in capsys.readouterr().err
    assert [p.name for p in notes.iterdir()] == ["thesis.txt"]


def test_the_script_refuses_a_shape_with_no_home_and_writes_nothing(tmp_path, capsys):
    export_model(tiny(vocab_size=320, qk_norm=True), tmp_path / "model.safetensors", tiny_tokenizer())
    out = tmp_path / "out" / "export"
    assert export("--model", tmp_path / "model.safetensors", "--out", out) == 2
    err = capsys.readouterr().err
    assert "looks like arcee but it has qk_norm" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_the_script_says_a_quantized_model_is_written_dequantized(tmp_path, capsys):
    model, tokenizer = load_model_and_tokenizer(resolve_model("base")[1])
    export_model(quantize(model.eval(), "int8"), tmp_path / "int8.safetensors", tokenizer)
    assert export("--model", tmp_path / "int8.safetensors", "--out", tmp_path / "export") == 0
    assert "int8 weights are written dequantized, as float32" in capsys.readouterr().out
    assert hf_config(tmp_path / "export")["torch_dtype"] == "float32"


def test_a_failed_export_leaves_the_earlier_one_whole(tmp_path, monkeypatch, capsys):
    out = tmp_path / "export"
    assert export("--out", out) == 0, capsys.readouterr().err
    before = {path.name: path.read_bytes() for path in out.iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError("disk full")

    model, tokenizer = load_model_and_tokenizer(resolve_model("base")[1])
    export_model(tiny(vocab_size=model.config.vocab_size), tmp_path / "other" / "model.safetensors", tokenizer)
    monkeypatch.setattr("llmscratch.text.hf_export.save_tokenizer_hf", full_disk)  # after the weights are written
    assert export("--model", tmp_path / "other", "--out", out) == "error: disk full"
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["export", "other"]  # no staging folder left


def test_the_script_writes_a_gguf_file_for_llama_cpp(tmp_path, capsys):
    from gguf import GGUFReader

    out = tmp_path / "base.gguf"
    assert export("--format", "gguf", "--out", out) == 0, capsys.readouterr().err
    reader = GGUFReader(out)
    architecture = reader.fields["general.architecture"]
    assert bytes(architecture.parts[architecture.data[0]]).decode() == "arcee"
    assert export("--format", "gguf", "--out", tmp_path / "base.bin") == 2
    assert "expected a .gguf file name" in capsys.readouterr().err
