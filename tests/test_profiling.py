"""llmscratch.profiling: the CPU peak-memory replay against allocations of known size, and the timers."""

import time

import torch

from llmscratch.profiling import peak_memory_bytes, round_robin, time_once


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
