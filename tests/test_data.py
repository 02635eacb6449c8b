"""Tests for llmscratch.text.data and llmscratch.text.corpus: sliding windows, dataloaders, token files, random-window
batches."""

import io
import itertools
import json
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest
import tiktoken
import torch

from llmscratch.assets import read_moby_dick
from llmscratch.text import corpus
from llmscratch.text.corpus import check_token_ids, load_token_meta, load_token_split, prepare_token_files
from llmscratch.text.data import RandomWindowBatches, SlidingWindowDataset, create_dataloader, split_text
from llmscratch.text.tokenizer import ENDOFTEXT, gpt2_encoding, load_gpt2_ranks

# GPT-4's (cl100k) pre-tokenizer: the block cutting must be exact for it too.
CL100K_SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)


@pytest.fixture(scope="module")
def gpt2():
    return gpt2_encoding()


@pytest.fixture(scope="module")
def gpt2_ranks_cl100k_split():
    """GPT-2's merges behind GPT-4's pre-tokenizer."""
    return tiktoken.Encoding(
        name="gpt2-ranks-cl100k-split",
        pat_str=CL100K_SPLIT_PATTERN,
        mergeable_ranks=load_gpt2_ranks(),
        special_tokens={ENDOFTEXT: 50256},
    )


@pytest.fixture(scope="module")
def moby_dick():
    return read_moby_dick()


class FakeTokenizer:
    """One id per character, shifted past 65,535 so that only uint32 can hold them."""

    n_vocab = 70_000
    offset = 66_000

    def encode(self, text, allowed_special=()):
        return [self.offset + ord(char) for char in text]


# --- Sliding windows -------------------------------------------------------------------


def brute_force_starts(n_tokens, max_length, stride):
    """Every multiple of stride whose window and its one-token-later target fit."""
    return [s for s in range(0, n_tokens, stride) if s + max_length + 1 <= n_tokens]


@pytest.mark.parametrize(
    "n_tokens, max_length, stride",
    [(n, m, s) for n, m, s in itertools.product(range(2, 16), range(1, 6), range(1, 7)) if n >= m + 1],
)
def test_window_count_and_content_match_brute_force(n_tokens, max_length, stride):
    token_ids = list(range(100, 100 + n_tokens))
    dataset = SlidingWindowDataset(token_ids, max_length, stride)
    starts = brute_force_starts(n_tokens, max_length, stride)
    assert len(dataset) == len(starts)
    for index, start in enumerate(starts):
        inputs, targets = dataset[index]
        assert inputs.tolist() == token_ids[start : start + max_length]
        assert targets.tolist() == token_ids[start + 1 : start + max_length + 1]
    with pytest.raises(IndexError):
        dataset[len(starts)]


@pytest.mark.parametrize(
    "n_tokens, max_length, stride, expected",
    [(5, 4, 1, 1), (5, 4, 100, 1), (6, 4, 1, 2), (8, 4, 4, 1), (9, 4, 4, 2), (1001, 10, 10, 100)],
)
def test_window_count_at_edges(n_tokens, max_length, stride, expected):
    assert len(SlidingWindowDataset(list(range(n_tokens)), max_length, stride)) == expected


def test_last_window_has_full_target():
    dataset = SlidingWindowDataset(list(range(9)), max_length=4, stride=4)
    inputs, targets = dataset[len(dataset) - 1]
    assert inputs.tolist() == [4, 5, 6, 7]
    assert targets.tolist() == [5, 6, 7, 8]


# --- Dataloader ------------------------------------------------------------------------


def test_dataloader_batches_are_shifted_windows_of_the_text(gpt2, moby_dick):
    text = moby_dick[:5_000]
    loader = create_dataloader(text, gpt2, batch_size=4, max_length=16, stride=16, shuffle=False)
    token_ids = gpt2.encode(text)
    inputs, targets = next(iter(loader))
    assert inputs.shape == targets.shape == (4, 16)
    assert inputs.dtype == targets.dtype == torch.long
    assert inputs[1].tolist() == token_ids[16:32]
    assert targets[1].tolist() == token_ids[17:33]


