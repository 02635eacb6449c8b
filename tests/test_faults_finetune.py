"""Bad inputs to finetuning, adapters, weight files and generation: a clear message, a non-zero exit, nothing lost.

One table: each case builds a broken input in its own folder, runs it through a script
(run in this process, tests/scripts.py) or an API call, and states the outcome: exit status 2 (a flag the
parser refuses, message on stderr), 1 ("error: ..." before any work) or a ValueError, a
pattern the message must match, and that every file that existed beforehand is unchanged.
"""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from scripts import run_script  # noqa: E402

from llmscratch.files import write_safetensors  # noqa: E402
from llmscratch.finetuning.config import LoRAConfig  # noqa: E402
from llmscratch.finetuning.lora import apply_lora, load_adapters, lora_layers, save_adapters  # noqa: E402
from llmscratch.model.checkpoint import export_model, save_checkpoint
from llmscratch.model.config import GPTConfig  # noqa: E402
from llmscratch.model.gpt import GPT
from llmscratch.model.weights import save_hf  # noqa: E402
from llmscratch.text.tokenizer import BPETokenizer  # noqa: E402

OURS = dict(vocab_size=257, context_length=256, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)


def ours(seed: int = 0, **overrides) -> GPT:
    """A tiny Llama-style model over bytes + <|endoftext|>."""
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_preset("llama-tiny", **{**OURS, **overrides}))


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """A pretraining run folder (export + checkpoint) and a Hugging Face GPT-2 folder, all intact."""
    root = tmp_path_factory.mktemp("sources")
    tokenizer = BPETokenizer([], special_tokens={"<|endoftext|>": 256})  # bytes only: 257 tokens
    model = ours()
    (root / "run").mkdir()
    export_model(model, root / "run" / "model.safetensors", tokenizer)
    save_checkpoint(root / "run" / "checkpoint.pt", {"model": model.state_dict(), "model_config": model.config.to_dict(),
                                                     "tokenizer": tokenizer.to_json()})
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=50257, context_length=64, d_model=8, n_layers=1, n_heads=2)), root / "hf")
    return {"run": root / "run", "hf": root / "hf"}


# --------------------------------------------------------------------------- broken inputs
def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def copy_of(sources, name: str, tmp: Path) -> Path:
    shutil.copytree(sources[name], tmp / name)
    return tmp / name


def truncated_hf(sources, tmp):
    folder = copy_of(sources, "hf", tmp)
    truncate(folder / "model.safetensors")
    return folder


def truncated_export(sources, tmp):
    folder = copy_of(sources, "run", tmp)
    truncate(folder / "model.safetensors")
    return folder


def truncated_checkpoint(sources, tmp):
    folder = copy_of(sources, "run", tmp)
    (folder / "model.safetensors").unlink()
    truncate(folder / "checkpoint.pt")
    return folder / "checkpoint.pt"


def shard_index_naming_a_missing_file(sources, tmp):
    folder = copy_of(sources, "hf", tmp)
    names = sorted(load_file(folder / "model.safetensors"))
    weight_map = {name: "model.safetensors" for name in names[1:]}
    weight_map[names[0]] = "model-00002-of-00002.safetensors"  # never written
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def tsv(lines: list[str]):
    def make(sources, tmp):
        (tmp / "sms.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
        return tmp / "sms.tsv"
    return make


def instructions_with_a_long_prompt(sources, tmp):
    records = [{"instruction": "Say yes.", "input": "", "output": "yes", "split": "train"},
               {"instruction": "Repeat the input.", "input": "word " * 40, "output": "word", "split": "train"},
               {"instruction": "Say no.", "input": "", "output": "no", "split": "test"}]
    (tmp / "data.json").write_text(json.dumps(records))
    return tmp / "data.json"


def script(name: str, *argv, make=None, base: str = "run"):
    """A case that runs a script; "{input}" in argv is what ``make`` built, "{base}" a source folder.

    Every case returns (the call to make, the model it may change or None)."""
    def action(sources, tmp):
        made = make(sources, tmp) if make else None
        out = tmp / "out"
        full = [str(made) if a == "{input}" else str(sources[base]) if a == "{base}" else a for a in argv]
        if name != "generate":  # --overwrite: the earlier run's files in out/ must survive a failure all the same
            full += ["--out-dir", str(out), "--test-mode", "--no-progress", "--overwrite"]
        else:
            full += ["--max-new-tokens", "2"]
        return (lambda: run_script(name, full)), None
    return action


# --------------------------------------------------------------------------- LoRA files
def adapter_file(edit=None, metadata=None):
    """Adapters saved from a rank-2 LoRA of ``ours()``, then ``edit``ed (tensors) or with other metadata."""
    def make(sources, tmp):
        model = ours(seed=1)
        apply_lora(model, LoRAConfig(rank=2, alpha=4.0, targets=("*.attn.qkv", "*.mlp.*")))
        path = tmp / "adapters.safetensors"
        save_adapters(model, path)
        if edit or metadata is not None:
            tensors = load_file(path)
            with safe_open(path, framework="pt") as f:
                saved = f.metadata()
            if edit:
                edit(tensors)
            write_safetensors(path, tensors, saved if metadata is None else {**saved, **metadata})
        return path
    return make


def wider_adapters(sources, tmp):
    """The same layer names, from a model of another width: every shape differs."""
    model = ours(seed=1, d_model=32, n_heads=4)
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0, targets=("*.attn.qkv", "*.mlp.*")))
    save_adapters(model, tmp / "adapters.safetensors")
    return tmp / "adapters.safetensors"


