"""Finetuning: balanced splits, padding and last-token pooling, metrics, instruction batches and answers."""

import math
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from model_fixtures import successor_model  # noqa: E402

from llmscratch.assets import read_instructions  # noqa: E402
from llmscratch.finetuning.classify import (
    Classifier,
    GPTClassifier,
    balanced_splits,
    classification_loss,
    classification_metrics,
    evaluate_classifier,
    make_batches,
    pad_batch,
    spam_splits,
)
from llmscratch.finetuning.config import (
    FinetuneConfig,  # noqa: E402
    LoRAConfig,  # noqa: E402
)
from llmscratch.finetuning.finetune import fit, load_base, set_trainable
from llmscratch.finetuning.instruct import (
    HEADER,
    Replay,
    Response,
    collate,
    comparison_table,
    encode_records,
    evaluate_responses,
    format_prompt,
    lm_loss,
    lm_loss_with_replay,
    parse_response,
    respond,
    response_loss,
    validate_records,
)
from llmscratch.finetuning.lora import apply_lora, lora_layers  # noqa: E402
from llmscratch.interrupt import TrainingDiverged  # noqa: E402
from llmscratch.model.checkpoint import export_model, save_checkpoint  # noqa: E402
from llmscratch.model.config import GPTConfig  # noqa: E402
from llmscratch.model.gpt import (
    GPT,
    count_parameters,  # noqa: E402
)
from llmscratch.model.losses import IGNORE_INDEX
from llmscratch.model.weights import save_hf  # noqa: E402
from llmscratch.text.tokenizer import BPETokenizer  # noqa: E402

TINY = {
    "gpt2": dict(vocab_size=97, context_length=32, d_model=32, n_layers=2, n_heads=4),
    "llama": dict(vocab_size=89, context_length=32, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2,
                  d_ff=80, norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False, bias=False,
                  tie_embeddings=False),
}


def tiny(kind: str, seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY[kind], **overrides}))


# =========================================================================== classification data
def toy_examples() -> list[tuple[str, int]]:
    texts = [(f"ham message {i}", 0) for i in range(50)] + [(f"spam offer {i}", 1) for i in range(20)]
    return texts + [("ham message 3", 0), ("spam offer 7", 1)]  # duplicates must not leak


def test_balanced_splits_are_balanced_disjoint_and_seeded():
    splits = balanced_splits(toy_examples(), seed=1)
    # 20 texts per class (the smaller class): 14 / 2 / 4 of each class.
    assert {name: len(split) for name, split in splits.items()} == {"train": 28, "validation": 4, "test": 8}
    for split in splits.values():
        labels = [label for _, label in split]
        assert labels.count(0) == labels.count(1)
    texts = [set(t for t, _ in split) for split in splits.values()]
    assert not (texts[0] & texts[1]) and not (texts[0] & texts[2]) and not (texts[1] & texts[2])
    assert sum(len(t) for t in texts) == sum(len(s) for s in splits.values())  # no duplicate inside a split
    assert balanced_splits(toy_examples(), seed=1) == splits
    assert balanced_splits(toy_examples(), seed=2) != splits


def test_too_few_of_a_class_is_named_before_any_split_is_empty():
    examples = [(f"ham {i}", 0) for i in range(40)] + [(f"spam {i}", 1) for i in range(9)]
    with pytest.raises(ValueError, match=r"40 ham and 9 spam .*10"):
        balanced_splits(examples, names=("ham", "spam"))
    splits = balanced_splits(examples + [("spam 9", 1)])  # ten of each: one validation example of each
    assert [sorted(label for _, label in splits[name]) for name in ("validation", "test")] == [[0, 1], [0, 0, 1, 1]]


def test_spam_splits_of_the_bundled_data():
    splits = spam_splits()
    # 4,862 messages, 4,534 distinct: 3,973 ham and 561 spam; 561 of each are kept.
    assert {name: len(split) for name, split in splits.items()} == {"train": 784, "validation": 112, "test": 226}
    for split in splits.values():
        assert sum(label for _, label in split) * 2 == len(split)
    seen = [t for split in splits.values() for t, _ in split]
    assert len(seen) == len(set(seen))


