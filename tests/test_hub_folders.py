"""Hugging Face folders whose files are not what they claim (issue 50, item 4): one line naming the file and the
field, before anything big is allocated or any file outside the folder is read.

Each folder is written by transformers (random weights, offline) and then damaged in one place: a config.json size
the weights deny or no machine holds, a value of the wrong kind, a shard index that points out of the folder.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must never reach for the hub here

from test_hf_families import hf_gemma3, hf_mixtral, hf_qwen3, hf_qwen3_moe  # noqa: E402
from test_weights import hf_gpt2, hf_llama  # noqa: E402

from llmscratch.model import weights  # noqa: E402
from llmscratch.model.weights import load_hf, load_model_and_tokenizer  # noqa: E402

# A hang (a loop over 10**10 layers) fails in a minute with a stack, not at the suite's 15 minutes
pytestmark = pytest.mark.timeout(120)

BUILDERS = {"gpt2": hf_gpt2, "llama": hf_llama, "qwen3": hf_qwen3, "gemma3": hf_gemma3, "qwen3_moe": hf_qwen3_moe,
            "mixtral": hf_mixtral}
BIG = 10**6  # elements: a tensor this large on a real device is an allocation these tiny models never make


class RefuseBigTensors(TorchDispatchMode):
    """Fails the test at the first tensor of more than BIG elements made anywhere but on the "meta" device:
    before the allocator is asked, so a 2.56 TB attempt is caught as such (and not by the kernel's overcommit)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        if name.startswith(("empty", "zeros", "ones", "full", "rand", "new_", "arange")) \
                and str(kwargs.get("device", "cpu")) != "meta":
            elements = _elements(name, args)
            assert elements <= BIG, f"{func} asked for {elements:,} elements: allocated before the sizes were checked"
        return func(*args, **kwargs)


def _elements(name: str, args: tuple) -> int:
    if name.startswith("arange"):
        start, end, step = (0, *args[:1], 1) if len(args) == 1 else (*args[:2], args[2] if len(args) > 2 else 1)
        return int(abs((end - start) / step))
    shape = next((a for a in args if isinstance(a, list | tuple | torch.Size)), ())
    count = 1
    for size in shape:
        count *= int(size)
    return count


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """family -> a folder transformers wrote (built once per module, on first use)."""
    folders = {}

    def folder(family: str) -> Path:
        if family not in folders:
            folders[family] = tmp_path_factory.mktemp(family)
            BUILDERS[family]().save_pretrained(folders[family])
        return folders[family]
    return folder


def copy_of(pristine, family: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine(family), tmp_path / "model"))


def edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def load_refused(folder: Path, *expected: str) -> str:
    """load_hf's ValueError for ``folder``, which must name config.json's path and each of ``expected``; nothing
    big is allocated on the way."""
    with RefuseBigTensors(), pytest.raises(ValueError) as caught:
        load_hf(folder)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message, message
    for text in expected:
        assert text in message, f"{text!r} not in: {message}"
    return message


def setter(field: str, value):
    def edit(config):
        config[field] = value
    return edit


def dropper(field: str):
    def edit(config):
        del config[field]
    return edit


# --------------------------------------------------------------------------- sizes the weights deny
@pytest.mark.parametrize("family, field, value", [
    ("llama", "vocab_size", 2 * 10**9),  # a 0.5 TB embedding (10**10, the issue's, is out of range at once)
    ("llama", "vocab_size", 300),
    ("llama", "hidden_size", 10**9),
    ("llama", "intermediate_size", 10**9),
    ("llama", "num_key_value_heads", 4),
    ("llama", "head_dim", 10**6),
    ("gpt2", "vocab_size", 2 * 10**9),
    ("gpt2", "n_positions", 2 * 10**9),  # GPT-2's positions are weights: their table pins the number
    ("gpt2", "n_inner", 10**9),
    ("qwen3", "head_dim", 12),
    ("gemma3", "intermediate_size", 10**9),
    ("qwen3_moe", "moe_intermediate_size", 10**9),
])
def test_a_size_the_weights_deny_is_named_before_the_model_is_built(pristine, tmp_path, family, field, value):
    folder = copy_of(pristine, family, tmp_path)
    edit_config(folder, setter(field, value))
    load_refused(folder, str(folder / "config.json"), f"{field}={value}", "does not fit the weights")


@pytest.mark.parametrize("family, field, held", [("llama", "num_hidden_layers", 3), ("gpt2", "n_layer", 3),
                                                 ("mixtral", "num_hidden_layers", 2)])
