"""llmscratch.profiling: the CPU peak-memory replay against allocations of known size."""

import torch

from llmscratch.profiling import peak_memory_bytes


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