@pytest.mark.parametrize("fractions", [(0.5, 0.5), (0.7, 0.4, -0.1), (0.7, 0.2, 0.2)])
def test_bad_fractions_are_clear_errors(fractions):
    with pytest.raises(ValueError, match="fractions"):
        balanced_splits(toy_examples(), fractions)


def test_pad_batch_truncates_pads_and_records_lengths():
    ids, lengths = pad_batch([[5, 6, 7, 8, 9], [1], [2, 3]], pad_id=0, max_length=4)
    assert ids.tolist() == [[5, 6, 7, 8], [1, 0, 0, 0], [2, 3, 0, 0]]
    assert lengths.tolist() == [4, 1, 2]
    with pytest.raises(ValueError, match="at least one token"):
        pad_batch([[1], []], pad_id=0, max_length=4)


# =========================================================================== classification model
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_last_token_pooling_ignores_padding(kind):
    model = GPTClassifier(tiny(kind), n_classes=3).eval()
    short = [4, 8, 15, 16]
    with torch.no_grad():
        alone = model(torch.tensor([short]), torch.tensor([4]))  # (1, 3), no padding at all
        for pad_id in (0, 42):
            ids, lengths = pad_batch([short, list(range(1, 20)), [7]], pad_id, max_length=32)
            batched = model(ids, lengths)  # (3, 3)
            torch.testing.assert_close(batched[0], alone[0], rtol=1e-5, atol=1e-6)
        # The pooled row is the head's output at the last real token, and not at the last position.
        every_position = model.gpt(ids)  # (3, T, 3)
    assert torch.equal(batched[2], every_position[2, 0])
    assert not torch.allclose(batched[2], every_position[2, -1])


def test_classifier_head_replaces_a_tied_head_and_keeps_the_embedding():
    gpt = tiny("gpt2")
    embedding = gpt.token_embedding.weight
    model = GPTClassifier(gpt, n_classes=2)
    assert model.head.weight.shape == (2, 32)
    assert model.gpt.token_embedding.weight is embedding
    with pytest.raises(ValueError, match="n_classes"):
        GPTClassifier(tiny("gpt2"), n_classes=1)


@pytest.mark.parametrize("trainable, last_k", [("head", 1), ("last-k", 2), ("all", 1), ("lora", 1)])
def test_set_trainable_counts(trainable, last_k):
    model = GPTClassifier(tiny("llama"), n_classes=2)
    config = FinetuneConfig(trainable=trainable, last_k=last_k, lora=LoRAConfig(rank=2))
    count = set_trainable(model.gpt, config, always=[model.head])
    head = 2 * 48 + 2
    block = sum(p.numel() for p in model.gpt.blocks[-1].parameters())
    d, hidden, kv = 48, 80, 2 * 8
    expected = {
        "head": head,
        "last-k": head + 2 * block + 48,  # two blocks, the final RMSNorm's gain
        "all": count_parameters(model),
        "lora": head + 3 * 2 * ((d + d + 2 * kv) + (d + d) + 2 * (d + hidden) + (hidden + d)),
    }[trainable]
    assert count == expected == count_parameters(model, trainable_only=True)
    with pytest.raises(ValueError, match="last_k=4"):
        set_trainable(tiny("llama"), FinetuneConfig(trainable="last-k", last_k=4))


def test_training_the_head_learns_a_separable_task():
    torch.manual_seed(0)
    examples = [([1, 2, 3, 1 + (i % 7)], 0) for i in range(20)] + [([9, 8, 2, 10 + (i % 7)], 1) for i in range(20)]
    model = GPTClassifier(tiny("gpt2"), n_classes=2)
    config = FinetuneConfig(epochs=4, batch_size=8, lr=3e-2, trainable="last-k")
    set_trainable(model.gpt, config, always=[model.head])
    batches = lambda epoch: make_batches(examples, 8, pad_id=0, max_length=32, shuffle_seed=epoch)  # noqa: E731
    history = fit(model, batches, classification_loss, config, torch.device("cpu"), progress=False,
                  evaluate=lambda: evaluate_classifier(model, make_batches(examples, 16, 0, 32)))
    assert [r["epoch"] for r in history] == [0, 1, 2, 3, 4]
    assert history[-1]["val_accuracy"] == 1.0 and history[-1]["val_loss"] < history[0]["val_loss"]


