"""DPO: pair batches, response log-probabilities, the loss against float64 formulas, LoRA and full-weight training."""

import copy
import functools
import math

import pytest
import torch

from llmscratch.alignment.preference import (DPOLoss, PreferenceBatch, ReferenceModel, collate_pairs, dpo_loss,
                                             dpo_step_loss, encode_pairs, make_pair_batches, precompute_reference,
                                             preference_metrics, sequence_logprobs, validate_pairs)
from llmscratch.finetuning.config import FinetuneConfig, LoRAConfig
from llmscratch.finetuning.finetune import fit
from llmscratch.finetuning.instruct import format_prompt
from llmscratch.finetuning.lora import adapters_disabled, apply_lora, lora_layers
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.model.losses import IGNORE_INDEX
from llmscratch.text.tokenizer import BPETokenizer
from llmscratch.training.config import TrainConfig
from llmscratch.training.optim import OptimizerStep

TINY = {
    "gpt2": {"vocab_size": 97, "context_length": 32, "d_model": 32, "n_layers": 2, "n_heads": 4},
    "llama": {"vocab_size": 89, "context_length": 32, "d_model": 48, "n_layers": 3, "n_heads": 6, "n_kv_heads": 2,
              "d_ff": 80, "norm": "rmsnorm", "mlp": "swiglu", "position": "rope", "qkv_bias": False, "bias": False,
              "tie_embeddings": False},
}
CPU = torch.device("cpu")


def tiny(kind: str = "gpt2", seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**TINY[kind])).eval()


def random_pairs(vocab_size: int, lengths: list[tuple[int, int, int]], seed: int = 0) -> list:
    """(prompt, chosen, rejected) of the given lengths, random ids below the end-of-text id vocab_size - 1."""
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(vocab_size - 1, (n,), generator=generator).tolist()

    return [(ids(p), ids(c), ids(r)) for p, c, r in lengths]


LENGTHS = [(5, 3, 7), (9, 6, 2), (4, 1, 4)]  # prompt and response lengths all differ: padding is exercised


def eos(model: GPT) -> int:
    return model.config.vocab_size - 1


def rows_of(pairs: list) -> list[tuple[list[int], list[int]]]:
    """The (prompt, response) of each row of a pair batch: every chosen response, then every rejected one."""
    return [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]


def float64_logprob(model: GPT, prompt: list[int], response: list[int], eos_id: int) -> float:
    """log p(response + <|endoftext|> | prompt) of one unpadded sequence, the log-softmax in float64."""
    sequence = [*prompt, *response, eos_id]
    with torch.no_grad():
        logits = model(torch.tensor([sequence[:-1]]))[0].double()  # (L - 1, V)
    logp = torch.log_softmax(logits, dim=-1)
    return sum(logp[t, sequence[t + 1]].item() for t in range(len(prompt) - 1, len(sequence) - 1))


def stable_softplus(x: float) -> float:
    """log(1 + e^x) without overflow, in Python floats."""
    return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))


def stable_sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def base_weights(model: GPT) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" not in name}


def train_config(steps: int, lr: float) -> TrainConfig:
    return TrainConfig(max_steps=steps, warmup_steps=0, lr=lr, min_lr=lr, weight_decay=0.0, batch_size=4)


# =========================================================================== data
def test_pair_batches_hold_chosen_then_rejected_rows_with_only_the_responses_scored():
    pairs = random_pairs(97, LENGTHS)
    batch = collate_pairs(pairs, eos_id=96)
    assert batch.n_pairs == 3 and batch.reference_logprobs is None
    longest = max(p + max(c, r) + 1 for p, c, r in LENGTHS) - 1
    assert batch.inputs.shape == batch.targets.shape == (6, longest)
    for row, (prompt, response) in enumerate(rows_of(pairs)):
        sequence = [*prompt, *response, 96]
        length = len(sequence) - 1
        assert batch.inputs[row, :length].tolist() == sequence[:-1]
        assert (batch.inputs[row, length:] == 96).all()  # padded with end-of-text
        scored = batch.targets[row][batch.targets[row] != IGNORE_INDEX].tolist()
        assert scored == [*response, 96]  # the response and its end, nothing of the prompt or the padding
        assert (batch.targets[row, : len(prompt) - 1] == IGNORE_INDEX).all()
    assert len(make_pair_batches(pairs, 2, 96)) == 2
    shuffled = make_pair_batches(pairs, 3, 96, shuffle_seed=1)[0]
    assert sorted(shuffled.inputs.tolist()) == sorted(batch.inputs.tolist())


