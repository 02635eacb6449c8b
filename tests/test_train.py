"""The training loop: it learns, resumes exactly, agrees across compile and precision, stops on NaN."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from tiny_training import losses, make_trainer, model_config, tokenizer, tokens
from tolerances import assert_adamw_runs_agree

from llmscratch.device import choose_dtype
from llmscratch.interrupt import TrainingDiverged
from llmscratch.model.checkpoint import load_checkpoint, model_from_checkpoint
from llmscratch.model.gpt import evaluating
from llmscratch.training.config import TrainConfig
from llmscratch.training.evaluation import bits_per_byte, evaluate, token_byte_lengths
from llmscratch.training.flops import cpu_peak_flops, gpu_peak_flops
from llmscratch.training.optim import configure_optimizer, learning_rate


class Interrupt(Exception):
    pass


@pytest.mark.slow
def test_loss_goes_down(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=40, lr=1e-2, min_lr=1e-3)
    before = trainer.evaluate(512)["loss"]
    summary = trainer.fit(progress=False)
    assert math.log(320) - 0.2 < before < math.log(320) + 0.2  # an untrained model guesses uniformly
    assert summary["val_loss"] < before - 1.0
    assert np.mean(losses(trainer)[-5:]) < losses(trainer)[0] - 1.0
    # The run folder: the metrics of every step, the plot, the summary, a checkpoint at the end.
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    assert "val_bits_per_byte" in records[-1] and "sample" in records[-1] and "mfu" in records[-1]
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert json.loads((tmp_path / "summary.json").read_text())["val_bits_per_byte"] == summary["val_bits_per_byte"]
    assert load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 40


@pytest.mark.parametrize(("dropout", "optimizer"), [(0.0, "adamw"), (0.2, "adamw"), (0.0, "muon")])
@pytest.mark.slow
def test_resume_gives_the_same_losses_bitwise(tmp_path, dropout, optimizer):
    """Stopped during step 5 (last checkpoint at 4) and resumed: steps 5..10 repeat to the bit.

    With dropout the masks come from the global generator: the checkpoint must restore it. With
    Muon, its momentum buffers and the AdamW moments of the other parameters.
    """
    settings = dict(max_steps=10, checkpoint_interval=4, eval_interval=3, sample_interval=3, optimizer=optimizer)
    reference = make_trainer(tmp_path / "a", {"dropout": dropout}, **settings)
    reference.fit(progress=False)

    interrupted = make_trainer(tmp_path / "b", {"dropout": dropout}, **settings)
    step = interrupted.train_step

    def stop_in_step_5():
        if interrupted.step == 4:
            next(interrupted.batches)  # half way through: the data stream has moved on
            torch.rand(3)  # and so has the global random state
            raise Interrupt
        return step()

    interrupted.train_step = stop_in_step_5
    with pytest.raises(Interrupt):
        interrupted.fit(progress=False)
    torch.manual_seed(12345)  # a fresh process has other random state: the checkpoint restores it
    resumed = make_trainer(tmp_path / "b", {"dropout": dropout}, **settings)
    resumed.fit(resume=True, progress=False)
    assert resumed.history[0]["step"] == 5
    # No tolerance: the same process on the same machine runs the same kernels on the same values in the
    # same order, so a resume that restores everything (weights, AdamW moments, data stream, random state)
    # repeats every bit. Any difference at all means some state was not restored.
    assert losses(resumed) == losses(reference)[4:]  # exact float equality
    for a, b in zip(reference.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    logged = [json.loads(line)["loss"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert logged == losses(reference)  # the log holds each step once, steps 1..4 from before the stop
    assert resumed.history[-1]["sample"] == reference.history[-1]["sample"]


def test_resume_refuses_another_model(tmp_path):
    make_trainer(tmp_path, max_steps=2).fit(progress=False)
    other = make_trainer(tmp_path, {"d_model": 64}, max_steps=4)
    with pytest.raises(ValueError, match=r"d_model: model 64 vs checkpoint 32"):
        other.fit(resume=True, progress=False)
    missing = make_trainer(tmp_path / "empty", max_steps=4)
    with pytest.raises(ValueError, match="cannot resume: no checkpoint"):
        missing.fit(resume=True, progress=False)


def test_nan_guard_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=10, checkpoint_interval=2)

    def poison(module, inputs, output):
        return output * float("nan") if trainer.step == 4 else output  # during step 5

    trainer.model.final_norm.register_forward_hook(poison)
    with pytest.raises(TrainingDiverged, match=r"^step 5: loss nan"):
        trainer.fit(progress=False)
    state = load_checkpoint(tmp_path / "checkpoint.pt")
    assert state["step"] == 4
    saved = model_from_checkpoint(tmp_path / "checkpoint.pt")
    for a, b in zip(saved.parameters(), trainer.model.parameters()):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)  # the bad step changed nothing: no optimizer step was taken


def test_float16_overflowing_gradients_are_skipped_not_fatal(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=3, dtype="float16")
    trainer.optimizer_step.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # overflows the first backward
    trainer.fit(progress=False)
    assert trainer.optimizer_step.scaler.get_scale() < 2.0**40  # the scaler saw inf gradients, skipped, backed off
    assert all(math.isfinite(x) for x in losses(trainer))


@pytest.mark.slow
def test_compiled_matches_eager(tmp_path):
    """torch.compile fuses and reorders float32 arithmetic: the runs agree to float32 rounding over 3 steps.

    One layer and no evaluation: on a CPU each compiled graph is C++ built on the spot.
    """
    eager = make_trainer(tmp_path / "eager", {"n_layers": 1})
    compiled = make_trainer(tmp_path / "compiled", {"n_layers": 1}, compile=True)
    eager_losses = [eager.train_step()[0] for _ in range(3)]
    compiled_losses = [compiled.train_step()[0] for _ in range(3)]
    # Fused kernels reassociate sums (and compute exp/log with other approximations): a loss of about
    # 5.7 nats may move by a few float32 ulps per operation through the network; 1e-4 is ~20 ulps of it.
    assert compiled_losses == pytest.approx(eager_losses, abs=1e-4)
    # The weights: float32 rounding, amplified by AdamW where gradients are near zero (tests/tolerances.py).
    assert_adamw_runs_agree(compiled.model.state_dict(), eager.model.state_dict(),
                            lr=compiled.config.lr, steps=3)
    assert compiled.compiled is not compiled.model  # it did go through torch.compile
    # The checkpoint of the compiled run has plain parameter names and loads into a plain model.
    compiled.save()
    assert not any("_orig_mod" in key for key in load_checkpoint(tmp_path / "compiled" / "checkpoint.pt")["model"])
    assert torch.equal(model_from_checkpoint(tmp_path / "compiled" / "checkpoint.pt").lm_head.weight,
                       compiled.model.lm_head.weight)


def test_bfloat16_autocast_stays_close_to_float32(tmp_path):
    fp32 = make_trainer(tmp_path / "fp32", max_steps=5)
    fp32.fit(progress=False)
    bf16 = make_trainer(tmp_path / "bf16", max_steps=5, dtype="bfloat16")
    bf16.fit(progress=False)
    # bfloat16 keeps 8 significant bits: each rounding is off by up to 2^-8 (0.4%), and a loss comes
    # out of a few dozen of them that partly cancel; 1% is a few times what that gives, while a run that
    # went wrong (unscaled, or in the wrong precision for the weights) drifts by far more within 5 steps.
    assert losses(bf16) == pytest.approx(losses(fp32), rel=1e-2)
    assert losses(bf16) != losses(fp32)  # it did run in another precision
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # master weights stay fp32


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    big = make_trainer(tmp_path / "big", max_steps=3, batch_size=8)
    accumulated = make_trainer(tmp_path / "acc", max_steps=3, batch_size=4, grad_accum=2)

    class Halves:  # the same 8 windows per step, as two micro-batches of 4
        def __init__(self, batches):
            self.batches, self.pending = batches, []

        def __next__(self):
            if not self.pending:
                x, y = next(self.batches)
                self.pending = [(x[4:], y[4:]), (x[:4], y[:4])]
            return self.pending.pop()

    accumulated.batches = Halves(big.batches.__class__(tokens()[0], 8, 16, seed=0))
    big_losses = [big.train_step()[0] for _ in range(3)]
    accumulated_losses = [accumulated.train_step()[0] for _ in range(3)]
    # Two halves summed against one sum of all 8 windows: float32 rounding of the same terms (~1e-6 of a loss
    # of about 5.7), and weights that agree as tests/tolerances.py explains.
    assert accumulated_losses == pytest.approx(big_losses, abs=1e-5)
    assert_adamw_runs_agree(accumulated.model.state_dict(), big.model.state_dict(), lr=big.config.lr, steps=3)


def test_time_budget_stops_early_with_a_final_evaluation_and_checkpoint(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1000, max_time=1e-9)
    summary = trainer.fit(progress=False)
    assert summary["steps"] == 1 and summary["val_bits_per_byte"] > 0
    assert load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 1


def test_learning_rate_schedule():
    config = TrainConfig(max_steps=110, warmup_steps=10, lr=1e-3, min_lr=1e-4)
    rates = [learning_rate(step, config) for step in range(120)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)  # linear warmup
    assert rates[60] == pytest.approx((1e-3 + 1e-4) / 2)  # half way down the cosine
    assert rates[110] == pytest.approx(1e-4) and rates[119] == pytest.approx(1e-4)  # the floor
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))


def test_wsd_schedule_holds_then_decays_linearly():
    config = TrainConfig(max_steps=100, warmup_steps=10, lr=1e-3, min_lr=1e-4, schedule="wsd", decay_fraction=0.2)
    rates = [learning_rate(step, config) for step in range(100)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)  # the same warmup
    assert all(rate == 1e-3 for rate in rates[10:80])  # stable until the last fifth
    assert rates[90] == pytest.approx(1e-3 - 0.5 * 9e-4)  # half way down the line at step 90
    assert rates[99] == pytest.approx(1e-4 + 9e-4 / 20)  # min_lr is reached at max_steps, one past the last
    assert learning_rate(150, config) == pytest.approx(1e-4)  # a run resumed past its end stays at the floor


@pytest.mark.parametrize("max_steps,warmup,fraction", [(1, 0, 0.2), (37, 5, 0.3), (20, 15, 0.5), (50, 3, 0.0),
                                                       (64, 8, 1.0), (7, 0, 0.99), (5, 8, 0.2)])
def test_wsd_schedule_matches_the_written_out_reference(max_steps, warmup, fraction):
    from llmscratch.exercises.ch04_references import wsd_schedule

    config = TrainConfig(max_steps=max_steps, warmup_steps=warmup, lr=3e-3, min_lr=2e-4)
    wsd = dataclasses.replace(config, schedule="wsd", decay_fraction=fraction)
    rates = torch.tensor([learning_rate(step, wsd) for step in range(max_steps)], dtype=torch.float64)
    torch.testing.assert_close(rates, wsd_schedule(config, fraction), rtol=1e-12, atol=0)
    past_the_end = [learning_rate(step, wsd) for step in range(max_steps, max_steps + 20)]  # a resumed run
    assert all(2e-4 <= rate <= 3e-3 for rate in past_the_end) and past_the_end[-1] == pytest.approx(2e-4)


def test_optimizer_decays_matrices_only():
    from llmscratch.model.gpt import GPT

    model = GPT(model_config())
    optimizer = configure_optimizer(model, TrainConfig(weight_decay=0.1), torch.device("cpu"))
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert any(p is model.token_embedding.weight for p in decayed["params"])
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == model.num_params()
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)


@pytest.mark.parametrize("batch_size", [3, 4])  # 6 windows: whole batches, or a padded last batch
def test_bits_per_byte_against_a_hand_count(batch_size):
    from llmscratch.model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(model_config())
    _, val = tokens()
    lengths = token_byte_lengths(tokenizer(), 320)
    metrics = evaluate(model, val, lengths, batch_size=batch_size, device=torch.device("cpu"), max_tokens=100)
    # 100 tokens make 6 windows of 16 inputs; window i starts at token 16 i and predicts tokens 16 i + 1 ...
    windows = torch.stack([torch.from_numpy(val[i * 16 : i * 16 + 17].astype(np.int64)) for i in range(6)])
    with torch.no_grad():
        logp = torch.log_softmax(model(windows[:, :-1]).double(), dim=-1)  # (6, 16, V)
    nats = -logp.gather(-1, windows[:, 1:, None]).sum().item()
    text_bytes = len(tokenizer().decode(windows[:, 1:].flatten().tolist()).encode("utf-8"))
    assert metrics["loss"] == pytest.approx(nats / 96, rel=1e-6)
    assert metrics["perplexity"] == pytest.approx(math.exp(nats / 96), rel=1e-6)
    assert metrics["bits_per_byte"] == pytest.approx(nats / math.log(2) / text_bytes, rel=1e-6)
    assert bits_per_byte(metrics["loss"], text_bytes / 96) == pytest.approx(metrics["bits_per_byte"])
    assert metrics["bytes_per_token"] == pytest.approx(text_bytes / 96, rel=1e-12)


def test_evaluating_restores_the_mode_even_after_an_error():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    with pytest.raises(Interrupt), evaluating(model):
        assert not model.training and not model[1].training
        raise Interrupt
    assert model.training and model[1].training  # back in train mode, every submodule
    model.eval()
    with evaluating(model):
        pass
    assert not model.training  # a model in eval mode stays there


def test_config_validation_names_the_bad_value():
    for bad, match in [({"max_steps": 0}, "max_steps"), ({"lr": -1.0}, "lr must be positive, got -1.0"),
                       ({"dtype": "float8"}, "float8"), ({"grad_clip": float("nan")}, "grad_clip"),
                       ({"beta2": 1.0}, "betas"), ({"max_time": 0}, "max_time")]:
        with pytest.raises(ValueError, match=match):
            TrainConfig(**bad)


def test_dtype_choice_and_peaks(tmp_path, monkeypatch):
    import llmscratch.device

    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n\n")
    plain = tmp_path / "plain"
    plain.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512_bf16\nbugs\t\t: amx_bf16_like\n")
    assert llmscratch.device.cpu_has_amx(amx) and not llmscratch.device.cpu_has_amx(plain)
    assert not llmscratch.device.cpu_has_amx(tmp_path / "missing")  # not Linux: assume no AMX
    for has_amx, expected in [(True, "bfloat16"), (False, "float32")]:
        monkeypatch.setattr(llmscratch.device, "cpu_has_amx", lambda: has_amx)
        assert choose_dtype(torch.device("cpu")) == expected
    assert gpu_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert gpu_peak_flops("NVIDIA L40S", torch.bfloat16) == 362e12
    assert gpu_peak_flops("NVIDIA L4", torch.bfloat16) == 121e12
    assert gpu_peak_flops("Some Future GPU", torch.bfloat16) is None
    # The CPU ceiling is the best measurement so far, cached: a busy moment cannot lower it.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measurements = iter([5e10, 3e10, 6e10])
    monkeypatch.setattr("llmscratch.training.flops.measure_matmul_flops", lambda dtype: next(measurements))
    assert [cpu_peak_flops(torch.float32) for _ in range(3)] == [5e10, 5e10, 6e10]
    assert list(json.loads((tmp_path / "llmscratch" / "peak_flops.json").read_text()).values()) == [6e10]