@pytest.mark.parametrize("drop_last", [True, False])
def test_dataloader_drop_last(gpt2, moby_dick, drop_last):
    text = moby_dick[:3_000]
    loader = create_dataloader(text, gpt2, batch_size=5, max_length=8, stride=8, drop_last=drop_last)
    n_windows = len(loader.dataset)
    assert n_windows % 5 != 0, "the text must leave a partial last batch for this test to mean anything"
    sizes = [len(inputs) for inputs, _ in loader]
    if drop_last:
        assert sizes == [5] * (n_windows // 5)
    else:
        assert sizes == [5] * (n_windows // 5) + [n_windows % 5]


def epoch_order(loader):
    """The dataset's windows in the order the loader gives them, as lists of ids."""
    return [window.tolist() for inputs, _ in loader for window in inputs]


def test_dataloader_shuffle_is_seeded(gpt2, moby_dick):
    text = moby_dick[:3_000]

    def loader(seed, shuffle=True, num_workers=0):
        return create_dataloader(
            text, gpt2, batch_size=4, max_length=8, stride=8,
            shuffle=shuffle, seed=seed, num_workers=num_workers,
        )

    dataset = loader(0).dataset
    all_windows = [dataset[index][0].tolist() for index in range(len(dataset))]
    unshuffled = epoch_order(loader(0, shuffle=False))
    assert unshuffled == all_windows[: len(unshuffled)]
    first = epoch_order(loader(0))
    assert first == epoch_order(loader(0))
    assert first != epoch_order(loader(1))
    assert first != unshuffled
    # A shuffled epoch still gives distinct windows of the dataset.
    assert len({tuple(window) for window in first}) == len(first) == len(unshuffled)
    assert all(window in all_windows for window in first)
    # Worker processes change where batches are built, not which ones.
    assert epoch_order(loader(0, num_workers=2)) == first


# --- Token files -----------------------------------------------------------------------


def write_documents(tmp_path, texts):
    paths = []
    for index, text in enumerate(texts):
        path = tmp_path / f"doc{index}.txt"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def read_all_tokens(folder):
    return np.concatenate([load_token_split(folder, "train"), load_token_split(folder, "val")]).tolist()


def test_prepare_round_trip_with_end_of_text_separators(tmp_path, gpt2, moby_dick):
    last = f"A short one{ENDOFTEXT} with a separator inside.\n"
    texts = [moby_dick[:20_000], moby_dick[500_000:515_000], last]
    paths = write_documents(tmp_path, texts)
    # Small blocks force many cuts inside each file.
    meta = prepare_token_files(paths, tmp_path / "tokens", gpt2, val_fraction=0.2, block_chars=2_000)

    expected = gpt2.encode(texts[0]) + [50256] + gpt2.encode(texts[1]) + [50256]
    expected += gpt2.encode(texts[2], allowed_special="all")
    assert read_all_tokens(tmp_path / "tokens") == expected
    assert meta["num_tokens"]["train"] + meta["num_tokens"]["val"] == len(expected)


def test_prepare_meta_and_val_split_is_the_tail(tmp_path, gpt2, moby_dick):
    paths = write_documents(tmp_path, [moby_dick[:8_000], moby_dick[9_000:12_000]])
    meta = prepare_token_files(paths, tmp_path / "tokens", gpt2, val_fraction=0.25)
    expected = gpt2.encode(moby_dick[:8_000]) + [50256] + gpt2.encode(moby_dick[9_000:12_000])
    n_val = round(len(expected) * 0.25)

    assert meta == load_token_meta(tmp_path / "tokens")
    assert meta == json.loads((tmp_path / "tokens" / "meta.json").read_text())
    assert meta["dtype"] == "uint16"
    assert meta["vocab_size"] == 50257
    assert meta["tokenizer"] == "gpt2"
    assert meta["eot_token"] == 50256
    assert meta["num_tokens"] == {"train": len(expected) - n_val, "val": n_val}
    assert meta["source_files"] == [str(path) for path in paths]
    train = load_token_split(tmp_path / "tokens", "train")
    val = load_token_split(tmp_path / "tokens", "val")
    assert train.dtype == val.dtype == np.uint16
    assert train.tolist() == expected[:-n_val]
    assert val.tolist() == expected[-n_val:]
    assert (tmp_path / "tokens" / "val.bin").stat().st_size == 2 * n_val


def test_prepare_again_replaces_the_token_files_and_nothing_else(tmp_path, gpt2, moby_dick):
    first, second = write_documents(tmp_path, [moby_dick[:3_000], moby_dick[5_000:6_000]])
    prepare_token_files(first, tmp_path / "tokens", gpt2)
    (tmp_path / "tokens" / "notes.txt").write_text("kept")
    meta = prepare_token_files(second, tmp_path / "tokens", gpt2, val_fraction=0.5)
    assert read_all_tokens(tmp_path / "tokens") == gpt2.encode(moby_dick[5_000:6_000])
    assert meta == load_token_meta(tmp_path / "tokens") and meta["source_files"] == [str(second)]
    assert sorted(p.name for p in (tmp_path / "tokens").iterdir()) == ["meta.json", "notes.txt", "train.bin",
                                                                       "val.bin"]  # no work folder left


SLOW_PREPARE = """
import sys, time
from llmscratch.text.corpus import prepare_token_files
from llmscratch.text.tokenizer import gpt2_encoding

class Slow:  # GPT-2's encoding, a tenth of a second per block: the test has time to kill it mid-way
    def __init__(self):
        self.inner = gpt2_encoding()
        self.n_vocab, self.eot_token, self.name = self.inner.n_vocab, self.inner.eot_token, "slow"

    def encode(self, text, **kwargs):
        time.sleep(0.1)
        return self.inner.encode(text, **kwargs)

prepare_token_files(sys.argv[1], sys.argv[2], Slow(), block_chars=100)
"""


def test_a_killed_prepare_leaves_its_work_folder_and_the_next_one_deletes_it(tmp_path, gpt2, moby_dick):
    (text,) = write_documents(tmp_path, [moby_dick[:20_000]])  # 200 blocks: 20 s if left alone
    out = tmp_path / "tokens"
    worker = subprocess.Popen([sys.executable, "-c", SLOW_PREPARE, str(text), str(out)])
    try:
        deadline = time.monotonic() + 60
        while not list(out.glob(".prepare.*.tmp")) and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.05)
        (left,) = list(out.glob(".prepare.*.tmp"))  # the work folder, named after the worker's pid
        assert left.name.startswith(f".prepare.{worker.pid}.")
    finally:
        worker.kill()  # SIGKILL: no finally block of the worker runs
        worker.wait(timeout=60)
    assert left.is_dir() and not (out / "meta.json").exists()

    live = out / f".prepare.{os.getppid()}.0123abcd.tmp"  # a running process may still be writing there
    live.mkdir()
    meta = prepare_token_files(text, out, gpt2)
    assert not left.exists() and live.is_dir()
    assert sorted(p.name for p in out.iterdir()) == [live.name, "meta.json", "train.bin", "val.bin"]
    assert sum(meta["num_tokens"].values()) == len(gpt2.encode(moby_dick[:20_000]))


def test_check_token_ids_names_the_first_id_outside_the_vocabulary():
    tokens = np.array([3, 1, 9, 0, 12, 9], dtype=np.int64)
    check_token_ids(tokens, 13, "ids")  # all inside: no error
    with pytest.raises(ValueError, match="ids holds token id 9 at position 2,.* 9 ids"):
        check_token_ids(tokens, 9, "ids", block=4)
    with pytest.raises(ValueError, match="x holds token id 12 at position 4,"):
        check_token_ids(tokens, 10, "x", block=4)  # in the second block
    with pytest.raises(ValueError, match="token id -1 at position 1,"):
        check_token_ids(np.array([0, -1, 5]), 10, "signed")


def test_prepare_uses_uint32_for_a_large_vocabulary(tmp_path):
    texts = ["hello\nworld\n", "second file"]
    paths = write_documents(tmp_path, texts)
    meta = prepare_token_files(paths, tmp_path / "tokens", FakeTokenizer(), val_fraction=0.5)
    assert meta["dtype"] == "uint32"
    assert meta["tokenizer"] == "FakeTokenizer"
    assert meta["eot_token"] is None
    tokens = read_all_tokens(tmp_path / "tokens")
    # No end-of-text id: the documents are simply concatenated.
    assert tokens == [66_000 + ord(char) for char in "".join(texts)]
    assert max(tokens) > 65_535
    assert load_token_split(tmp_path / "tokens", "train").dtype == np.uint32


def random_tricky_text(seed, n_pieces=3_000):
    pieces = ["a", "word", " ", "  ", "\t", ".", "!?", "'s", " 12", "345", "é"]
    pieces += ["\n", "\n\n", "\n\n\n", " \n", "x\n"]
    rng = random.Random(seed)
    return "".join(rng.choice(pieces) for _ in range(n_pieces))


@pytest.mark.parametrize("pattern", ["gpt2", "cl100k"])
@pytest.mark.parametrize("block_chars", [1, 7, 100])
def test_prepare_blocks_encode_like_the_whole_text(tmp_path, request, pattern, block_chars):
    encoding = request.getfixturevalue("gpt2" if pattern == "gpt2" else "gpt2_ranks_cl100k_split")
    text = random_tricky_text(seed=block_chars)
    paths = write_documents(tmp_path, [text])
    prepare_token_files(paths, tmp_path / "tokens", encoding, block_chars=block_chars)
    assert read_all_tokens(tmp_path / "tokens") == encoding.encode(text)


# --- Random-window batches -------------------------------------------------------------


def test_random_windows_shapes_and_content():
    tokens = np.arange(1_000, 1_012, dtype=np.uint16)  # each id tells its position
    batches = RandomWindowBatches(tokens, batch_size=8, context_length=4, seed=0)
    starts = set()
    for _ in range(50):
        x, y = next(batches)
        assert x.shape == y.shape == (8, 4)
        assert x.dtype == y.dtype == torch.long
        assert torch.equal(y, x + 1)  # consecutive ids: y is x shifted by one
        starts.update((x[:, 0] - 1_000).tolist())
    # Every start from 0 to the last with a full target (12 - 4 - 1 = 7), and no other.
    assert starts == set(range(8))


def test_random_windows_come_from_the_token_file(tmp_path, gpt2, moby_dick):
    paths = write_documents(tmp_path, [moby_dick[:10_000]])
    prepare_token_files(paths, tmp_path / "tokens", gpt2)
    train = load_token_split(tmp_path / "tokens", "train")
    token_ids = train.tolist()
    x, y = next(RandomWindowBatches(train, batch_size=4, context_length=32, seed=3))
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        window = row_x + row_y[-1:]
        assert row_y == window[1:]
        assert any(token_ids[s : s + 33] == window for s in range(len(token_ids) - 32))


def take(batches, n):
    return [torch.cat(next(batches)) for _ in range(n)]


def assert_same_stream(first, second):
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_random_windows_are_reproducible_per_seed_and_rank():
    tokens = np.arange(10_000, dtype=np.uint16)

    def stream(seed, rank):
        return take(RandomWindowBatches(tokens, 4, 16, seed=seed, rank=rank, world_size=4), 5)

    assert_same_stream(stream(0, 1), stream(0, 1))
    streams = [stream(seed, rank) for seed, rank in [(0, 0), (0, 1), (1, 0), (1, 1), (0, 3)]]
    for a, b in itertools.combinations(streams, 2):
        assert not torch.equal(a[0], b[0])


def test_random_windows_resume_exactly_from_state_dict():
    tokens = np.arange(5_000, dtype=np.uint16)
    uninterrupted = take(RandomWindowBatches(tokens, 4, 16, seed=7, rank=1, world_size=2), 10)

    interrupted = RandomWindowBatches(tokens, 4, 16, seed=7, rank=1, world_size=2)
    assert_same_stream(take(interrupted, 4), uninterrupted[:4])
    buffer = io.BytesIO()
    torch.save(interrupted.state_dict(), buffer)  # as a checkpoint would
    take(interrupted, 3)  # drawing on must not change the saved state

    buffer.seek(0)
    resumed = RandomWindowBatches(tokens, 4, 16, seed=7, rank=1, world_size=2)
    resumed.load_state_dict(torch.load(buffer))
    assert_same_stream(take(resumed, 6), uninterrupted[4:])


# --- Bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n_tokens, max_length, stride, message",
    [
        (10, 0, 1, "max_length must be >= 1, got 0"),
        (10, 4, 0, "stride must be >= 1, got 0"),
        (10, 4, -3, "stride must be >= 1, got -3"),
        (4, 4, 1, "got 4 tokens.*max_length=4 needs at least 5"),
        (0, 1, 1, "got 0 tokens"),
    ],
)
def test_sliding_window_bad_input(n_tokens, max_length, stride, message):
    with pytest.raises(ValueError, match=message):
        SlidingWindowDataset(list(range(n_tokens)), max_length, stride)