def test_encode_pairs_encodes_each_response_as_an_instruction_record():
    tokenizer = BPETokenizer.train("a b c abc " * 30, 262, special_tokens=["<|endoftext|>"])
    records = [{"instruction": "say a", "input": "", "chosen": "a", "rejected": "b c b c b c b c b c"},
               {"instruction": "say b", "input": "", "chosen": "abc", "rejected": "abc", "family": "x"}]
    pairs = encode_pairs(records, tokenizer)
    for record, (prompt, chosen, rejected) in zip(records, pairs):
        assert prompt == tokenizer.encode(format_prompt(record))
        assert (chosen, rejected) == (tokenizer.encode(record["chosen"]), tokenizer.encode(record["rejected"]))
    encode_pairs(records, tokenizer, context_length=max(len(p) + len(r) for p, _, r in pairs))  # fits exactly
    context = max(len(p) + len(c) for p, c, _ in pairs)  # every chosen response fits, not every rejected one
    too_long = [i for i, (p, _, r) in enumerate(pairs) if len(p) + len(r) > context]
    assert too_long == [0]
    with pytest.raises(ValueError, match=r"rejected responses: 1 record\(s\) do not fit .*record 0 "):
        encode_pairs(records, tokenizer, context_length=context)


# =========================================================================== log-probabilities
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_sequence_logprobs_match_each_sequence_alone_in_float64(kind):
    model = tiny(kind)
    pairs = random_pairs(model.config.vocab_size, LENGTHS)
    batch = collate_pairs(pairs, eos(model))
    with torch.no_grad():
        logprobs, counts = sequence_logprobs(model, batch.inputs, batch.targets)
    assert logprobs.dtype == torch.float32 and logprobs.shape == counts.shape == (6,)
    expected = [float64_logprob(model, prompt, response, eos(model)) for prompt, response in rows_of(pairs)]
    torch.testing.assert_close(logprobs.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert counts.tolist() == [len(response) + 1 for _, response in rows_of(pairs)]


def test_sequence_logprobs_are_summed_in_float32_under_bfloat16_autocast():
    model = tiny("gpt2")
    batch = collate_pairs(random_pairs(97, LENGTHS), 96)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        low, counts = sequence_logprobs(model, batch.inputs, batch.targets)
    with torch.no_grad():
        full, _ = sequence_logprobs(model, batch.inputs, batch.targets)
    assert low.dtype == torch.float32
    # bf16 logits carry ~3 significant digits: a few hundredths of a nat per token at most.
    assert ((low - full).abs() <= 0.05 * counts).all()


# =========================================================================== the loss
SCALED_MARGINS = [-100.0, -50.0, -3.0, -0.25, 0.0, 0.7, 4.0, 50.0, 100.0]  # beta * margin per pair


def pairs_with_scaled_margins(beta: float, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    """Policy and reference log-probabilities (B,) whose beta * margin are SCALED_MARGINS."""
    generator = torch.Generator().manual_seed(3)
    policy_rejected, reference_chosen, reference_rejected = (
        -30 * torch.rand(len(SCALED_MARGINS), generator=generator, dtype=torch.float64) for _ in range(3))
    policy_chosen = reference_chosen + (policy_rejected - reference_rejected) + torch.tensor(SCALED_MARGINS) / beta
    return tuple(t.to(dtype) for t in (policy_chosen, policy_rejected, reference_chosen, reference_rejected))


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_dpo_loss_and_its_gradient_match_float64_formulas(beta, label_smoothing):
    logprobs = [t.requires_grad_() for t in pairs_with_scaled_margins(beta)]
    loss, chosen_rewards, rejected_rewards = dpo_loss(*logprobs, beta, label_smoothing)
    loss.backward()
    policy_chosen, policy_rejected, reference_chosen, reference_rejected = ([x.item() for x in t] for t in logprobs)
    n, eps = len(SCALED_MARGINS), label_smoothing
    expected_loss, expected_grad = 0.0, []
    for pc, pr, rc, rr in zip(policy_chosen, policy_rejected, reference_chosen, reference_rejected):
        z = beta * ((pc - rc) - (pr - rr))
        expected_loss += ((1 - eps) * stable_softplus(-z) + eps * stable_softplus(z)) / n
        # d/dz of (1 - eps) softplus(-z) + eps softplus(z) = -(1 - eps) sigmoid(-z) + eps sigmoid(z)
        expected_grad.append(beta * (-(1 - eps) * stable_sigmoid(-z) + eps * stable_sigmoid(z)) / n)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12)
    grad = torch.tensor(expected_grad, dtype=torch.float64)
    for tensor, sign in zip(logprobs, (1, -1, -1, 1)):  # z rises with pc and rr, falls with pr and rc
        torch.testing.assert_close(tensor.grad, sign * grad, rtol=1e-10, atol=1e-300)
    expected_chosen = [beta * (pc - rc) for pc, rc in zip(policy_chosen, reference_chosen)]
    expected_rejected = [beta * (pr - rr) for pr, rr in zip(policy_rejected, reference_rejected)]
    torch.testing.assert_close(chosen_rewards, torch.tensor(expected_chosen, dtype=torch.float64))
    torch.testing.assert_close(rejected_rewards, torch.tensor(expected_rejected, dtype=torch.float64))
    assert not chosen_rewards.requires_grad and not rejected_rewards.requires_grad


def test_huge_margins_keep_the_float32_loss_and_gradient_finite():
    beta = 1.0
    logprobs = [t.requires_grad_() for t in pairs_with_scaled_margins(beta, torch.float32)]
    loss, _, _ = dpo_loss(*logprobs, beta)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(t.grad).all() for t in logprobs)
    # At beta * margin = -100 the loss is 100 nats and the gradient beta / B (sigmoid(100) = 1 in float32).
    assert logprobs[0].grad[0].item() == pytest.approx(-beta / len(SCALED_MARGINS), rel=1e-6)