def truncated_adapters(sources, tmp):
    path = adapter_file()(sources, tmp)
    truncate(path)
    return path


def load_into_a_plain_model(make):
    def action(sources, tmp):
        path = make(sources, tmp)
        model = ours(seed=5)
        return (lambda: load_adapters(model, path)), model
    return action


def load_into_existing_adapters(make):
    def action(sources, tmp):
        path = make(sources, tmp)
        model = ours(seed=5)
        apply_lora(model, LoRAConfig(rank=2, alpha=4.0, targets=("*.attn.qkv", "*.mlp.*")))
        return (lambda: load_adapters(model, path)), model
    return action


def truncated_weights() -> dict:
    """A truncated model.safetensors, of a Hugging Face folder or of a run folder's export, given to generate.py
    and to a finetuning script's --base."""
    cases = {}
    for what, make, folder, finetuning in (("HF weights", truncated_hf, "hf", "classifier"),
                                           ("export in a run folder", truncated_export, "run", "instructions")):
        message = folder + r"[/\\]model\.safetensors is not a readable safetensors file \(truncated"
        cases[f"truncated {what} to generate.py"] = (script("generate", "{input}", make=make), 1, message)
        cases[f"truncated {what} to --base"] = (script(finetuning, "--base", "{input}", make=make), 1,
                                                 "^error: .*" + message)
    return cases