def test_dataloader_bad_input(gpt2):
    text = "Call me Ishmael"
    n_tokens = len(gpt2.encode(text))
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        create_dataloader(text, gpt2, batch_size=0, max_length=2, stride=1)
    with pytest.raises(ValueError, match=f"got {n_tokens} tokens.*max_length=8 needs at least 9"):
        create_dataloader(text, gpt2, max_length=8)
    n_windows = n_tokens - 2  # max_length=2, stride=1
    assert n_windows < 4
    with pytest.raises(ValueError, match=f"{n_windows} windows.*batch_size=4"):
        create_dataloader(text, gpt2, batch_size=4, max_length=2, stride=1, drop_last=True)
    assert len(create_dataloader(text, gpt2, batch_size=4, max_length=2, stride=1, drop_last=False)) == 1


def test_prepare_bad_input(tmp_path, gpt2):
    text = "Call me Ishmael. Some years ago, never mind how long precisely."
    paths = write_documents(tmp_path, [text])
    for val_fraction in (0, 1, 1.5, -0.1):
        with pytest.raises(ValueError, match=f"val_fraction .*got {val_fraction}"):
            prepare_token_files(paths, tmp_path / "out", gpt2, val_fraction=val_fraction)
    with pytest.raises(ValueError, match="paths is empty"):
        prepare_token_files([], tmp_path / "out", gpt2)
    with pytest.raises(ValueError, match=r"val_fraction=0.001 .*\d+ train and 0 val"):
        prepare_token_files(paths, tmp_path / "out", gpt2, val_fraction=0.001)
    too_small = FakeTokenizer()
    too_small.n_vocab = 100
    largest_id = FakeTokenizer.offset + max(map(ord, text))
    with pytest.raises(ValueError, match=f"token id {largest_id} .* outside the vocabulary of 100 ids"):
        prepare_token_files(paths, tmp_path / "out", too_small)


