"""Marks for the whole suite: every notebook cell that nbval runs is slow (a notebook runs whole or not at all)."""

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