@pytest.mark.parametrize("layers", [1, 50, 60_000])
def test_a_layer_count_the_weights_deny_is_named(pristine, tmp_path, family, field, held, layers):
    folder = copy_of(pristine, family, tmp_path)
    edit_config(folder, setter(field, layers))
    load_refused(folder, "config.json", f"{field}={layers}", f"which hold {held} layers")


def test_more_experts_than_the_weights_hold_are_named(pristine, tmp_path):
    folder = copy_of(pristine, "mixtral", tmp_path)
    edit_config(folder, setter("num_local_experts", 4000))
    load_refused(folder, "do not fit config.json", "num_local_experts=4000", "experts.7.")


# --------------------------------------------------------------------------- sizes no machine holds
@pytest.mark.parametrize("family, positions, memory", [
    ("gemma3", 2**31 - 1, None),  # two tables of cos and sin, 14 wide: 0.5 TB
    ("qwen3_moe", 2**31 - 1, None),  # 16 wide: 0.3 TB
    ("llama", 10**8, 2 << 30),  # 6 GB on a machine of 2 GiB
    ("mixtral", 10**7, 500 << 20),  # 0.8 GB on one of 500 MiB
])
def test_a_context_no_memory_holds_is_refused_before_its_tables_are_built(pristine, tmp_path, monkeypatch, family,
                                                                         positions, memory):
    """RoPE's tables are sized by max_position_embeddings, which no weight pins: their bytes are counted."""
    folder = copy_of(pristine, family, tmp_path)
    edit_config(folder, setter("max_position_embeddings", positions))
    if memory is not None:
        monkeypatch.setattr(weights, "machine_memory", lambda: memory)
    load_refused(folder, "config.json", f"max_position_embeddings={positions}", "GiB", "more than this machine's")


def test_the_memory_bound_is_the_machines(pristine, tmp_path, monkeypatch):
    folder = copy_of(pristine, "llama", tmp_path)
    monkeypatch.setattr(weights, "machine_memory", lambda: 100_000)  # a machine of 100 kB
    load_refused(folder, "config.json", "more than this machine's")
    monkeypatch.setattr(weights, "machine_memory", lambda: None)  # unknown: not refused
    assert load_hf(folder).config.vocab_size == 293