def test_the_ids_are_read_once_and_a_load_compares_the_recorded_largest(tmp_path, gpt2, monkeypatch):
    """Issue 28: prepare reads the ids (or the first load of an older folder does) and meta.json records the
    largest of each file; a load compares it with the vocabulary, and reads again only a file changed since."""
    folder, read = tmp_path / "tokens", []
    prepare_token_files(write_documents(tmp_path, [read_moby_dick()[:2_000]]), folder, gpt2)
    scan = corpus.check_token_ids

    def counted(tokens, vocab_size, source, **options):
        read.append(source.name)
        return scan(tokens, vocab_size, source, **options)

    monkeypatch.setattr(corpus, "check_token_ids", counted)
    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text())
    for split in ("train", "val"):
        assert meta["checked"][split]["largest_id"] == load_token_split(folder, split).max()
    assert read == []  # recorded by prepare: nothing read at load

    meta_path.write_text(json.dumps({key: value for key, value in meta.items() if key != "checked"}))  # older
    for split in ("train", "train", "val", "val"):
        load_token_split(folder, split)
    assert read == ["train.bin", "val.bin"]  # once each, then recorded
    assert json.loads(meta_path.read_text()) == meta

    val = np.fromfile(folder / "val.bin", dtype=np.uint16)
    val.tofile(folder / "val.bin")  # written again: the record no longer vouches for it
    load_token_split(folder, "val")
    load_token_split(folder, "val")
    assert read == ["train.bin", "val.bin", "val.bin"]

    largest = meta["checked"]["train"]["largest_id"]
    meta_path.write_text(json.dumps({**meta, "vocab_size": int(largest)}))  # a vocabulary one id too small
    with pytest.raises(ValueError, match=rf"train.bin holds token id {largest} .*meta.json.* {largest} ids"):
        load_token_split(folder, "train")
    assert read == ["train.bin", "val.bin", "val.bin"]