def test_preference_metrics_match_direct_computations():
    beta = 0.3
    chosen_rewards = torch.tensor([0.5, -0.2, 0.0, 1.5])
    rejected_rewards = torch.tensor([0.1, 0.3, 0.0, -2.0])  # a win, a loss, a tie (a miss), a win
    tokens = torch.tensor([4, 7, 1, 3])
    metrics = preference_metrics(chosen_rewards, rejected_rewards, tokens, beta)
    c, r, n = chosen_rewards.tolist(), rejected_rewards.tolist(), tokens.tolist()
    expected = {"accuracy": 2 / 4, "chosen_reward": sum(c) / 4, "rejected_reward": sum(r) / 4,
                "margin": sum(x - y for x, y in zip(c, r)) / 4,
                "chosen_log_ratio_per_token": sum(x / beta for x in c) / sum(n)}
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert metrics[name].item() == pytest.approx(value, rel=1e-6, abs=1e-7), name


def test_the_step_loss_is_dpo_loss_of_sequence_logprobs():
    policy = tiny("llama", seed=1)
    reference = ReferenceModel(tiny("llama", seed=2))  # another model: policy and reference differ
    pairs = random_pairs(89, LENGTHS)
    beta = 0.5
    loss, metrics = dpo_step_loss(policy, reference, collate_pairs(pairs, eos(policy)), beta)
    expected_loss = 0.0
    for prompt, chosen, rejected in pairs:
        pc, pr = (float64_logprob(policy, prompt, y, eos(policy)) for y in (chosen, rejected))
        rc, rr = (float64_logprob(reference.model, prompt, y, eos(policy)) for y in (chosen, rejected))
        expected_loss += stable_softplus(-beta * ((pc - rc) - (pr - rr))) / len(pairs)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    assert loss.requires_grad and not any(m.requires_grad for m in metrics.values())


# =========================================================================== LoRA: the reference without a copy
def lora_policy(seed: int = 0) -> tuple[GPT, GPT]:
    """A tiny model with fresh adapters, and a copy of it from before they were applied."""
    model = tiny("gpt2", seed)
    base = copy.deepcopy(model)
    apply_lora(model, LoRAConfig(rank=4, alpha=8, targets=("*.attn.qkv", "*.mlp.*", "lm_head")))
    return model, base