CASES = {
    # ---- weight files: a truncated or incomplete file is named, in every script that loads one
    **truncated_weights(),
    "truncated checkpoint.pt to --base": (
        script("classifier", "--base", "{input}", make=truncated_checkpoint), 1,
        r"checkpoint\.pt is not a readable llmscratch checkpoint"),
    "HF shard index naming a missing file": (
        script("generate", "{input}", make=shard_index_naming_a_missing_file), 1,
        r"model\.safetensors\.index\.json .*\['model-00002-of-00002\.safetensors'\]"),
    "HF shard index naming a missing file, to --base": (
        script("classifier", "--base", "{input}", make=shard_index_naming_a_missing_file), 1,
        r"model-00002-of-00002\.safetensors"),
    # ---- devices: validated as pretrain.py does, before anything loads
    "--device toaster (classifier)": (
        script("classifier", "--base", "{base}", "--device", "toaster"), 2,
        r"--device: device 'toaster'"),
    "--device cuda:7 (instructions)": (
        script("instructions", "--base", "{base}", "--device", "cuda:7"), 2,
        r"--device: device 'cuda:7'"),
    # ---- config flags: refused as the config refuses them, named by the flag, before anything loads
    "--epochs 0 (classifier)": (script("classifier", "--base", "{base}", "--epochs", "0"), 2,
                                r"error: --epochs .*got 0$"),
    "--lr nan (instructions)": (script("instructions", "--base", "{base}", "--lr", "nan"), 2,
                                r"--lr: 'nan'"),
    "--lora-rank 0 (classifier)": (script("classifier", "--base", "{base}", "--lora", "--lora-rank", "0"), 2,
                                   r"error: LoRA rank .*got 0$"),
    # ---- data
    "SMS TSV line without a tab": (
        script("classifier", "--base", "{base}", "--data", "{input}", make=tsv(["ham\thello", "spam free prize"])),
        1, r"sms\.tsv, line 2: .*tab.* 'spam free prize'"),
    "SMS TSV with an unknown label": (
        script("classifier", "--base", "{base}", "--data", "{input}",
               make=tsv(["ham\thello", "", "spma\tfree prize"])),
        1, r"sms\.tsv, line 3: .*'spma'.*\('ham', 'spam'\)"),
    "SMS TSV with too few spam messages": (
        script("classifier", "--base", "{base}", "--data", "{input}",
               make=tsv([f"ham\tmessage {i}" for i in range(30)] + [f"spam\toffer {i}" for i in range(5)])),
        1, r"30 ham and 5 spam .*10"),
    "instruction record longer than the context": (
        script("instructions", "--base", "{base}", "--data", "{input}", make=instructions_with_a_long_prompt),
        1, r"data\.json, 'train' split: .*context_length=256 .*record 1 \('Repeat the input\.'\)"),
    # ---- LoRA adapter files: refused whole, the model untouched
    "adapters of other shapes": (load_into_a_plain_model(wider_adapters), ValueError,
                                 r"blocks\.0\.attn\.qkv\.lora_a: .*\(2, 32\).*\(2, 16\)"),
    "adapters of other shapes, into adapters": (load_into_existing_adapters(wider_adapters), ValueError,
                                                r"\(2, 32\).*\(2, 16\)"),
    "adapter file missing one tensor": (
        load_into_a_plain_model(adapter_file(edit=lambda t: t.pop("blocks.0.mlp.down.lora_b"))), ValueError,
        r"missing \['blocks\.0\.mlp\.down\.lora_b'\]"),
    "adapter file missing one tensor, into adapters": (
        load_into_existing_adapters(adapter_file(edit=lambda t: t.pop("blocks.0.mlp.down.lora_b"))), ValueError,
        r"missing \['blocks\.0\.mlp\.down\.lora_b'\]"),
    "adapter file with an extra tensor": (
        load_into_a_plain_model(adapter_file(edit=lambda t: t.update({"blocks.0.attn.out_proj.lora_a":
                                                                      torch.zeros(2, 16)}))), ValueError,
        r"unexpected \['blocks\.0\.attn\.out_proj\.lora_a'\]"),
    "adapter file of integers": (
        load_into_a_plain_model(adapter_file(edit=lambda t: t.update({"blocks.0.attn.qkv.lora_b":
                                                                      torch.zeros(32, 2, dtype=torch.int64)}))),
        ValueError, r"blocks\.0\.attn\.qkv\.lora_b: .*torch\.int64"),
    "adapter metadata without layers": (
        load_into_a_plain_model(adapter_file(metadata={"layers": "{not json"})), ValueError,
        r"adapters\.safetensors: .*'layers'"),
    "adapter metadata with rank 0": (
        load_into_a_plain_model(adapter_file(metadata={"layers": json.dumps(
            {"blocks.0.attn.qkv": {"rank": 0, "alpha": 4.0}})})), ValueError,
        r"'blocks\.0\.attn\.qkv' .*rank"),
    "adapter metadata rank not the tensors'": (
        load_into_a_plain_model(adapter_file(metadata={"layers": json.dumps(
            {name: {"rank": 4, "alpha": 4.0} for name in ("blocks.0.attn.qkv", "blocks.0.mlp.gate", "blocks.0.mlp.up",
                                                          "blocks.0.mlp.down")})})), ValueError,
        r"blocks\.0\.attn\.qkv: .*rank=4.*\(2, 16\).*\(32, 2\)"),
    "adapter metadata of another format": (
        load_into_a_plain_model(adapter_file(metadata={"format": "pt"})), ValueError,
        r"format 'pt'"),
    "truncated adapter file": (load_into_a_plain_model(truncated_adapters), ValueError,
                               r"adapters\.safetensors is not a readable safetensors file"),
}


def snapshot(folder: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_input_is_named_and_nothing_is_lost(case, sources, tmp_path, capsys):
    build, outcome, pattern = CASES[case]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.json").write_text("a previous run's metrics")  # must survive the failure
    action, model = build(sources, tmp_path)
    before, sources_before = snapshot(tmp_path), {name: snapshot(folder) for name, folder in sources.items()}
    if outcome is ValueError:
        state = {k: v.clone() for k, v in model.state_dict().items()}
        modules = [(name, type(module)) for name, module in model.named_modules()]
        with pytest.raises(ValueError, match=pattern):
            action()
        assert [(name, type(module)) for name, module in model.named_modules()] == modules  # none wrapped
        assert model.state_dict().keys() == state.keys()
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # not a bit changed
    else:
        code = action()
        if outcome == 2:
            assert code == 2
            message = capsys.readouterr().err
        else:
            assert isinstance(code, str) and code.startswith("error: "), code  # sys.exit("error: ..."): status 1
            message = code
        assert "Traceback" not in message
        assert re.search(pattern, message), message
    assert snapshot(tmp_path) == before
    assert {name: snapshot(folder) for name, folder in sources.items()} == sources_before


@pytest.mark.parametrize("make", [wider_adapters, adapter_file(edit=lambda t: t.pop("blocks.0.mlp.down.lora_b")),
                                  adapter_file(metadata={"layers": json.dumps({"blocks.0.attn.qkv": {"rank": 2}})})],
                         ids=["shapes", "missing tensor", "metadata without alpha"])
def test_a_refused_adapter_file_leaves_a_plain_model_bitwise_unchanged(make, sources, tmp_path):
    model = ours(seed=5)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modules = [name for name, _ in model.named_modules()]
    path = make(sources, tmp_path)
    with pytest.raises(ValueError, match=str(path.name)):
        load_adapters(model, path)
    assert not lora_layers(model) and [name for name, _ in model.named_modules()] == modules
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in model.parameters())  # not frozen either
