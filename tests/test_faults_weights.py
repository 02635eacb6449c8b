"""Damaged or wrong weights are refused, not used (issue 27): each is named where it is read.

A flipped bit in a checkpoint.pt (tensor data or pickle) fails its zip entry's CRC-32; one in a
safetensors file we wrote (tensor bytes or metadata) fails the sha256 in its metadata. Integer,
bool, NaN and infinite weights are refused by name in every kind of file, before any cast. A
spam classifier given where a language model is expected says what it is.
"""

import re
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from scripts import run_script
from test_faults_pretrain import copy_run, digest, finished_run, run_main  # noqa: F401 (a fixture)

from llmscratch.assets import PRETRAINED_PATH
from llmscratch.files import read_safetensors
from llmscratch.finetuning.classify import Classifier, GPTClassifier
from llmscratch.finetuning.config import LoRAConfig
from llmscratch.finetuning.lora import apply_lora, load_adapters, save_adapters
from llmscratch.model.checkpoint import (export_model, export_state_dict, load_checkpoint, model_from_checkpoint,
                                         save_checkpoint, tokenizer_from_checkpoint)
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.model.weights import load_hf, load_model_and_tokenizer, save_hf
from llmscratch.text.tokenizer import BPETokenizer
from llmscratch.training.resume import META_FILE, SHARDED_FORMAT, read_meta

TENSOR = "blocks.0.mlp.up.weight"  # the tensor each case spoils: (32, 16), 512 values
HF_TENSOR = "model.layers.0.mlp.up_proj.weight"  # the same, as a Hugging Face folder names it


def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_preset("llama-tiny", vocab_size=257, context_length=32, d_model=16, n_layers=1,
                                     n_heads=2, n_kv_heads=1, d_ff=32))


def tokenizer() -> BPETokenizer:
    return BPETokenizer([], special_tokens={"<|endoftext|>": 256})  # bytes only: 257 tokens


def generate(argv: list[str]) -> str:
    """ch03-architecture/generate.py run with ``argv``, which must exit with "error: ..." (status 1)."""
    message = run_script("generate", [*argv, "--max-new-tokens", "2"])
    assert isinstance(message, str) and message.startswith("error: ") and "Traceback" not in message, message
    return message


# --------------------------------------------------------------------------- writing spoiled files
def write_checkpoint(path: Path, state: dict[str, torch.Tensor], config: GPTConfig) -> Path:
    save_checkpoint(path, {"model": state, "model_config": config.to_dict(), "tokenizer": tokenizer().to_json()})
    return path