def test_a_nan_loss_stops_finetuning_as_it_stops_pretraining():
    model = GPTClassifier(tiny("gpt2"), n_classes=2)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    batches = lambda epoch: make_batches([([1, 2, 3], 0), ([4, 5], 1)], 2, 0, 32)  # noqa: E731
    nan_loss = lambda model, batch: classification_loss(model, batch) * float("nan")  # noqa: E731
    with pytest.raises(TrainingDiverged, match=r"^step 1: loss nan, gradient norm nan"):
        fit(model, batches, nan_loss, FinetuneConfig(epochs=1), torch.device("cpu"), progress=False)
    assert all(torch.equal(p, before[name]) for name, p in model.state_dict().items())  # no update was made


# =========================================================================== metrics
def test_metrics_match_a_hand_computation():
    labels = [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    predictions = [1, 1, 0, 0, 1, 0, 0, 0, 0, 0]  # tp 2, fn 2, fp 1, tn 5
    m = classification_metrics(predictions, labels)
    assert m["confusion"] == [[5, 1], [2, 2]]
    assert m["accuracy"] == pytest.approx(7 / 10)
    assert m["precision"] == pytest.approx(2 / 3)
    assert m["recall"] == pytest.approx(1 / 2)
    assert m["f1"] == pytest.approx(4 / 7)  # 2PR / (P + R) = (2/3) / (7/6)
    ham = classification_metrics(predictions, labels, positive=0)
    assert (ham["precision"], ham["recall"]) == (pytest.approx(5 / 7), pytest.approx(5 / 6))


def test_macro_metrics_and_empty_ratios():
    m = classification_metrics([0, 1, 2, 2], [0, 1, 1, 2], n_classes=3, positive=None)
    # precision per class 1, 1, 1/2; recall 1, 1/2, 1: macro averages.
    assert m["precision"] == pytest.approx((1 + 1 + 0.5) / 3)
    assert m["recall"] == pytest.approx((1 + 0.5 + 1) / 3)
    assert m["f1"] == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)
    never = classification_metrics([0, 0], [0, 1])  # nothing predicted positive: precision 0/0 -> 0
    assert never["precision"] == 0.0 and never["f1"] == 0.0 and never["accuracy"] == 0.5
    with pytest.raises(ValueError, match="as many predictions"):
        classification_metrics([0], [0, 1])


def test_classifier_save_load_and_classify(tmp_path):
    tokenizer = BPETokenizer.train("free prize call now " * 20 + "see you at home " * 20, 270,
                                   special_tokens=["<|endoftext|>"])
    model = GPTClassifier(tiny("gpt2", vocab_size=tokenizer.vocab_size), n_classes=2).eval()
    classifier = Classifier(model, tokenizer, ("ham", "spam"), pad_id=tokenizer.eot_token, max_length=32)
    probs = classifier.probabilities("free prize, call now")
    assert set(probs) == {"ham", "spam"} and math.isclose(sum(probs.values()), 1.0, rel_tol=1e-6)
    classifier.save(tmp_path / "classifier.pt")
    loaded = Classifier.load(tmp_path / "classifier.pt")
    assert loaded.probabilities("free prize, call now") == pytest.approx(probs)
    home = loaded.probabilities("see you at home")
    assert loaded.classify("see you at home") == ("spam" if home["spam"] > home["ham"] else "ham")
    assert (loaded.pad_id, loaded.max_length, loaded.labels) == (tokenizer.eot_token, 32, ("ham", "spam"))


