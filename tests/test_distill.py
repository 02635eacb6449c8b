"""Knowledge distillation (llmscratch.deployment.distill): the loss against float64 sums, the trainer against the plain
Trainer and a hand-computed first step, the bundled teacher distilled for a few steps, and ch07's script."""

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_fixtures import randomize
from processes import run as run_process

from benchmarks.bench_distill import comparison, markdown, spread
from llmscratch.assets import PRETRAINED_PATH, read_moby_dick
from llmscratch.config import ConfigError
from llmscratch.deployment.distill import (STUDENT_SHAPE, DistillationTrainer, DistillConfig, distillation_loss,
                                           student_config, teacher_agreement, text_splits, train_student)
from llmscratch.model.checkpoint import model_from_checkpoint, tokenizer_from_checkpoint
from llmscratch.model.gpt import GPT
from llmscratch.model.losses import IGNORE_INDEX
from llmscratch.text.data import RandomWindowBatches, split_text
from llmscratch.training.config import TrainConfig
from llmscratch.training.train import Trainer

SCRIPT = Path(__file__).resolve().parents[1] / "ch07-deployment" / "distill.py"
TINY = {"n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64, "context_length": 32}


# --------------------------------------------------------------------------- the loss
def reference_loss(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, temperature: float,
                   alpha: float) -> float:
    """The loss in float64 with explicit sums, token by token."""
    student, teacher = student.double().flatten(0, -2), teacher.double().flatten(0, -2)  # (N, V)
    kl_sum = ce_sum = 0.0
    counted = 0
    for s, t, target in zip(student, teacher, targets.flatten().tolist()):
        if target == IGNORE_INDEX:
            continue
        counted += 1
        p = torch.exp(t / temperature) / torch.exp(t / temperature).sum()
        q = torch.exp(s / temperature) / torch.exp(s / temperature).sum()
        kl_sum += (p * (p.log() - q.log())).sum().item()
        ce_sum += -(s[target] - torch.log(torch.exp(s).sum())).item()
    return alpha * temperature**2 * kl_sum / counted + (1 - alpha) * ce_sum / counted


def random_case(seed: int, shape=(2, 3), vocab: int = 7, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    student = 2 * torch.randn(*shape, vocab, generator=generator, dtype=dtype)
    teacher = 2 * torch.randn(*shape, vocab, generator=generator, dtype=dtype)
    targets = torch.randint(vocab, shape, generator=generator)
    targets.view(-1)[1] = IGNORE_INDEX  # one position that counts in neither term
    return student, teacher, targets


@pytest.mark.parametrize("temperature, alpha", [(1.0, 0.5), (2.0, 0.5), (4.0, 0.9), (0.5, 0.25), (3.0, 1.0)])
def test_loss_matches_explicit_float64_sums(temperature, alpha):
    student, teacher, targets = random_case(seed=int(10 * temperature))
    loss = distillation_loss(student, teacher, targets, temperature, alpha)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert loss.item() == pytest.approx(reference_loss(student, teacher, targets, temperature, alpha), rel=1e-5)


def test_kl_term_matches_f_kl_div_with_probability_targets():
    student, teacher, targets = random_case(seed=3, shape=(4, 5), vocab=11)
    targets.fill_(0)  # every position counts: "batchmean" over the (N, V) rows is then the mean per token
    temperature = 3.0
    log_q = F.log_softmax(student.double().flatten(0, 1) / temperature, dim=-1)
    p = F.softmax(teacher.double().flatten(0, 1) / temperature, dim=-1)
    expected = temperature**2 * F.kl_div(log_q, p, reduction="batchmean")  # target given as probabilities
    assert distillation_loss(student, teacher, targets, temperature, alpha=1.0).item() == pytest.approx(
        expected.item(), rel=1e-5)


def test_alpha_zero_is_exactly_cross_entropy():
    student, teacher, targets = random_case(seed=4)
    loss = distillation_loss(student, teacher, targets, temperature=2.0, alpha=0.0)
    assert torch.equal(loss, F.cross_entropy(student.flatten(0, 1), targets.flatten()))


def test_alpha_one_at_temperature_one_is_the_kl():
    student, teacher, targets = random_case(seed=5)
    targets.fill_(2)
    expected = F.kl_div(F.log_softmax(student.flatten(0, 1), -1), F.log_softmax(teacher.flatten(0, 1), -1),
                        log_target=True, reduction="batchmean")
    torch.testing.assert_close(distillation_loss(student, teacher, targets, temperature=1.0, alpha=1.0), expected)


def test_same_distributions_leave_only_the_cross_entropy_term():
    student, _, targets = random_case(seed=6)
    loss = distillation_loss(student, student.clone(), targets, temperature=2.0, alpha=0.3)
    expected = 0.7 * F.cross_entropy(student.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, expected)


def test_bfloat16_logits_are_summed_in_float32():
    student, teacher, targets = random_case(seed=7)
    loss = distillation_loss(student.bfloat16(), teacher.bfloat16(), targets, 2.0, 0.5)
    assert loss.dtype == torch.float32
    expected = reference_loss(student.bfloat16().float(), teacher.bfloat16().float(), targets, 2.0, 0.5)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_gradient_matches_finite_differences_in_float64():
    student, teacher, targets = random_case(seed=8, shape=(2, 2), vocab=5, dtype=torch.float64)
    student.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda s: distillation_loss(s, teacher, targets, 1.7, 0.3), (student,))


def test_gradient_with_respect_to_a_student_logit():
    """Hinton et al.'s (q_T - p_T) / T, times alpha * T^2, plus (1 - alpha)(softmax - one-hot); per counted token."""
    student, teacher, targets = random_case(seed=9, shape=(1, 3), vocab=6, dtype=torch.float64)
    targets[0, 1] = 4  # all three count
    student.requires_grad_(True)
    temperature, alpha = 2.5, 0.4
    distillation_loss(student, teacher, targets, temperature, alpha).backward()
    q_t, p_t = F.softmax(student.detach() / temperature, -1), F.softmax(teacher / temperature, -1)
    one_hot = F.one_hot(targets, 6).double()
    expected = (alpha * temperature * (q_t - p_t) + (1 - alpha) * (F.softmax(student.detach(), -1) - one_hot)) / 3
    torch.testing.assert_close(student.grad, expected)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 0.0}, "temperature must be a positive finite number, got 0.0"),
    ({"temperature": -1.0}, "temperature must be a positive finite number, got -1.0"),
    ({"temperature": math.inf}, "temperature must be a positive finite number, got inf"),
    ({"temperature": math.nan}, "temperature must be a positive finite number, got nan"),
    ({"alpha": -0.1}, r"alpha must be in \[0, 1\], got -0.1"),
    ({"alpha": 1.5}, r"alpha must be in \[0, 1\], got 1.5"),
])
def test_bad_temperature_or_alpha_is_named(kwargs, message):
    student, teacher, targets = random_case(seed=10)
    with pytest.raises(ValueError, match=message):
        distillation_loss(student, teacher, targets, **{"temperature": 2.0, "alpha": 0.5, **kwargs})