def test_load_token_split_bad_input(tmp_path, gpt2):
    folder = tmp_path / "tokens"
    with pytest.raises(ValueError, match=r"no .*meta.json: run prepare_token_files"):
        load_token_split(folder, "train")
    prepare_token_files(write_documents(tmp_path, [read_moby_dick()[:2_000]]), folder, gpt2)
    with pytest.raises(ValueError, match="split 'test'.*\\('train', 'val'\\)"):
        load_token_split(folder, "test")

    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text("{not json")
    with pytest.raises(ValueError, match="meta.json is corrupt"):
        load_token_split(folder, "train")
    meta_path.write_text(json.dumps({**meta, "dtype": "float32"}))
    with pytest.raises(ValueError, match="corrupt: dtype='float32'"):
        load_token_split(folder, "train")
    meta_path.write_text(json.dumps({key: value for key, value in meta.items() if key != "num_tokens"}))
    with pytest.raises(ValueError, match="corrupt.*num_tokens"):
        load_token_split(folder, "val")

    # A count that disagrees with the file size: truncated or mixed-up files.
    wrong = {**meta, "num_tokens": {**meta["num_tokens"], "val": meta["num_tokens"]["val"] + 1}}
    meta_path.write_text(json.dumps(wrong))
    n_bytes = 2 * meta["num_tokens"]["val"]
    message = f"val.bin has {n_bytes} bytes, but meta.json promises {n_bytes // 2 + 1} uint16"
    with pytest.raises(ValueError, match=message):
        load_token_split(folder, "val")


