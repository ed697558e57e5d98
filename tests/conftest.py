"""Suite-wide pytest hooks."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only where CUDA is; elsewhere they skip, saying so."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false here)")
    for item in gpu_items:
        item.add_marker(skip)