def test_shape_and_vocabulary_mismatches_are_named():
    student, teacher, targets = random_case(seed=11)
    with pytest.raises(ValueError, match="the student has 7 logits per token and the teacher 9"):
        distillation_loss(student, torch.zeros(2, 3, 9), targets, 2.0, 0.5)
    with pytest.raises(ValueError, match=r"student logits \(2, 3, 7\) and teacher logits \(3, 2, 7\)"):
        distillation_loss(student, teacher.transpose(0, 1), targets, 2.0, 0.5)
    with pytest.raises(ValueError, match=r"targets \(6,\) must have the logits' shape without the vocabulary, "
                                         r"\(2, 3\)"):
        distillation_loss(student, teacher, targets.flatten(), 2.0, 0.5)


@pytest.mark.parametrize("field, value, message", [
    ("temperature", 0.0, "temperature must be positive, got 0.0"),
    ("alpha", 1.01, r"alpha must be in \[0, 1\], got 1.01"),
])
def test_distill_config_refuses_bad_values(field, value, message):
    with pytest.raises(ConfigError, match=message):
        DistillConfig(**{field: value})


# --------------------------------------------------------------------------- the student and the trainer
@pytest.fixture(scope="module")
def teacher() -> GPT:
    return model_from_checkpoint(PRETRAINED_PATH).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizer_from_checkpoint(PRETRAINED_PATH)