# =========================================================================== base models
def test_load_base_from_a_checkpoint_an_export_and_a_gpt2_folder(tmp_path):
    tokenizer = BPETokenizer.train("a b c abc " * 30, 262, special_tokens=["<|endoftext|>"])
    model = tiny("llama", vocab_size=tokenizer.vocab_size)
    state = {"model": model.state_dict(), "model_config": model.config.to_dict(), "tokenizer": tokenizer.to_json()}
    save_checkpoint(tmp_path / "checkpoint.pt", state)
    loaded, loaded_tokenizer = load_base(tmp_path / "checkpoint.pt")
    idx = torch.tensor([[1, 2, 3]])
    assert torch.equal(loaded(idx), model.eval()(idx))
    assert loaded_tokenizer.merges == tokenizer.merges
    export_model(model, tmp_path / "model.safetensors", tokenizer)
    loaded, loaded_tokenizer = load_base(tmp_path / "model.safetensors")
    assert torch.equal(loaded(idx), model(idx)) and loaded_tokenizer.merges == tokenizer.merges

    save_checkpoint(tmp_path / "no_tokenizer.pt", {k: v for k, v in state.items() if k != "tokenizer"})
    with pytest.raises(ValueError, match="without a tokenizer"):
        load_base(tmp_path / "no_tokenizer.pt")
    with pytest.raises(ValueError, match="no checkpoint"):
        load_base(tmp_path / "missing.pt")

    gpt2 = tiny("gpt2", vocab_size=50257, d_model=8, n_heads=2, n_layers=1)
    save_hf(gpt2, tmp_path / "hf")
    loaded, loaded_tokenizer = load_base(tmp_path / "hf")
    assert loaded_tokenizer.vocab_size == 50257 and torch.equal(loaded.eval()(idx), gpt2.eval()(idx))
    save_hf(tiny("gpt2"), tmp_path / "hf_small")
    with pytest.raises(ValueError, match="GPT-2's vocabulary"):
        load_base(tmp_path / "hf_small")


def test_load_base_takes_every_source_generate_takes(tmp_path):
    """A run folder (its export first, else its checkpoint), a Hugging Face folder or its weights file."""
    tokenizer = BPETokenizer.train("a b c abc " * 30, 262, special_tokens=["<|endoftext|>"])
    model = tiny("llama", vocab_size=tokenizer.vocab_size).eval()
    other = tiny("llama", seed=1, vocab_size=tokenizer.vocab_size).eval()
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoint.pt", {"model": other.state_dict(), "model_config": other.config.to_dict(),
                                            "tokenizer": tokenizer.to_json()})
    idx = torch.tensor([[1, 2, 3]])
    assert torch.equal(load_base(run)[0](idx), other(idx))  # the checkpoint alone
    export_model(model, run / "model.safetensors", tokenizer)
    loaded, loaded_tokenizer = load_base(run)
    assert torch.equal(loaded(idx), model(idx)) and loaded_tokenizer.merges == tokenizer.merges
    gpt2 = tiny("gpt2", vocab_size=50257, d_model=8, n_heads=2, n_layers=1).eval()
    save_hf(gpt2, tmp_path / "hf")
    loaded, loaded_tokenizer = load_base(tmp_path / "hf" / "model.safetensors")
    assert loaded_tokenizer.vocab_size == 50257 and torch.equal(loaded.eval()(idx), gpt2(idx))
    tokenizer.save(tmp_path / "tokenizer.json")
    assert load_base(run, tokenizer_path=tmp_path / "tokenizer.json")[1].merges == tokenizer.merges
    BPETokenizer.gpt2().save(tmp_path / "gpt2.json")
    with pytest.raises(ValueError, match="50,257 .*262"):
        load_base(run, tokenizer_path=tmp_path / "gpt2.json")


# =========================================================================== instruction data
def test_the_bundled_instruction_data_is_valid_and_does_not_leak():
    records = validate_records(read_instructions())
    assert len(records) >= 1000
    keys = {}
    for record in records:
        keys.setdefault((record["instruction"], record["input"]), set()).add(record["split"])
    assert all(len(splits) == 1 for splits in keys.values())
    assert len(keys) == len(records)
    families = {r["family"] for r in records}
    assert len(families) >= 10
    for split in ("train", "validation", "test"):
        assert {r["family"] for r in records if r["split"] == split} == families