# --------------------------------------------------------------------------- values of the wrong kind
WRONG = [
    ("llama", setter("vocab_size", "293"), "vocab_size", "an integer"),
    ("llama", setter("vocab_size", 0), "vocab_size", "an integer from 1"),
    ("llama", setter("vocab_size", -293), "vocab_size", "an integer from 1"),
    ("llama", setter("vocab_size", 293.5), "vocab_size", "an integer"),
    ("llama", setter("vocab_size", True), "vocab_size", "an integer"),
    ("llama", setter("vocab_size", 10**10), "vocab_size", "2,147,483,647"),  # the 2.56 TB embedding
    ("llama", dropper("vocab_size"), "'vocab_size'", "which a llama config needs"),
    ("llama", setter("hidden_size", [64]), "hidden_size", "an integer"),
    ("llama", setter("num_hidden_layers", 10**10), "num_hidden_layers", "65,536"),
    ("llama", setter("num_attention_heads", 0), "num_attention_heads", "an integer"),
    ("llama", setter("num_attention_heads", 10**9), "num_attention_heads", "65,536"),
    ("llama", setter("num_key_value_heads", 3), "num_key_value_heads", "a divisor of num_attention_heads=8"),
    ("llama", setter("head_dim", 7), "head_dim", "even"),
    ("llama", setter("head_dim", "8"), "head_dim", "an integer"),
    ("llama", setter("max_position_embeddings", 10**10), "max_position_embeddings", "2,147,483,647"),  # the issue's
    ("llama", setter("max_position_embeddings", -1), "max_position_embeddings", "an integer"),
    ("llama", setter("max_position_embeddings", 96.0), "max_position_embeddings", "an integer"),
    ("llama", setter("rms_norm_eps", 0), "rms_norm_eps", "a finite number"),
    ("llama", setter("rms_norm_eps", "1e-6"), "rms_norm_eps", "a finite number"),
    ("llama", setter("rope_parameters", "default"), "rope_parameters", "an object"),
    ("llama", setter("rope_parameters", {"rope_type": "default", "rope_theta": -1}), "rope_parameters.rope_theta",
     "a finite number"),
    ("llama", setter("rope_parameters", {"rope_type": "linear", "factor": "2"}), "rope_parameters.factor",
     "a finite number"),
    ("llama", setter("rope_parameters", {"rope_type": ["linear"]}), "rope_parameters.rope_type", "a string"),
    ("llama", lambda c: c.update(rope_parameters=None, rope_scaling=[1, 2]), "rope_scaling", "an object"),
    ("llama", setter("tie_word_embeddings", "false"), "tie_word_embeddings", "true or false"),
    ("llama", setter("attention_bias", 0), "attention_bias", "true or false"),
    ("llama", setter("hidden_act", 1), "hidden_act", "a string"),
    ("gpt2", setter("n_embd", 50), "n_embd", "a multiple of n_head=4"),
    ("gpt2", setter("layer_norm_epsilon", float("inf")), "layer_norm_epsilon", "a finite number"),
    ("gpt2", setter("scale_attn_weights", "yes"), "scale_attn_weights", "true or false"),
    ("gpt2", setter("add_cross_attention", "false"), "add_cross_attention", "true or false"),
    ("qwen3", setter("layer_types", ["full_attention"] * 2), "layer_types", "a list of 3"),
    ("qwen3", lambda c: c.update(use_sliding_window=True, sliding_window=-4), "sliding_window", "an integer"),
    ("qwen3", lambda c: c.update(use_sliding_window="true", sliding_window=4), "use_sliding_window", "true or false"),
    ("qwen3", lambda c: c.update(use_sliding_window=True, sliding_window=4, layer_types=None,
                                 max_window_layers=-1), "max_window_layers", "an integer from 0"),
    ("gemma3", setter("layer_types", ["sliding_attention"] * 6), "layer_types", "a list of 5"),
    ("gemma3", setter("layer_types", ["sliding_attention"] * 4 + ["global"]), "layer_types", "a list of 5"),
    ("gemma3", setter("sliding_window", 0), "sliding_window", "an integer"),
    ("gemma3", setter("query_pre_attn_scalar", "24"), "query_pre_attn_scalar", "a finite number"),
    ("gemma3", setter("rope_parameters", {"full_attention": 1, "sliding_attention": {}}),
     "rope_parameters.full_attention", "an object"),
    ("gemma3", lambda c: c.update(layer_types=None, sliding_window_pattern=0), "sliding_window_pattern",
     "an integer"),
    ("qwen3_moe", setter("mlp_only_layers", [7]), "mlp_only_layers", "layer indices from 0 to 2"),
    ("qwen3_moe", setter("mlp_only_layers", "1"), "mlp_only_layers", "layer indices"),
    ("qwen3_moe", setter("num_experts_per_tok", 99), "num_experts_per_tok", "at most the 5 experts"),
    ("qwen3_moe", setter("norm_topk_prob", 1), "norm_topk_prob", "true or false"),
    ("qwen3_moe", setter("decoder_sparse_step", 0), "decoder_sparse_step", "an integer"),
    ("mixtral", setter("num_local_experts", 1), "num_local_experts", "an integer from 2"),
    ("mixtral", setter("router_aux_loss_coef", "0.01"), "router_aux_loss_coef", "a finite number"),
    ("mixtral", setter("router_jitter_noise", -1), "router_jitter_noise", "a finite number"),
]


@pytest.mark.parametrize("family, edit, field, must", WRONG, ids=[f"{w[0]}-{w[2]}-{i}" for i, w in enumerate(WRONG)])
def test_a_value_of_the_wrong_kind_names_the_file_and_the_field(pristine, tmp_path, family, edit, field, must):
    folder = copy_of(pristine, family, tmp_path)
    edit_config(folder, edit)
    load_refused(folder, str(folder / "config.json"), field, must)


def test_a_multimodal_gemma3_names_its_text_config_fields(pristine, tmp_path):
    folder = copy_of(pristine, "gemma3", tmp_path)
    edit_config(folder, lambda c: c.update(model_type="gemma3", text_config={**c, "vocab_size": "307"}))
    load_refused(folder, "config.json", "text_config.vocab_size", "an integer")
    edit_config(folder, lambda c: c.update(text_config={**c["text_config"], "vocab_size": 2 * 10**9}))
    load_refused(folder, "config.json", "text_config.vocab_size=2000000000", "does not fit the weights")


