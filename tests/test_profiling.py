"""llmscratch.profiling: the CPU peak-memory replay against allocations of known size, the timers, and what the
bench scripts print beside them (the device, the attention kernels, a failed allocation)."""

import time

import torch
import torch.nn.functional as F

from llmscratch.profiling import (backward_step, device_description, failed_allocation, peak_memory_bytes, round_robin,
                                  sdpa_kernels, time_once, time_steps)


def test_peak_memory_counts_what_a_step_holds_at_once():
    def step():
        a = torch.ones(1024, 1024)  # 4 MiB
        b = torch.ones(512, 1024)  # 2 MiB, while a is alive
        del a, b
        c = torch.ones(256, 1024)  # 1 MiB, after both were freed
        return c.sum()

    peak = peak_memory_bytes(step, "cpu")
    assert 6 * 2**20 <= peak < 7 * 2**20


def test_memory_held_before_the_step_is_not_counted():
    held = torch.ones(2048, 1024)  # 8 MiB alive throughout
    peak = peak_memory_bytes(lambda: torch.ones(1024, 1024).sum(), "cpu")
    assert 4 * 2**20 <= peak < 5 * 2**20
    assert held.numel() == 2**21


def test_round_robin_runs_each_candidate_once_a_round_in_order():
    calls = []
    measured = round_robin({"a": lambda: calls.append("a") or 1.0, "b": lambda: calls.append("b") or 2.0}, 3)
    assert calls == ["a", "b"] * 3  # interleaved: a slow spell hits both alike
    assert measured == {"a": [1.0] * 3, "b": [2.0] * 3}


def test_time_once_measures_the_call():
    assert 0.02 <= time_once(lambda: time.sleep(0.02)) < 5


def test_time_steps_warms_up_then_times_round_robin():
    calls = []
    measured = time_steps({"a": lambda: calls.append("a"), "b": lambda: calls.append("b") or time.sleep(0.01)},
                          rounds=3, warmup=2)
    assert calls == ["a", "a", "b", "b"] + ["a", "b"] * 3  # each warmed up in turn, then interleaved
    (first_a, median_a), (first_b, median_b) = measured["a"], measured["b"]
    assert 0 <= first_a < 0.01 <= first_b and 0 <= median_a < 0.01 <= median_b < 5


def test_backward_step_backpropagates_then_drops_every_gradient():
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    seen = []
    module.weight.register_hook(lambda grad: seen.append(grad.clone()))
    step = backward_step(module, (x,), torch.ones(4, 2))
    step()
    step()
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])  # the second step starts from no gradient too
    assert torch.allclose(seen[0], torch.ones(2, 4) @ x.detach())
    assert module.weight.grad is None and module.bias.grad is None and x.grad is None


def test_device_description_names_torch_and_the_cpu():
    text = device_description("cpu")
    assert text.startswith(f"torch {torch.__version__} on cpu (") and text.endswith(f", {torch.get_num_threads()} "
                                                                                    "threads)")


def test_failed_allocation_names_the_size_asked_for():
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 52428800000 bytes. Error code 12 (Cannot allocate memory)")
    assert failed_allocation(cpu) == "52428800000 bytes"
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity")
    assert failed_allocation(cuda) == "2.50 GiB"
    assert failed_allocation(torch.OutOfMemoryError("out of memory")) == ""
    assert failed_allocation(RuntimeError("shapes cannot be multiplied")) is None


def test_sdpa_kernels_names_what_attention_dispatched_to():
    q = torch.randn(1, 2, 8, 4)  # (B, nh, T, hs)
    kernels = sdpa_kernels(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert kernels and all(name.startswith("aten::_scaled_dot_product") for name in kernels)
    assert sdpa_kernels(lambda: q @ q.transpose(-2, -1)) == []