@pytest.mark.parametrize("records, message", [
    ({"instruction": "x"}, "must be a list"),
    ([{"instruction": "a", "input": "", "output": "b"}, "text"], "record 1 is a str"),
    ([{"instruction": "a", "output": "b"}], "record 0: field 'input' is missing"),
    ([{"instruction": "a", "input": "", "output": "b"}, {"instruction": "a", "input": 3, "output": "b"}],
     "record 1: field 'input' must be a string, got int"),
    ([{"instruction": "a", "input": "", "output": "  "}], "record 0: field 'output' is empty"),
    ([{"instruction": "", "input": "x", "output": "y"}], "record 0: field 'instruction' is empty"),
    ([{"instruction": "a", "input": "", "output": "b", "family": None}], "record 0: field 'family' must be a string"),
])
def test_malformed_records_name_their_index_and_field(records, message):
    with pytest.raises(ValueError, match=message):
        validate_records(records)


def test_prompt_format_with_and_without_input():
    with_input = format_prompt({"instruction": "Reverse it.", "input": "a b", "output": "b a"})
    assert with_input == f"{HEADER}\n\n### Instruction:\nReverse it.\n\n### Input:\na b\n\n### Response:\n"
    without = format_prompt({"instruction": "Count to 3.", "input": "", "output": "1 2 3"})
    assert without == f"{HEADER}\n\n### Instruction:\nCount to 3.\n\n### Response:\n"


def test_collate_on_a_hand_checked_batch():
    examples = [([5, 6, 7], [8, 9]), ([5], [3])]  # (prompt, output); end-of-text is 0
    inputs, targets = collate(examples, eos_id=0)
    assert inputs.tolist() == [[5, 6, 7, 8, 9], [5, 3, 0, 0, 0]]
    assert targets.tolist() == [[6, 7, 8, 9, 0], [3, 0, -100, -100, -100]]
    inputs, targets = collate(examples, eos_id=0, pad_id=1, mask_prompt=True)
    assert inputs.tolist() == [[5, 6, 7, 8, 9], [5, 3, 1, 1, 1]]
    assert targets.tolist() == [[-100, -100, 8, 9, 0], [3, 0, -100, -100, -100]]
    inputs, targets = collate(examples, eos_id=0, mask_prompt=True, max_length=3)
    assert inputs.tolist() == [[5, 6, 7], [5, 3, 0]]
    assert targets.tolist() == [[-100, -100, 8], [3, 0, -100]]
    assert IGNORE_INDEX == -100


def test_a_row_left_without_targets_is_an_error_not_a_nan():
    examples = [([5, 6], [8]), ([5, 6, 7, 7, 7], [9])]  # the second prompt fills max_length=4
    with pytest.raises(ValueError, match=r"row 1 .* 5 tokens .*max_length=4"):
        collate(examples, eos_id=0, mask_prompt=True, max_length=4)
    inputs, targets = collate(examples, eos_id=0, mask_prompt=True, max_length=5)  # one target left: fine
    assert targets[1].tolist() == [-100, -100, -100, -100, 9]


def test_encode_records_refuses_records_that_do_not_fit_whole():
    tokenizer = BPETokenizer([], special_tokens={"<|endoftext|>": 256})  # one token per byte
    records = [{"instruction": "Say ab.", "input": "", "output": "ab"},
               {"instruction": "Say ab, please.", "input": "x" * 50, "output": "ab"}]
    prompt_0, prompt_1 = (len(format_prompt(r).encode()) for r in records)
    assert [len(p) for p, _ in encode_records(records, tokenizer, context_length=prompt_1 + 2)] == [prompt_0, prompt_1]
    with pytest.raises(ValueError, match=rf"context_length={prompt_1 + 1} .*record 1 \('Say ab, please\.'\): "
                                         rf"prompt {prompt_1} \+ output 2 \+ 1"):
        encode_records(records, tokenizer, context_length=prompt_1 + 1)  # its end-of-text would be cut