@pytest.fixture(scope="module")
def splits(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """A short text's tokens, split 90/10 by characters as the script splits Moby-Dick."""
    return text_splits(tokenizer, read_moby_dick()[:40_000])


def tiny_train_config(steps: int, seed: int = 0, lr: float = 1e-2) -> TrainConfig:
    return TrainConfig(max_steps=steps, batch_size=4, lr=lr, min_lr=lr / 10, warmup_steps=1, eval_interval=steps,
                       eval_tokens=33, final_eval_tokens=4 * 32 + 1, checkpoint_interval=steps, sample_interval=steps,
                       sample_tokens=2, log_interval=steps, seed=seed, peak_tflops=1.0)


def test_student_config_keeps_the_teachers_vocabulary_and_architecture(teacher):
    config = student_config(teacher.config)
    for name, value in STUDENT_SHAPE.items():
        assert getattr(config, name) == value
    for name in ("vocab_size", "context_length", "norm", "mlp", "position", "tie_embeddings"):
        assert getattr(config, name) == getattr(teacher.config, name)
    assert student_config(teacher.config, n_layers=3).n_layers == 3
    with pytest.raises(ValueError, match="d_model=100 is not divisible by n_heads=3"):
        student_config(teacher.config, d_model=100, n_heads=3)


def test_text_splits_cut_by_characters(tokenizer):
    text = read_moby_dick()[:5_000]
    train, val = text_splits(tokenizer, text, val_fraction=0.2)
    train_text, val_text = split_text(text, 0.2)
    assert tokenizer.decode(train.tolist()) == train_text and tokenizer.decode(val.tolist()) == val_text
    assert train.dtype == np.uint16


def test_trainer_refuses_a_teacher_of_another_vocabulary_or_shorter_context(teacher, tokenizer, splits, tmp_path):
    config = tiny_train_config(1)
    other = GPT(student_config(teacher.config, **TINY, vocab_size=4160))
    with pytest.raises(ValueError, match="the student's vocabulary has 4160 ids and the teacher's 4096"):
        DistillationTrainer(other, teacher, config, *splits, tmp_path, tokenizer)
    long = GPT(student_config(teacher.config, **{**TINY, "context_length": 512}))
    with pytest.raises(ValueError, match="the student's context_length 512 is longer than the teacher's 256"):
        DistillationTrainer(long, teacher, config, *splits, tmp_path, tokenizer)


def test_alpha_zero_is_exactly_the_plain_trainer_and_never_runs_the_teacher(teacher, tokenizer, splits, tmp_path):
    config, shape = tiny_train_config(3), student_config(teacher.config, **TINY)
    calls = []
    hook = teacher.register_forward_hook(lambda *args: calls.append(1))
    try:
        distilled, _ = train_student(shape, teacher, tokenizer, *splits, config, DistillConfig(alpha=0.0),
                                     tmp_path / "alpha0")
    finally:
        hook.remove()
    torch.manual_seed(config.seed)
    plain = Trainer(GPT(shape), config, *splits, tmp_path / "plain", tokenizer)
    plain.fit(progress=False)
    assert not calls
    for (name, a), b in zip(distilled.state_dict().items(), plain.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_first_step_loss_is_the_distillation_loss_of_the_first_batch(teacher, tokenizer, splits, tmp_path):
    """The trainer's logged loss of step 1 against the loss computed by hand on the same weights and windows."""
    config, shape = tiny_train_config(1, seed=5), student_config(teacher.config, **TINY)
    torch.manual_seed(config.seed)
    student = GPT(shape)
    inputs, targets = next(RandomWindowBatches(splits[0], config.batch_size, shape.context_length, seed=config.seed))
    with torch.no_grad():
        expected = reference_loss(student(inputs), teacher(inputs), targets, 3.0, 0.7)
    trainer = DistillationTrainer(student, teacher, config, *splits, tmp_path, tokenizer, DistillConfig(3.0, 0.7))
    trainer.fit(progress=False)
    assert trainer.history[0]["loss"] == pytest.approx(expected, rel=1e-4)


def test_teacher_gets_no_gradient_and_keeps_its_weights(tokenizer, splits, tmp_path, teacher):
    own_teacher = GPT(student_config(teacher.config, **{**TINY, "n_layers": 2}))
    randomize(own_teacher, seed=1, scale=0.2)
    before = {name: p.clone() for name, p in own_teacher.state_dict().items()}
    shape = student_config(teacher.config, **TINY)
    student, _ = train_student(shape, own_teacher, tokenizer, *splits, tiny_train_config(3), DistillConfig(), tmp_path)
    assert all(p.grad is None for p in own_teacher.parameters())
    for name, p in own_teacher.state_dict().items():
        assert torch.equal(p, before[name]), name
    torch.manual_seed(0)
    assert not torch.equal(student.token_embedding.weight, GPT(shape).token_embedding.weight)  # the student learned


def test_distilled_student_moves_towards_the_teacher(teacher, tokenizer, splits, tmp_path):
    """A few steps of pure distillation bring the student's distributions closer to the bundled teacher's on
    held-out text, and closer than the same steps from scratch do."""
    shape, config = student_config(teacher.config, **TINY), tiny_train_config(12, lr=2e-2)
    torch.manual_seed(config.seed)
    before = teacher_agreement(GPT(shape), teacher, splits[1], max_tokens=8 * 32)
    distilled, summary = train_student(shape, teacher, tokenizer, *splits, config, DistillConfig(1.0, 1.0),
                                       tmp_path / "distilled")
    scratch, _ = train_student(shape, None, tokenizer, *splits, config, DistillConfig(1.0, 0.0), tmp_path / "scratch")
    after = teacher_agreement(distilled, teacher, splits[1], max_tokens=8 * 32)
    from_scratch = teacher_agreement(scratch, teacher, splits[1], max_tokens=8 * 32)
    assert after["kl"] < 0.8 * before["kl"]
    assert after["kl"] < from_scratch["kl"]
    assert after["acceptance"] > before["acceptance"]
    assert summary["steps"] == 12 and summary["wall_seconds"] >= summary["train_seconds"] > 0


def test_teacher_agreement_against_direct_sums(teacher):
    """A model against itself agrees fully; two models against sums over their full logits, one window at a time."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(4096, (3 * 32 + 5,), generator=generator).numpy().astype(np.uint16)
    student = GPT(student_config(teacher.config, **TINY))
    randomize(student, seed=2, scale=0.3)
    same = teacher_agreement(student, student, tokens, batch_size=2)
    assert same["kl"] == pytest.approx(0.0, abs=1e-6) and same["acceptance"] == pytest.approx(1.0)
    assert same["top1_agreement"] == 1.0
    kl = overlap = agree = 0.0
    with torch.no_grad():
        for w in range(3):  # the 5 tokens past the last whole window are left out
            ids = torch.from_numpy(tokens[w * 32 : (w + 1) * 32].astype(np.int64))[None]
            p, q = F.softmax(teacher(ids)[0].double(), -1), F.softmax(student(ids)[0].double(), -1)  # (T, V)
            kl += (p * (p.log() - q.log())).sum().item()
            overlap += torch.minimum(p, q).sum().item()
            agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
    found = teacher_agreement(student, teacher, tokens, batch_size=2)
    assert found["kl"] == pytest.approx(kl / 96, rel=1e-4)
    assert found["acceptance"] == pytest.approx(overlap / 96, rel=1e-4)
    assert found["top1_agreement"] == agree / 96
    with pytest.raises(ValueError, match="at least one window of 32 tokens, got 31"):
        teacher_agreement(student, teacher, tokens[:31])


# --------------------------------------------------------------------------- the script
def script(*argv, cwd: Path | None = None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a small run: no thread pool to fight the other tests for
    return run_process([sys.executable, str(SCRIPT), *map(str, argv)], timeout=240, cwd=cwd, env=env)


def test_help_explains_every_flag():
    result = script("--help")
    assert result.returncode == 0, result.stderr
    for flag in ("--teacher", "--n-layers", "--d-model", "--n-heads", "--n-kv-heads", "--d-ff", "--temperature",
                 "--alpha", "--max-steps", "--batch-size", "--lr", "--warmup-steps", "--seed", "--dtype", "--device",
                 "--out-dir", "--overwrite", "--no-progress", "--test-mode"):
        assert flag in result.stdout


@pytest.mark.parametrize("flags, message", [
    (("--alpha", "2"), r"--alpha must be in \[0, 1\], got 2.0"),
    (("--temperature", "0"), "--temperature must be positive, got 0.0"),
    (("--d-model", "100", "--n-heads", "3"), "the student's shape: d_model=100 is not divisible by n_heads=3"),
    (("--teacher", "missing.safetensors"), "--teacher missing.safetensors: no such file or folder"),
])
def test_bad_flags_are_refused_before_any_work(flags, message, tmp_path):
    result = script(*flags, "--out-dir", tmp_path / "run", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert re.search(message, result.stderr), result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_test_mode_writes_a_student_that_loads(tmp_path, tokenizer):
    out = tmp_path / "run"
    result = script("--test-mode", "--no-progress", "--out-dir", out, "--seed", "3")
    assert result.returncode == 0, result.stderr[-4000:]
    student = model_from_checkpoint(out / "model.safetensors")
    for name, value in TINY.items():
        assert getattr(student.config, name) == value
    assert student.config.vocab_size == 4096
    assert tokenizer_from_checkpoint(out / "model.safetensors").to_json() == tokenizer.to_json()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["alpha"] == 1.0 and summary["temperature"] == 1.0
    assert 0 < summary["teacher_acceptance"] < 1 and summary["val_bits_per_byte"] > summary["teacher_val_bits_per_byte"]
    assert "held-out" in result.stdout and "drafts accepted" in result.stdout
    again = script("--test-mode", "--no-progress", "--out-dir", out)  # the folder holds a run now
    assert again.returncode == 1 and "--overwrite" in again.stderr


# --------------------------------------------------------------------------- the benchmark
def test_benchmark_statistics_against_numpy():
    distilled, scratch = [2.40, 2.47, 2.43], [2.55, 2.50, 2.58]
    assert spread(distilled) == pytest.approx({"mean": np.mean(distilled), "std": np.std(distilled, ddof=1),
                                               "min": 2.40, "max": 2.47})
    found = comparison(distilled, scratch)
    assert found["difference"] == pytest.approx(np.mean(scratch) - np.mean(distilled))  # 0.11
    assert found["per_seed"] == pytest.approx([0.15, 0.03, 0.15])
    assert found["spread"] == pytest.approx(0.08)  # the scratch students' range, the wider one
    assert found["exceeds"] and found["ranges_apart"]  # the worst distilled 2.47 < the best from scratch 2.50
    wide = comparison([2.0, 2.3], [2.35, 2.4])  # apart, but the mean difference 0.225 is within a range of 0.3
    assert not wide["exceeds"] and wide["ranges_apart"]
    worse = comparison([2.45, 2.5], [2.4, 2.42])
    assert worse["difference"] == pytest.approx(-0.065) and not worse["exceeds"] and not worse["ranges_apart"]


@pytest.mark.slow
def test_benchmark_test_mode_prints_a_section_and_saves_the_student(tmp_path):
    root = SCRIPT.parents[1]
    result = run_process([sys.executable, "-m", "benchmarks.bench_distill", "--test-mode", "--threads", "1",
                          "--save-student", str(tmp_path / "draft"), "--json", str(tmp_path / "runs.json")],
                         timeout=300, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert result.returncode == 0, result.stderr[-4000:]
    section = result.stdout
    assert section.startswith("### Knowledge distillation")
    for arm in ("| distilled | 2 |", "| scratch, same steps | 2 |", "| scratch, same time |"):
        assert arm in section
    assert section.count("- Distilled against scratch") == 2
    runs = json.loads((tmp_path / "runs.json").read_text())["runs"]
    arms = {"distilled", "scratch, same steps", "scratch, same time"}
    assert len(runs) == 2 and all(set(seed) == arms for seed in runs)
    for seed in runs:  # every number of the table comes from these
        assert f"{seed['distilled']['bits_per_byte']:.4f}" in section and seed["scratch, same steps"]["steps"] == 2
    student = model_from_checkpoint(tmp_path / "draft" / "model.safetensors")
    assert (student.config.n_layers, student.config.d_model, student.config.context_length) == (1, 32, 32)


def test_benchmark_section_says_which_way_the_difference_goes(teacher):
    """The section's verdicts against numbers made up for it: better by more than the spread, worse by more, within."""
    args = argparse.Namespace(seeds=2, steps=10, lr=2e-3, temperature=1.0, alpha=1.0, test_mode=False)

    def run(bits: float, steps: int = 10) -> dict:
        return {"steps": steps, "bits_per_byte": bits, "train_seconds": 1.0, "kl": 1.0, "acceptance": 0.5}

    results = [{"distilled": run(2.30), "scratch, same steps": run(2.50), "scratch, same time": run(2.00, 30)},
               {"distilled": run(2.32), "scratch, same steps": run(2.52), "scratch, same time": run(2.01, 31)}]
    cost = {"distilled": 0.9, "scratch": 0.3}
    section = markdown(args, results, teacher, 1.967, student_config(teacher.config), "0.00, 0.00, 0.00", cost)
    assert "| distilled | 10 | 2.3000 / 2.3200 | 2.3100 | 0.0141 | 2.3000-2.3200 |" in section
    assert "| scratch, same time | 30 / 31 |" in section
    assert ("same steps: the distilled students score 0.2000 bits per byte lower (better) on average (from scratch "
            "minus distilled, per seed: +0.2000, +0.2000); the wider min-max spread over seeds is 0.0200: the "
            "distilled students are better by more than it; the ranges do not overlap.") in section
    assert "same time: the distilled students score 0.3050 bits per byte higher (worse)" in section
    assert "0.0200: the students from scratch are better by more than it." in section
    results[1]["scratch, same time"] = run(2.40, 31)  # now the spread, 0.40, is wider than the difference, 0.11
    assert "and 0.300 s from scratch (3.00x;" in section
    assert "the difference is within it." in markdown(args, results, teacher, 1.967, student_config(teacher.config), "",
                                                      cost)