def test_adapters_disabled_gives_the_base_models_logits_exactly():
    model, base = lora_policy()
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_b.normal_()  # trained-looking adapters that change the outputs
    idx = torch.randint(96, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        adapted = model(idx)
        with adapters_disabled(model):
            assert torch.equal(model(idx), base(idx))
            assert torch.equal(model(idx, targets=idx), base(idx, targets=idx))  # the chunked loss path too
        assert torch.equal(model(idx), adapted)  # switched back on
        with pytest.raises(RuntimeError, match="boom"), adapters_disabled(model):
            raise RuntimeError("boom")
        assert torch.equal(model(idx), adapted)  # back on after an error too
    assert not torch.equal(adapted, base(idx).detach())
    with pytest.raises(ValueError, match="no LoRA adapters to disable"):
        adapters_disabled(base).__enter__()


def test_fresh_adapters_make_policy_and_reference_equal():
    model, _ = lora_policy()
    reference = ReferenceModel(model)
    assert reference.shares_policy and reference.model is model  # no second copy
    model.train()
    loss, metrics = dpo_step_loss(model, reference, collate_pairs(random_pairs(97, LENGTHS), 96), beta=0.1)
    assert model.training  # the reference pass put the mode back
    assert loss.item() == torch.tensor(math.log(2)).item()  # -log sigmoid(0), to float32's last bit: no preference yet
    assert metrics["chosen_reward"].item() == metrics["rejected_reward"].item() == 0.0
    assert metrics["accuracy"].item() == 0.0  # ties count as misses


def accuracy(policy: GPT, reference: ReferenceModel, batch: PreferenceBatch, beta: float) -> float:
    with torch.no_grad():
        return dpo_step_loss(policy, reference, batch, beta)[1]["accuracy"].item()


def test_lora_dpo_raises_preference_accuracy_and_trains_only_the_adapters():
    model, _ = lora_policy(seed=4)
    before = base_weights(model)
    reference = ReferenceModel(model)
    batch = collate_pairs(random_pairs(97, [(6, 3, 4), (5, 5, 2), (7, 2, 3), (4, 4, 4)], seed=6), 96)
    beta = 0.5
    assert accuracy(model, reference, batch, beta) == 0.0
    dpo = DPOLoss(reference, beta)
    step = OptimizerStep(model, train_config(steps=8, lr=1e-2), CPU, advice="")
    model.train()
    losses = [step([batch], functools.partial(dpo, model))[0] for _ in range(8)]
    model.eval()
    assert losses[0] == pytest.approx(math.log(2), rel=1e-6) and losses[-1] < 0.5 * math.log(2)
    assert accuracy(model, reference, batch, beta) == 1.0
    after = base_weights(model)
    assert all(torch.equal(after[name], weight) for name, weight in before.items())
    assert all(torch.count_nonzero(layer.lora_b) > 0 for layer in lora_layers(model).values())
    metrics = dpo.take_metrics()
    assert metrics.keys() == {"accuracy", "chosen_reward", "rejected_reward", "margin", "chosen_log_ratio_per_token"}
    assert dpo.take_metrics() == {}  # taken: cleared


# =========================================================================== full weights: a frozen copy
@pytest.mark.slow
def test_full_weight_dpo_trains_the_policy_and_leaves_the_reference_frozen():
    policy = tiny("llama", seed=7)
    reference = ReferenceModel(policy)
    assert not reference.shares_policy and reference.model is not policy
    assert not any(p.requires_grad for p in reference.model.parameters())
    frozen = {name: p.clone() for name, p in reference.model.state_dict().items()}
    start = {name: p.clone() for name, p in policy.state_dict().items()}
    pairs = random_pairs(89, [(6, 3, 4), (5, 5, 2), (7, 2, 3), (4, 4, 4)], seed=8)
    batches = make_pair_batches(pairs, 2, eos(policy))
    beta = 0.2

    def held_loss() -> dict[str, float]:
        with torch.no_grad():
            return {"dpo": sum(dpo_step_loss(policy, reference, b, beta)[0].item() for b in batches) / len(batches)}

    config = FinetuneConfig(epochs=6, batch_size=2, lr=3e-3, weight_decay=0.0, warmup_fraction=0.0)
    history = fit(policy, lambda epoch: batches, DPOLoss(reference, beta), config, CPU, evaluate=held_loss,
                  progress=False)
    assert history[0]["val_dpo"] == pytest.approx(math.log(2), rel=1e-6)  # the copy equals the policy at first
    assert history[-1]["val_dpo"] < 0.5 * math.log(2)
    assert all(torch.equal(p, frozen[name]) for name, p in reference.model.state_dict().items())
    assert any(not torch.equal(p, start[name]) for name, p in policy.state_dict().items())


def test_precomputed_reference_logprobs_give_the_same_loss():
    policy = tiny("gpt2", seed=9)
    reference = ReferenceModel(tiny("gpt2", seed=10))
    batches = make_pair_batches(random_pairs(97, LENGTHS), 2, 96)
    precomputed = precompute_reference(reference, batches)
    for batch, ready in zip(batches, precomputed):
        assert ready.reference_logprobs.shape == (2 * batch.n_pairs,)
        live, _ = dpo_step_loss(policy, reference, batch, beta=0.3)
        cached, _ = dpo_step_loss(policy, None, ready, beta=0.3)  # no reference model needed now
        assert torch.equal(live, cached)


def test_dpo_loss_keeps_each_batchs_metrics_until_taken():
    policy, reference = tiny("gpt2", seed=13), ReferenceModel(tiny("gpt2", seed=14))
    batches = make_pair_batches(random_pairs(97, LENGTHS), 2, 96)  # two batches: 2 pairs, then 1
    dpo = DPOLoss(reference, beta=0.4)
    losses = [dpo(policy, batch) for batch in batches]
    separate = [dpo_step_loss(policy, reference, batch, 0.4) for batch in batches]
    assert all(torch.equal(loss, expected) for loss, (expected, _) in zip(losses, separate))
    taken = dpo.take_metrics()
    for name, value in taken.items():
        assert value == pytest.approx(sum(m[name].item() for _, m in separate) / 2, rel=1e-6), name
    assert dpo.take_metrics() == {}


# =========================================================================== bad input
@pytest.mark.parametrize("beta", [0, -0.1, float("nan"), float("inf"), "0.1"])
def test_beta_must_be_a_positive_finite_number(beta):
    with pytest.raises(ValueError, match=f"beta .*got {beta!r}"):
        DPOLoss(None, beta)  # checked when the loss is made (its door), not at every step


def test_bad_label_smoothing_is_a_clear_error():
    with pytest.raises(ValueError, match=r"label_smoothing .*\[0, 0.5\).*got 0.5"):
        DPOLoss(None, 0.1, label_smoothing=0.5)


def test_empty_or_missing_responses_are_clear_errors():
    good = {"instruction": "do", "input": "", "chosen": "yes", "rejected": "no"}
    with pytest.raises(ValueError, match="record 1: field 'chosen' is empty"):
        validate_pairs([good, {**good, "chosen": "  "}])
    with pytest.raises(ValueError, match="record 0: field 'rejected' is missing"):
        validate_pairs([{k: v for k, v in good.items() if k != "rejected"}])
    with pytest.raises(ValueError, match="record 0: field 'rejected' .*int 3"):
        validate_pairs([{**good, "rejected": 3}])
    with pytest.raises(ValueError, match="record 0: field 'instruction' is empty"):
        validate_pairs([{**good, "instruction": ""}])
    with pytest.raises(ValueError, match=r"pair 1: .*rejected .*\(\[\]\)"):
        collate_pairs([([1, 2], [3], [4]), ([1, 2], [3], [])], eos_id=96)
    batch = collate_pairs([([1, 2], [3], [4])], eos_id=96)
    with pytest.raises(ValueError, match="reference_logprobs .*reference model"):
        dpo_step_loss(tiny(), None, batch, 0.1)


def test_a_pair_with_equal_responses_is_allowed_and_teaches_nothing():
    policy, reference = tiny("gpt2", seed=11).train(), ReferenceModel(tiny("gpt2", seed=12))
    batch = collate_pairs([([5, 6, 7], [8, 9], [8, 9])], eos_id=96)
    loss, metrics = dpo_step_loss(policy, reference, batch, beta=1.0)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    # (The two rows of one batch may round apart by an ulp on some CPUs: a tie is checked exactly below.)
    assert metrics["chosen_reward"].item() == pytest.approx(metrics["rejected_reward"].item(), abs=1e-6)
    assert max(p.grad.abs().max().item() for p in policy.parameters() if p.grad is not None) < 1e-6
    rewards = torch.tensor([0.25, -1.0])
    tied = preference_metrics(rewards, rewards.clone(), torch.tensor([3.0, 2.0]), beta=1.0)
    assert tied["accuracy"].item() == 0.0  # a tie is not a preference