@pytest.mark.parametrize("lora_head", [False, True])
def test_lm_loss_is_the_masked_cross_entropy_of_the_logits(lora_head):
    """The model's own loss path (chunked for a plain head, through the logits for a LoRA one) is the textbook loss."""
    model = tiny("llama").eval()
    if lora_head:
        apply_lora(model, LoRAConfig(rank=2, targets=("lm_head",)))
        torch.nn.init.normal_(lora_layers(model)["lm_head"].lora_b, std=0.5)  # as if trained: B is no longer 0
    inputs, targets = collate([([5, 6, 7], [8, 9]), ([5, 11], [3, 4, 2])], eos_id=0, mask_prompt=True)
    with torch.no_grad():
        by_hand = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        assert lm_loss(model, (inputs, targets)).item() == pytest.approx(by_hand.item(), rel=1e-6)


def test_replay_draws_seeded_windows_of_the_text_and_their_next_tokens():
    tokens = list(range(1000, 1300))  # every window is then readable: consecutive numbers
    inputs, targets = Replay(tokens, windows=5, length=16, seed=3).batch()
    assert inputs.shape == targets.shape == (5, 16) and inputs.dtype == torch.long
    for row_in, row_out in zip(inputs.tolist(), targets.tolist()):
        start = row_in[0] - 1000
        assert row_in == tokens[start:start + 16] and row_out == tokens[start + 1:start + 17]  # a window, shifted by 1
    again, other = Replay(tokens, 5, 16, seed=3), Replay(tokens, 5, 16, seed=4)
    assert torch.equal(again.batch()[0], inputs) and not torch.equal(other.batch()[0], inputs)
    replay = Replay(tokens, 64, 16, seed=0)
    firsts = torch.cat([replay.batch()[0][:, 0] for _ in range(20)])
    assert firsts.min() == 1000 and firsts.max() == 1300 - 17  # the first and the last window are both drawn
    with pytest.raises(ValueError, match="the replay text has 10 tokens, fewer than a window of 16 \\+ 1"):
        Replay(list(range(10)), 2, 16, seed=0)
    with pytest.raises(ValueError, match="at least one window of one token, got 0 of 16"):
        Replay(tokens, 0, 16, seed=0)


def test_lm_loss_with_replay_adds_the_windows_loss_and_its_gradient():
    model = tiny("llama").eval()
    task = collate([([5, 6, 7], [8, 9]), ([5, 11], [3, 4, 2])], eos_id=0, mask_prompt=True)
    windows = Replay(list(range(1, 80)), windows=3, length=12, seed=0).batch()
    assert lm_loss_with_replay(model, (task, None)).item() == lm_loss(model, task).item()
    both = lm_loss_with_replay(model, (task, windows))
    with torch.no_grad():  # the windows learned as pretraining learns them: every position, no mask
        window_loss = F.cross_entropy(model(windows[0]).flatten(0, 1), windows[1].flatten())
    assert both.item() == pytest.approx(lm_loss(model, task).item() + window_loss.item(), rel=1e-6)
    both.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_response_loss_is_the_loss_on_outputs_only():
    model = tiny("gpt2").eval()
    examples = [([5, 6, 7], [8, 9]), ([5, 11], [3, 4, 2])]
    with torch.no_grad():
        terms = []
        for prompt, output in examples:
            sequence = torch.tensor([prompt + output + [0]])
            log_probs = F.log_softmax(model(sequence[:, :-1]), dim=-1)[0]  # (T, V)
            for t in range(len(prompt) - 1, sequence.size(1) - 1):  # positions that predict output + eot
                terms.append(-log_probs[t, sequence[0, t + 1]].item())
    assert response_loss(model, examples, eos_id=0, batch_size=1) == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    assert response_loss(model, examples, eos_id=0, batch_size=2) == pytest.approx(sum(terms) / len(terms), rel=1e-5)


# =========================================================================== answers
def hash_tokenizer() -> BPETokenizer:
    """Bytes, one merge "##" -> 256 and "###" -> 257, and <|endoftext|> = 258."""
    return BPETokenizer([(35, 35), (256, 35)], special_tokens={"<|endoftext|>": 258})


def chain_model(successor: dict[int, int]) -> GPT:
    """A GPT over hash_tokenizer's 259 tokens whose greedy next token is successor[last token]."""
    return successor_model(successor, vocab_size=259, context_length=256, strength=10.0)