def flip_bit(path: Path, offset: int, mask: int = 0x20) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def zip_entry(path: Path, suffix: str) -> tuple[str, int, int]:
    """(name without the archive folder, offset of its first byte, size) of a torch.save zip entry."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if re.search(suffix, i.filename))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        name_length, extra_length = struct.unpack("<HH", f.read(30)[26:30])
    return info.filename.partition("/")[2], info.header_offset + 30 + name_length + extra_length, info.file_size


def safetensors_data_start(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


# --------------------------------------------------------------------------- checkpoint.pt: its zip CRCs
def test_a_flipped_bit_in_checkpoint_tensor_data_is_refused_naming_the_entry(tmp_path):
    model = tiny_model()
    path = write_checkpoint(tmp_path / "checkpoint.pt", model.state_dict(), model.config)
    entry, start, size = zip_entry(path, r"/data/\d+$")
    flip_bit(path, start + size // 2)
    pattern = rf"{re.escape(str(path))} is damaged: entry {entry}\b"
    for load in (load_checkpoint, model_from_checkpoint, load_model_and_tokenizer, tokenizer_from_checkpoint):
        with pytest.raises(ValueError, match=pattern):
            load(path)
    assert re.match("error: " + pattern, generate([str(path)]))


def test_a_flipped_bit_in_checkpoint_pickle_is_refused(tmp_path):
    model = tiny_model()
    path = write_checkpoint(tmp_path / "checkpoint.pt", model.state_dict(), model.config)
    _, start, size = zip_entry(path, r"/data\.pkl$")
    at = path.read_bytes().index(b"endoftext", start)  # in the tokenizer's JSON: unpickles as well, changed
    assert at < start + size
    flip_bit(path, at)  # "endoftext" -> "Endoftext"
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is damaged: entry data\.pkl"):
        load_checkpoint(path)


def test_a_flipped_bit_in_a_sharded_checkpoints_meta_is_refused(tmp_path):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    torch.save({"format": SHARDED_FORMAT, "step": 4, "tokenizer": tokenizer().to_json()}, folder / META_FILE)
    (folder / ".metadata").write_bytes(b"")  # DCP's index: read_meta only looks for it
    assert read_meta(folder)["step"] == 4
    flip_bit(folder / META_FILE, (folder / META_FILE).read_bytes().index(b"endoftext"))
    with pytest.raises(ValueError, match=r"meta\.pt is damaged: entry data\.pkl"):
        read_meta(folder)


@pytest.mark.slow
def test_pretrain_resume_refuses_a_damaged_checkpoint_and_leaves_the_run(tmp_path, finished_run, capsys):
    run = copy_run(finished_run, tmp_path)
    checkpoint = run / "checkpoint.pt"
    entry, start, size = zip_entry(checkpoint, r"/data/\d+$")
    flip_bit(checkpoint, start + size // 3, mask=0x40)
    before = {path.name: digest(path) for path in run.iterdir() if path.is_file()}
    capsys.readouterr()
    assert run_main(["--out-dir", str(run), "--resume", "--max-steps", "5", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot resume: {checkpoint} is damaged: entry {entry} " in err, err
    assert "Traceback" not in err
    assert {path.name: digest(path) for path in run.iterdir() if path.is_file()} == before  # nothing rewritten


# --------------------------------------------------------------------------- safetensors: the sha256 in the metadata
def export(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    export_model(tiny_model(), path, tokenizer())
    return path


@pytest.mark.parametrize("where", ["tensor bytes", "tokenizer metadata"])
def test_a_flipped_bit_in_an_export_is_refused(tmp_path, where):
    path = export(tmp_path)
    model_from_checkpoint(path)  # intact, it loads
    raw = path.read_bytes()
    flip_bit(path, safetensors_data_start(path) + 1000 if where == "tensor bytes" else raw.index(b"endoftext"))
    pattern = rf"{re.escape(str(path))} is damaged: .*\(llmscratch_sha256\)"
    for load in (model_from_checkpoint, tokenizer_from_checkpoint, load_model_and_tokenizer):
        with pytest.raises(ValueError, match=pattern):
            load(path)
    assert re.match("error: " + pattern, generate([str(path)]))


def test_a_flipped_bit_in_save_hf_weights_or_adapters_is_refused(tmp_path):
    save_hf(tiny_model(), tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    flip_bit(weights, safetensors_data_start(weights) + 100)
    with pytest.raises(ValueError, match=rf"{re.escape(str(weights))} is damaged"):
        load_hf(tmp_path / "hf")

    model = tiny_model()
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0))
    save_adapters(model, tmp_path / "adapters.safetensors")
    flip_bit(tmp_path / "adapters.safetensors", safetensors_data_start(tmp_path / "adapters.safetensors") + 10)
    plain = tiny_model()
    with pytest.raises(ValueError, match=r"adapters\.safetensors is damaged"):
        load_adapters(plain, tmp_path / "adapters.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), tiny_model().state_dict().values()))


# --------------------------------------------------------------------------- wrong weights, in every kind of file
def as_dtype(dtype: torch.dtype):
    return lambda tensor: tensor.to(dtype)


def with_nan(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[[3, 7]] = float("nan")
    return tensor


def with_inf(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[[5, 9]] = torch.tensor([float("inf"), -float("inf")], dtype=tensor.dtype)
    return tensor


SPOILED = {  # name -> (what it does to TENSOR, what the message names of it)
    "int64": (as_dtype(torch.int64), r"torch\.int64"),
    "int32": (as_dtype(torch.int32), r"torch\.int32"),
    "bool": (as_dtype(torch.bool), r"torch\.bool"),
    "NaN": (with_nan, r"\(2 NaN of 512\)"),
    "inf": (with_inf, r"\(2 infinite of 512\)"),
}


def spoiled_state(spoil) -> tuple[dict[str, torch.Tensor], GPTConfig]:
    model = tiny_model()
    state = model.state_dict()
    state[TENSOR] = spoil(state[TENSOR])
    return state, model.config


def spoiled_export(tmp_path: Path, spoil) -> Path:
    state, config = spoiled_state(spoil)
    export_state_dict(state, config, tmp_path / "model.safetensors", tokenizer())  # its checksum holds
    return tmp_path / "model.safetensors"


def spoiled_checkpoint(tmp_path: Path, spoil) -> Path:
    return write_checkpoint(tmp_path / "checkpoint.pt", *spoiled_state(spoil))


@pytest.mark.parametrize("kind", SPOILED)
@pytest.mark.parametrize("write", [spoiled_export, spoiled_checkpoint], ids=["export", "checkpoint.pt"])
def test_wrong_weights_in_our_files_are_refused_by_name(tmp_path, write, kind):
    spoil, said = SPOILED[kind]
    path = write(tmp_path, spoil)
    pattern = rf"{re.escape(str(path))}: {re.escape(TENSOR)}: .*{said}"
    for load in (model_from_checkpoint, load_model_and_tokenizer):
        with pytest.raises(ValueError, match=pattern):
            load(path)
    if kind in ("int64", "NaN"):  # and the script that samples from it: no garbage, no crash in multinomial
        assert re.match("error: " + pattern, generate([str(path), "--temperature", "0" if kind == "int64" else "1"]))


@pytest.mark.parametrize("kind", SPOILED)
def test_wrong_weights_in_a_hugging_face_folder_are_refused_by_name(tmp_path, kind):
    spoil, said = SPOILED[kind]
    save_hf(tiny_model(), tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = read_safetensors(weights)[1]
    tensors[HF_TENSOR] = spoil(tensors[HF_TENSOR])
    save_file(tensors, weights, metadata={"format": "pt"})  # as a download is: no checksum
    with pytest.raises(ValueError, match=rf"{re.escape(str(weights))}: {re.escape(HF_TENSOR)}: .*{said}"):
        load_hf(tmp_path)
    with pytest.raises(ValueError, match=re.escape(HF_TENSOR)):
        load_hf(tmp_path, dtype=torch.bfloat16)  # checked before the cast too


@pytest.mark.parametrize("kind", ["NaN", "inf"])
def test_non_finite_adapters_are_refused_by_name_and_change_nothing(tmp_path, kind):
    spoil, said = SPOILED[kind]
    model = tiny_model()
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0, targets=("*.mlp.up",)))
    with torch.no_grad():
        model.blocks[0].mlp.up.lora_b.copy_(spoil(torch.ones(32, 2)))
    save_adapters(model, tmp_path / "adapters.safetensors")
    plain = tiny_model()
    with pytest.raises(ValueError, match=r"adapters\.safetensors: blocks\.0\.mlp\.up\.lora_b: .*"
                                         + said.replace("512", "64")):
        load_adapters(plain, tmp_path / "adapters.safetensors")
    assert not any("lora" in name for name in plain.state_dict())


# --------------------------------------------------------------------------- a classifier is not a language model
CLASSIFIER_SAYS = r" is a text classifier \(labels ham, spam\)"


def test_a_classifier_given_for_a_language_model_says_what_it_is(tmp_path):
    path = tmp_path / "classifier.pt"
    Classifier(GPTClassifier(tiny_model(), 2), tokenizer(), ("ham", "spam"), pad_id=256, max_length=32).save(path)
    for load in (model_from_checkpoint, load_model_and_tokenizer):
        with pytest.raises(ValueError, match="^" + re.escape(str(path)) + CLASSIFIER_SAYS):
            load(path)
    assert re.match("error: " + re.escape(str(path)) + CLASSIFIER_SAYS, generate([str(path)]))
    with pytest.raises(ValueError, match=re.escape(str(path)) + CLASSIFIER_SAYS):
        load_model_and_tokenizer(tmp_path)  # the classifier's run folder
    assert Classifier.load(path).labels == ("ham", "spam")  # where a classifier is expected, it loads


def test_a_language_model_given_for_a_classifier_says_what_it_is(tmp_path):
    model = tiny_model()
    path = write_checkpoint(tmp_path / "checkpoint.pt", model.state_dict(), model.config)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} is a language model's checkpoint \(it has no "
                                         r"'labels'\)"):
        Classifier.load(path)


# --------------------------------------------------------------------------- what still loads
def test_the_bundled_model_carries_a_checksum_that_holds():
    metadata, tensors = read_safetensors(PRETRAINED_PATH)  # checked against it
    assert len(metadata["llmscratch_sha256"]) == 64 and {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_files_without_a_checksum_still_load(tmp_path):
    """Exports from before the checksum, and checkpoints torch.save wrote without CRCs."""
    path = export(tmp_path)
    metadata, tensors = read_safetensors(path)
    del metadata["llmscratch_sha256"]
    save_file(tensors, tmp_path / "old.safetensors", metadata=metadata)
    model_from_checkpoint(tmp_path / "old.safetensors")
    shutil.copy(path, tmp_path / "copy.safetensors")
    model_from_checkpoint(tmp_path / "copy.safetensors")

    model = tiny_model()
    torch.serialization.set_crc32_options(False)
    try:
        write_checkpoint(tmp_path / "checkpoint.pt", model.state_dict(), model.config)
    finally:
        torch.serialization.set_crc32_options(True)
    with zipfile.ZipFile(tmp_path / "checkpoint.pt") as archive:
        assert {info.CRC for info in archive.infolist()} == {0}
    assert torch.equal(load_checkpoint(tmp_path / "checkpoint.pt")["model"][TENSOR], model.state_dict()[TENSOR])
