"""Marks for the whole suite: every notebook cell that nbval runs is slow (a notebook runs whole or not at all);
tests marked cuda are deselected where torch sees no CUDA GPU. And ``one_torch_thread``, for test files of tiny models
(``pytestmark = pytest.mark.usefixtures("one_torch_thread")``). Under pytest-xdist (``pyproject.toml``: one worker per
core) each worker runs torch on one thread."""

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # The workers share the cores: one thread each. A torch thread waiting for a core that another process holds
    # spins, and small models then run 10-50x slower. Set before torch is imported and before any notebook kernel
    # or script starts, so that they all inherit it.
    os.environ["OMP_NUM_THREADS"] = "1"


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


@pytest.fixture
def one_torch_thread():
    """One torch thread while a test runs: the models are tiny, and on a busy machine a second thread mostly waits for
    a core (a tiny model's generate: 3.3 s with two threads under load, 0.05 s with one)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def served_model():
    """The bundled base model in float32 with its tokenizer, for the server's tests; torch on one thread while the
    module runs (a tiny model: the second core serves the clients)."""
    import torch

    from llmscratch.cli import DEFAULT_MODELS
    from llmscratch.model.weights import load_model_and_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODELS["base"][0])
    yield model.float().eval(), tokenizer
    torch.set_num_threads(threads)