# --------------------------------------------------------------------------- shard indexes
def sharded(pristine, tmp_path: Path) -> tuple[Path, Path, dict]:
    """A sharded llama folder, a readable copy of its first shard outside it, and its index."""
    folder = tmp_path / "model"
    hf_llama().save_pretrained(folder, max_shard_size="100KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder, folder / min(index["weight_map"].values()), index


def point_first_shard_at(folder: Path, first: Path, index: dict, name) -> None:
    index["weight_map"] = {tensor: name if shard == first.name else shard
                           for tensor, shard in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("name", ["../outside.safetensors", "sub/../../outside.safetensors", "ABSOLUTE"])
def test_an_index_entry_out_of_the_folder_is_refused_before_it_is_read(pristine, tmp_path, monkeypatch, name):
    folder, first, index = sharded(pristine, tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.move(first, outside)  # the very tensors: read, they would load without a word
    (folder / "sub").mkdir()
    name = str(outside) if name == "ABSOLUTE" else name
    point_first_shard_at(folder, first, index, name)
    read = []
    for reader in ("read_safetensors", "read_safetensors_shapes"):
        monkeypatch.setattr(weights, reader, lambda path, *a, **k: read.append(path))
    message = load_refused(folder, "model.safetensors.index.json", repr(name), "out of")
    assert not read, message


@pytest.mark.parametrize("link", ["file", "folder"])
def test_an_index_entry_through_a_link_out_of_the_folder_is_refused(pristine, tmp_path, link):
    folder, first, index = sharded(pristine, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(first, elsewhere / first.name)
    if link == "file":
        first.symlink_to(elsewhere / first.name)  # same name, a link out
    else:
        (folder / "sub").symlink_to(elsewhere, target_is_directory=True)
        point_first_shard_at(folder, first, index, f"sub/{first.name}")
    load_refused(folder, "model.safetensors.index.json", "links to", str(elsewhere), "outside")


def test_a_single_file_linked_out_of_the_folder_is_refused(pristine, tmp_path):
    folder = copy_of(pristine, "llama", tmp_path)
    shutil.move(folder / "model.safetensors", tmp_path / "elsewhere.safetensors")
    (folder / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    load_refused(folder, "model.safetensors", "links to", "outside")


@pytest.mark.parametrize("name", [5, "", None, ["a.safetensors"], "config.json", "x\u0000.safetensors"])
def test_an_index_entry_that_is_no_shard_name_is_refused(pristine, tmp_path, name):
    folder, first, index = sharded(pristine, tmp_path)
    point_first_shard_at(folder, first, index, name)
    load_refused(folder, "model.safetensors.index.json", "weight_map entry", "expected the name of a .safetensors")


def test_the_hub_caches_links_into_its_blobs_still_load(pristine, tmp_path):
    """~/.cache/huggingface/hub keeps each file once in blobs/ and links to it from snapshots/<revision>/."""
    source = pristine("llama")
    snapshot = tmp_path / "models--x--y" / "snapshots" / "0123abc"
    blobs = tmp_path / "models--x--y" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for number, file in enumerate(sorted(source.iterdir())):
        shutil.copy(file, blobs / f"blob{number}")
        (snapshot / file.name).symlink_to(Path("../../blobs") / f"blob{number}")
    assert load_hf(snapshot).config.vocab_size == 293


def test_load_model_and_tokenizer_refuses_the_same_folders(pristine, tmp_path):
    folder = copy_of(pristine, "llama", tmp_path)
    edit_config(folder, setter("vocab_size", 2 * 10**9))
    with RefuseBigTensors(), pytest.raises(ValueError, match=r"config\.json: vocab_size=2000000000 does not fit"):
        load_model_and_tokenizer(folder)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_json_nested_past_pythons_limit_is_named(pristine, tmp_path, name):
    """json.loads raises RecursionError on '[' * 100000, not JSONDecodeError: a damaged file all the same."""
    folder = copy_of(pristine, "llama", tmp_path)
    (folder / name).write_text("[" * 100_000 + "]" * 100_000)
    with RefuseBigTensors(), pytest.raises(ValueError, match="not valid JSON.*recursion") as caught:
        load_model_and_tokenizer(folder)
    assert str(folder / name) in str(caught.value)


@pytest.mark.parametrize("kind", ["folder", "dangling link"])
def test_a_tokenizer_json_that_is_no_file_is_named_as_such(pristine, tmp_path, kind):
    folder = copy_of(pristine, "llama", tmp_path)
    if kind == "folder":
        (folder / "tokenizer.json").mkdir()
    else:
        (folder / "tokenizer.json").symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(ValueError, match="tokenizer.json is a (folder|link to nothing), not a tokenizer file"):
        load_model_and_tokenizer(folder)