RECORDS = [{"instruction": "Say ab.", "input": "", "output": "AB", "family": "say"},
           {"instruction": "Say ab, please.", "input": "now", "output": "ab", "family": "say"}]


def test_generation_stops_at_end_of_text_and_strips_the_template():
    tokenizer = hash_tokenizer()
    newline, a, b, eot = 10, 97, 98, 258
    responses = respond(chain_model({newline: a, a: b, b: eot}), tokenizer, RECORDS, max_new_tokens=10)
    assert responses == [Response("ab", finished=True, leaked=False)] * 2
    assert evaluate_responses(RECORDS, responses) == {"exact_match": 1.0, "well_formed": 1.0, "by_family": {"say": 1.0}}


def test_answers_never_use_the_ids_that_pad_a_models_vocabulary():
    """A model with more rows than its tokenizer has tokens (Qwen3's 151,936 for 151,669; a padded head):
    the padding ids, here the model's favourite after the prompt, are never chosen."""
    tokenizer = hash_tokenizer()
    newline, a, b, eot, padding = 10, 97, 98, 258, 300
    model = successor_model({newline: padding, a: b, b: eot}, vocab_size=320, context_length=256, strength=10.0)
    with torch.no_grad():  # a second choice after the prompt, below the padding id's logit
        model.lm_head.weight[a, 0] = 5.0
    assert respond(model, tokenizer, RECORDS[:1], max_new_tokens=10) == [Response("ab", finished=True, leaked=False)]


def test_template_leakage_and_unfinished_answers_are_caught():
    tokenizer = hash_tokenizer()
    newline, a, b, space, hashes, eot = 10, 97, 98, 32, 257, 258
    leaking = respond(chain_model({newline: a, a: b, b: space, space: hashes, hashes: eot}), tokenizer, RECORDS[:1])
    assert leaking == [Response("ab", finished=True, leaked=True)]
    endless = respond(chain_model({newline: a, a: a}), tokenizer, RECORDS[:1], max_new_tokens=5)
    assert endless == [Response("aaaaa", finished=False, leaked=False)]
    scores = evaluate_responses(RECORDS, leaking + endless)
    assert scores == {"exact_match": 0.5, "well_formed": 0.0, "by_family": {"say": 0.5}}


def test_parse_response_cuts_at_eos_and_at_the_header():
    tokenizer = hash_tokenizer()
    ids = tokenizer.encode(" a  B ") + [258] + tokenizer.encode("junk")
    assert parse_response(ids, tokenizer, 258) == Response("a  B", True, False)
    ids = tokenizer.encode("x " + HEADER)
    assert parse_response(ids, tokenizer, 258) == Response("x", False, True)


def test_exact_match_normalises_case_and_whitespace_per_family():
    records = [{"instruction": "i", "input": "", "output": "e l a h w", "family": "f1"},
               {"instruction": "i", "input": "", "output": "3", "family": "f2"},
               {"instruction": "i", "input": "", "output": "whale", "family": "f2"}]
    responses = [Response("  E  l A\nh w ", True, False), Response("4", True, False), Response("Whale", False, False)]
    scores = evaluate_responses(records, responses)
    assert scores["by_family"] == {"f1": 1.0, "f2": 0.5}
    assert scores["exact_match"] == pytest.approx(2 / 3) and scores["well_formed"] == pytest.approx(2 / 3)
    table = comparison_table({"base": {**scores, "response_loss": 2.5}, "finetuned": {**scores, "response_loss": 0.5}})
    assert "| f2 | 50% | 50% |" in table and "| held-out response loss | 2.500 | 0.500 |" in table


def test_encode_records_keeps_prompt_and_output_apart():
    tokenizer = hash_tokenizer()
    (prompt, output), = encode_records(RECORDS[1:], tokenizer)
    assert tokenizer.decode(prompt) == format_prompt(RECORDS[1]) and tokenizer.decode(output) == "ab"
    with pytest.raises(ValueError, match="record 0: field 'output' is missing"):
        encode_records([{"instruction": "x", "input": ""}], tokenizer)
