"""Marks for the whole suite: every notebook cell that nbval runs is slow (a notebook runs whole or not at all);
tests marked cuda are deselected where torch sees no CUDA GPU."""

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
    on_gpu = [item for item in items if item.get_closest_marker("cuda")]
    if not on_gpu:
        return
    import torch  # here, not at the top: a run that collected no GPU test never pays for it

    if torch.cuda.is_available():
        return
    # Deselected, not skipped: a CPU run reports "N deselected", and cannot pass for a GPU run by skipping them.
    items[:] = [item for item in items if not item.get_closest_marker("cuda")]
    config.hook.pytest_deselected(items=on_gpu)