def test_random_windows_bad_input():
    tokens = np.arange(12, dtype=np.uint16)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        RandomWindowBatches(tokens, batch_size=0, context_length=4)
    with pytest.raises(ValueError, match="context_length must be >= 1, got 0"):
        RandomWindowBatches(tokens, batch_size=2, context_length=0)
    with pytest.raises(ValueError, match="context_length=12 needs at least 13 tokens .* has 12"):
        RandomWindowBatches(tokens, batch_size=2, context_length=12)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        RandomWindowBatches(tokens, batch_size=2, context_length=4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        RandomWindowBatches(tokens, batch_size=2, context_length=4, seed=-1)
    state = RandomWindowBatches(tokens, 2, 4, seed=0, rank=0, world_size=2).state_dict()
    with pytest.raises(ValueError, match="rank=0.*rank=1"):
        RandomWindowBatches(tokens, 2, 4, seed=0, rank=1, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_tokens=12.*num_tokens=11"):
        RandomWindowBatches(tokens[:11], 2, 4, seed=0, world_size=2).load_state_dict(state)


@pytest.mark.parametrize("text", ["", "a", "hello world", "Call me Ishmael. \u00e9\u00e8 " * 7])
@pytest.mark.parametrize("val_fraction", [0.0, 0.1, 0.37, 0.9])
def test_split_text_cuts_by_characters_and_loses_nothing(text, val_fraction):
    train, val = split_text(text, val_fraction)
    assert train + val == text
    assert len(val) == len(text) - int(len(text) * (1 - val_fraction))  # the last val_fraction, rounded down


@pytest.mark.parametrize("val_fraction", [-0.1, 1.0, 1.5])
def test_split_text_refuses_a_fraction_outside_0_1(val_fraction):
    with pytest.raises(ValueError, match=f"val_fraction .*\\[0, 1\\), got {val_fraction}"):
        split_text("some text", val_fraction)
