"""llmscratch.alignment.grpo: rewards, group advantages, the clipped objective, the KL estimate, pass@k, the update,
and ch06-alignment/finetune_rl.py end to end, each against an independent computation."""

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_fixtures import LATER_SHAPES, randomize
from processes import run as run_process

from llmscratch.alignment.config import GRPOConfig
from llmscratch.alignment.grpo import (Group, answer_logprobs, clipped_objective, group_advantages, grpo_loss,
                                       is_formed, kl_penalty, normalise, pass_at_k, pass_at_k_scores, reward,
                                       rollout_batch, sample_groups, train_grpo)
from llmscratch.alignment.preference import token_logprobs
from llmscratch.assets import read_instructions
from llmscratch.config import ConfigError
from llmscratch.finetuning.config import FinetuneConfig
from llmscratch.finetuning.finetune import check_trainable, set_trainable
from llmscratch.finetuning.instruct import Response, format_prompt, parse_response
from llmscratch.model.checkpoint import export_model, model_from_checkpoint
from llmscratch.model.config import GPTConfig
from llmscratch.model.generate import generate
from llmscratch.model.gpt import GPT
from llmscratch.model.losses import IGNORE_INDEX
from llmscratch.model.quantize import quantize
from llmscratch.text.tokenizer import BPETokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "ch06-alignment" / "finetune_rl.py"
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama-style model with a BPE tokenizer learned from the instruction prompts, and its file."""
    records = read_instructions()
    text = "\n".join(format_prompt(r) + r["output"] for r in records[::10])
    tokenizer = BPETokenizer.train(text, 400, special_tokens=["<|endoftext|>"])
    torch.manual_seed(0)
    config = GPTConfig.from_preset("llama-tiny", vocab_size=tokenizer.vocab_size, context_length=160, d_model=32,
                                   n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64)
    model = GPT(config).eval()
    path = tmp_path_factory.mktemp("instruction_model") / "model.safetensors"
    export_model(model, path, tokenizer)
    return model, tokenizer, path


# --------------------------------------------------------------------------- rewards
def test_the_reward_is_one_for_the_right_answer_plus_the_form_weight():
    record = {"instruction": "Reverse the order of the letters.", "input": "c a t", "output": "t a c",
              "family": "reverse_letters"}
    right = Response("t a c", finished=True, leaked=False)
    assert reward(record, right, 0.25) == 1.25
    assert reward(record, Response("T A C.", finished=True, leaked=False), 0.25) == 1.0  # right, not the form
    assert reward(record, Response("t a c", finished=False, leaked=False), 0.25) == 1.0  # never ended
    assert reward(record, Response("a c t", finished=True, leaked=False), 0.25) == 0.25  # wrong, well written
    assert reward(record, Response("tac", finished=True, leaked=False), 0.25) == 0.0  # letters not apart
    assert not is_formed(record, Response("t a c", finished=True, leaked=True))
    assert is_formed({"instruction": "x", "input": "", "output": "y"}, Response("any text", True, False))


# --------------------------------------------------------------------------- advantages
def test_group_advantages_against_a_loop_and_zero_for_groups_that_scored_alike():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.1], [0.1, 0.1, 0.1, 0.1], [2.0, 0.0, 1.0, 1.0]])
    got = group_advantages(rewards)
    for row, values in enumerate(rewards.tolist()):
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        for col, value in enumerate(values):
            assert got[row, col].item() == pytest.approx((value - mean) / (std + 1e-4), abs=1e-6)
    assert torch.equal(got[1], torch.zeros(4))
    assert torch.allclose(group_advantages(rewards, scale=False), rewards - rewards.mean(dim=1, keepdim=True))


# --------------------------------------------------------------------------- the clipped objective
@pytest.mark.parametrize("advantage", [1.5, -0.7])
def test_the_clipped_objective_has_no_gradient_past_the_clip_in_the_advantages_direction(advantage):
    clip = 0.2
    old = torch.zeros(1, 5)
    # ratios 0.5, 0.9, 1.0, 1.1, 1.5
    logprobs = torch.log(torch.tensor([[0.5, 0.9, 1.0, 1.1, 1.5]])).requires_grad_()
    objective = clipped_objective(logprobs, old, torch.tensor([advantage]), clip)
    objective.sum().backward()
    ratio = logprobs.detach().exp()[0]
    for i, r in enumerate(ratio.tolist()):
        expected_value = min(r * advantage, min(max(r, 1 - clip), 1 + clip) * advantage)
        assert objective[0, i].item() == pytest.approx(expected_value, rel=1e-6)
        # d(r A)/d(log r) = r A where the unclipped term is the smaller, else 0
        held = (advantage > 0 and r > 1 + clip) or (advantage < 0 and r < 1 - clip)
        assert logprobs.grad[0, i].item() == pytest.approx(0.0 if held else r * advantage, abs=1e-6)


def test_the_kl_estimate_is_never_negative_and_averages_to_the_true_kl():
    generator = torch.Generator().manual_seed(0)
    policy = torch.softmax(torch.randn(6, generator=generator), dim=0).double()
    ref = torch.softmax(torch.randn(6, generator=generator), dim=0).double()
    samples = torch.multinomial(policy, 400_000, replacement=True, generator=generator)
    estimate = kl_penalty(policy.log()[samples], ref.log()[samples])
    assert (estimate >= 0).all()
    true_kl = (policy * (policy.log() - ref.log())).sum().item()
    assert estimate.mean().item() == pytest.approx(true_kl, rel=0.02)


def test_the_three_normalisations_against_loops():
    values = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    assert normalise(values, mask, "sequence", 10).item() == pytest.approx(((1 + 2 + 3) / 3 + 4 / 1) / 2)
    assert normalise(values, mask, "token", 10).item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert normalise(values, mask, "constant", 10).item() == pytest.approx((1 + 2 + 3 + 4) / (2 * 10))
    # a masked-out value never counts, whatever it is
    assert normalise(values + 100 * ~mask, mask, "token", 10).item() == pytest.approx(2.5)
    with pytest.raises(ValueError, match="'per-batch'.*sequence"):
        normalise(values, mask, "per-batch", 10)


# --------------------------------------------------------------------------- pass@k
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_right_answer(case):
    n, correct, k = case
    samples = [True] * correct + [False] * (n - correct)
    subsets = list(itertools.combinations(samples, k))
    assert pass_at_k(n, correct, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    for n, correct, k in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError, match=f"n={n}, correct={correct}, k={k}"):
            pass_at_k(n, correct, k)


# --------------------------------------------------------------------------- sampling and the batch
def test_rollout_batch_scores_exactly_the_answer_tokens(tiny):
    model, tokenizer, _ = tiny
    eos = tokenizer.eot_token
    groups = [Group({}, [5, 6, 7], [[8, eos], [9, 10, 11, 12]], [], []), Group({}, [5], [[13]], [], [])]
    inputs, targets = rollout_batch(groups, eos)
    model64 = GPT(model.config).double().eval()
    model64.load_state_dict(model.state_dict())
    with torch.no_grad():
        got = token_logprobs(model64, inputs, targets)  # (N, T)
        rows = [(g.prompt, a) for g in groups for a in g.answers]
        for i, (prompt, answer) in enumerate(rows):
            alone = torch.log_softmax(model64(torch.tensor([prompt + answer]))[0], dim=-1)  # (T, V)
            expected = sum(alone[len(prompt) - 1 + j, token].item() for j, token in enumerate(answer))
            assert got[i].sum().item() == pytest.approx(expected, abs=1e-9)
            assert (targets[i] != IGNORE_INDEX).sum().item() == len(answer)


def test_answer_logprobs_equal_the_plain_rows_in_value_and_gradient(tiny):
    model, tokenizer, _ = tiny
    eos = tokenizer.eot_token
    groups = [Group({}, [5, 6, 7], [[8, eos], [9, 10, 11, 12], [30]], [], []),
              Group({}, [40, 41, 42], [[13], [14, 15], [16, eos]], [], []),  # a prompt of the first's length
              Group({}, [5], [[17, 18, 19, 20, 21, eos], [22], [23, eos]], [], []),
              Group({}, [50, 51], [[24, eos], [25, eos]], [], [])]  # fewer answers
    model64 = GPT(model.config).double().eval()
    model64.load_state_dict(model.state_dict())
    inputs, targets = rollout_batch(groups, eos)
    plain = token_logprobs(model64, inputs, targets)  # (N, T)
    plain_grads = torch.autograd.grad((plain * torch.arange(1.0, 1 + plain.numel()).view_as(plain).double()).sum(),
                                      list(model64.parameters()))
    fast, mask = answer_logprobs(model64, groups)  # (N, A)
    rows = [a for g in groups for a in g.answers]
    weights = torch.zeros_like(fast)
    for i, (answer, prompt) in enumerate((a, g.prompt) for g in groups for a in g.answers):
        assert mask[i].sum().item() == len(answer) and mask[i, : len(answer)].all()
        start = len(prompt) - 1
        assert torch.allclose(fast[i, : len(answer)], plain[i, start : start + len(answer)], atol=1e-12, rtol=0)
        weights[i, : len(answer)] = torch.arange(1.0, 1 + plain.numel()).view_as(plain)[i, start : start + len(answer)]
    assert len(rows) == fast.shape[0] and (fast[~mask] == 0).all()
    fast_grads = torch.autograd.grad((fast * weights).sum(), list(model64.parameters()))
    for (name, _), a, b in zip(model64.named_parameters(), plain_grads, fast_grads):
        assert (a - b).abs().max() <= 1e-12 * a.abs().max(), name


def test_answer_logprobs_of_a_sliding_window_model_equal_the_plain_rows_in_value_and_gradient():
    """Gemma-like layers of a 5-key window: the paged cache forgets the prompt blocks no window sees (a prompt of
    37 tokens spans three blocks of 16), and the answers, forked from the prompt, still score as the plain rows."""
    model = GPT(GPTConfig(**{**LATER_SHAPES["gemma"], "context_length": 64})).double()
    randomize(model, seed=3, scale=0.2)
    model.eval()
    groups = [Group({}, list(range(2, 39)), [[40, 41, 42, 43, 44, 45], [46], [47, 48, 49]], [], []),
              Group({}, [7, 8, 9], [[50, 51], [52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65]], [], [])]
    inputs, targets = rollout_batch(groups, 0)
    plain = token_logprobs(model, inputs, targets)  # (N, T)
    fast, mask = answer_logprobs(model, groups)  # (N, A)
    weights = torch.zeros_like(fast)  # (N, A)
    picked = torch.zeros_like(fast)  # (N, A): plain's answer tokens, moved to the front
    for i, (prompt, answer) in enumerate((g.prompt, a) for g in groups for a in g.answers):
        start = len(prompt) - 1
        picked[i, : len(answer)] = plain[i, start : start + len(answer)]
        weights[i, : len(answer)] = torch.arange(1.0, 1 + len(answer)) * (i + 1)
    assert torch.equal(mask, picked != 0) and torch.allclose(fast, picked, atol=1e-12, rtol=0)
    plain_grads = torch.autograd.grad((picked * weights).sum(), list(model.parameters()))
    fast_grads = torch.autograd.grad((fast * weights).sum(), list(model.parameters()))
    for (name, _), a, b in zip(model.named_parameters(), plain_grads, fast_grads):
        assert (a - b).abs().max() <= 1e-12 * a.abs().max(), name


def test_sampled_groups_end_at_the_first_end_of_text_and_repeat_with_the_seed(tiny):
    model, tokenizer, _ = tiny
    records = read_instructions()[:7]
    first = sample_groups(model, tokenizer, records, 3, 12, 1.0, torch.Generator().manual_seed(5), 0.1)
    again = sample_groups(model, tokenizer, records, 3, 12, 1.0, torch.Generator().manual_seed(5), 0.1)
    assert [g.answers for g in first] == [g.answers for g in again]
    assert [g.record for g in first] == records
    eos = tokenizer.eot_token
    for group in first:
        assert len(group.answers) == 3 and len(group.rewards) == 3
        for answer, response, value in zip(group.answers, group.responses, group.rewards):
            assert eos not in answer[:-1] and 1 <= len(answer) <= 12
            assert response.finished == (answer[-1] == eos)
            assert value == reward(group.record, response, 0.1)


def test_sampled_groups_are_the_samples_of_each_prompt_repeated_group_size_times(tiny):
    """sample_groups prefills each prompt once for its group (copied to each sample's row); the answers and rewards
    for a seed are those of ``generate`` on the prompts repeated, every row prefilled on its own, drawing from one
    generator."""
    model, tokenizer, _ = tiny
    records = read_instructions()[:7]
    groups = sample_groups(model, tokenizer, records, 3, 12, 1.0, torch.Generator().manual_seed(5), 0.1)
    eos, generator = tokenizer.eot_token, torch.Generator().manual_seed(5)
    prompts = [tokenizer.encode(format_prompt(r), disallowed_special=()) for r in records]
    answers = {}
    for length in dict.fromkeys(map(len, prompts)):  # sample_groups' batches: one per prompt length, in order
        chosen = [i for i, p in enumerate(prompts) if len(p) == length]
        idx = torch.tensor([prompts[i] for i in chosen]).repeat_interleave(3, dim=0)  # (p * 3, length)
        out = generate(model, idx, 12, temperature=1.0, eos_id=eos, generator=generator, vocab_size=tokenizer.n_vocab)
        for row, new in enumerate(out[:, length:].tolist()):
            answers.setdefault(chosen[row // 3], []).append(new[: new.index(eos) + 1] if eos in new else new)
    assert len(set(map(len, prompts))) > 1 and [g.answers for g in groups] == [answers[i] for i in range(7)]
    rewards = [[reward(r, parse_response(a, tokenizer, eos), 0.1) for a in answers[i]] for i, r in enumerate(records)]
    assert [g.rewards for g in groups] == rewards and len({a for i in answers for a in map(tuple, answers[i])}) > 7


def test_pass_at_k_scores_count_right_samples_per_family(tiny, monkeypatch):
    model, tokenizer, _ = tiny
    records = [r for r in read_instructions() if r["split"] == "test"][:26:2]
    import llmscratch.alignment.grpo as grpo

    def fake_groups(model, tokenizer, records, samples, *args, **kwargs):  # the first `i % (samples + 1)` are right
        return [Group(r, [], [[]] * samples, [Response(r["output"] if j < i % (samples + 1) else "no", True, False)
                                              for j in range(samples)], [0.0] * samples)
                for i, r in enumerate(records)]

    monkeypatch.setattr(grpo, "sample_groups", fake_groups)
    scores = pass_at_k_scores(model, tokenizer, records, 4, 8)
    assert scores["k"] == [1, 2, 3, 4]
    expected = [sum(pass_at_k(4, i % 5, k) for i in range(len(records))) / len(records) for k in range(1, 5)]
    assert scores["all"] == pytest.approx(expected)
    assert set(scores["by_family"]) == {r["family"] for r in records}


# --------------------------------------------------------------------------- the update
def test_one_update_raises_answers_above_their_groups_mean_and_lowers_the_others(tiny):
    model, tokenizer, _ = tiny
    policy = GPT(model.config)
    policy.load_state_dict(model.state_dict())
    eos = tokenizer.eot_token
    groups = [Group({}, [5, 6, 7], [[8, 9, eos], [10, eos], [11, 12, 13, eos]], [], []),
              Group({}, [20, 21], [[22, eos], [23, 24, eos], [25, eos]], [], [])]
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.1, 0.1]])
    advantages = group_advantages(rewards).flatten()
    inputs, targets = rollout_batch(groups, eos)
    mask = targets != IGNORE_INDEX
    config = GRPOConfig(max_new_tokens=4)
    with torch.no_grad():
        before = token_logprobs(policy, inputs, targets).sum(dim=-1)
    logprobs = token_logprobs(policy, inputs, targets)
    loss, stats = grpo_loss(logprobs, logprobs.detach(), advantages, mask, config)
    loss.backward()
    with torch.no_grad():
        for p in policy.parameters():
            p -= 0.05 * p.grad
        after = token_logprobs(policy, inputs, targets).sum(dim=-1)
    change = after - before
    assert (change[advantages > 0] > 0).all() and (change[advantages < 0] < 0).all(), (advantages, change)
    assert stats["clipped"] == 0.0  # a ratio of 1 is inside the clip


def test_training_is_repeatable_skips_groups_that_scored_alike_and_logs_each_round(tiny):
    model, tokenizer, _ = tiny
    records = [r for r in read_instructions() if r["split"] == "train"][:20]
    config = GRPOConfig(steps=3, prompts_per_step=3, group_size=2, max_new_tokens=6, lr=1e-3, format_weight=0.5,
                        updates_per_step=2, kl_weight=0.1, seed=7)
    weights = []
    for _ in range(2):
        policy = GPT(model.config)
        policy.load_state_dict(model.state_dict())
        history = train_grpo(policy, tokenizer, records, config, torch.device("cpu"), progress=False)
        weights.append(torch.cat([p.detach().flatten() for p in policy.parameters()]))
    assert torch.equal(weights[0], weights[1])
    assert [r["step"] for r in history] == [1, 2, 3]
    for record in history:
        assert 0 <= record["informative_groups"] <= 1 and 0 <= record["correct"] <= 1
        assert record["loss"] == 0.0 or record["informative_groups"] > 0
    untrained = torch.cat([p.detach().flatten() for p in model.parameters()])
    changed = any(r["informative_groups"] > 0 for r in history)
    assert changed == (not torch.equal(weights[0], untrained))


def test_the_config_refuses_a_group_of_one_and_an_unknown_normalisation():
    with pytest.raises(ConfigError, match="group_size must be at least 2, got 1"):
        GRPOConfig(group_size=1)
    with pytest.raises(ConfigError, match="normalisation must be one of"):
        GRPOConfig(normalisation="batch")


# --------------------------------------------------------------------------- the script
def script(*argv, timeout: float = 150) -> subprocess.CompletedProcess:
    return run_process([sys.executable, str(SCRIPT), *map(str, argv)], timeout=timeout)


def test_the_script_in_test_mode_saves_a_model_its_scores_and_the_pass_at_k_curves(tiny, tmp_path):
    _, _, path = tiny
    out = tmp_path / "rl"
    result = script("--model", path, "--out-dir", out, "--test-mode", "--no-progress", "--lr", "1e-3")
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"saved {out}/: metrics.json, rl.png, comparison.md, answers.jsonl, model.safetensors" in result.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["history"]) == 2
    for name in ("instruction_model", "rl"):
        assert metrics[name]["pass_at_k"]["k"] == [1, 2]
        assert metrics[name]["bits_per_byte"] > 0
    table = (out / "comparison.md").read_text()
    assert "pass@1" in table and "bits per byte, held-out Moby-Dick" in table
    model = model_from_checkpoint(out / "model.safetensors")
    assert model.config == tiny[0].config


@pytest.mark.parametrize("flags, message", [
    (["--group-size", "1"], "--group-size must be at least 2, got 1"),
    (["--normalisation", "batch"], "invalid choice: 'batch'"),
    (["--pass-samples", "-1"], "--pass-samples must be 0 (skip) or more, got -1"),
    (["--model", "no/such/model.safetensors"], "--model no/such/model.safetensors: no such file"),
])
def test_the_script_names_a_bad_flag(flags, message, tmp_path):
    result = script(*flags, "--out-dir", tmp_path / "out", timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.parametrize("trainable", ["all", "last-k", "head", "lora"])
def test_a_quantized_model_is_refused_for_finetuning_whatever_trains(tiny, trainable):
    # Its integer weights are buffers: "trainable all" trained the embedding and the norms alone, and said "all".
    for scheme in ("int8", "int4"):
        quantized = quantize(tiny[0], scheme, group_size=16)
        for check in (check_trainable, set_trainable):
            with pytest.raises(ValueError, match=rf"the model is quantized \({scheme} weights.*finetune the float "
                                                 rf"model it was made from"):
                check(quantized, FinetuneConfig(trainable=trainable, last_k=1))


def test_the_script_refuses_a_quantized_model_before_training(tiny, tmp_path):
    quantized = tmp_path / "int8.safetensors"
    export_model(quantize(tiny[0], "int8"), quantized, tiny[1])
    result = script("--model", quantized, "--out-dir", tmp_path / "rl", "--test-mode", "--no-progress",
                    "--pass-samples", "0", timeout=120)
    assert result.returncode == 1, result.stderr[-4000:]
    assert "error: the model is quantized (int8 weights)" in result.stderr and "Traceback" not in result.stderr
    assert "trainable" not in result.stdout and not (tmp_path / "rl" / "model.safetensors").exists()


def test_the_script_explains_its_flags():
    result = script("--help", timeout=60)
    assert result.returncode == 0
    for flag in ("--group-size", "--clip", "--kl-weight", "--normalisation", "--no-scale-advantages", "--test-mode"):
        assert flag in result.stdout
