"""Suite-wide pytest hooks."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on two cores: one torch thread each (set before torch is
    # imported), or each worker's idle OpenMP threads spin on the core the other is using.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


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


@dataclass(frozen=True)
class DefaultModelCache:
    """The default model's GGUF, converted once for the whole session."""

    root: Path  # the session's model_cache_dir
    cache: Path  # the converted checkpoint in it
    first: dict  # what the converting load reported


@pytest.fixture(scope="session")
def default_model_cache(tmp_path_factory):
    """Converts the default GGUF once a session (about 12 s), into the session's temp dir.

    Every test that runs the default model reads this cache: one conversion a run instead
    of one per test, and no 0.5 GB checkpoint left in ~/.cache by each fresh clone's run
    (the cache is keyed by the package file's mtime, which every new venv changes).
    """
    from gnosis_daemon.settings import Settings
    from station.runtime.model_loader import default_model_path, gguf_cache_dir, load_model

    root = tmp_path_factory.mktemp("model-cache")
    settings = Settings(model_cache_dir=str(root))
    cache = gguf_cache_dir(default_model_path(), settings)
    loaded = load_model(settings)
    first = {
        "converted": loaded.converted, "loaded_from": loaded.loaded_from,
        "served_id": loaded.served_id, "model_type": loaded.model_type,
        "fingerprint": loaded.fingerprint, "entries": sorted(p.name for p in root.iterdir()),
        "im_end_is_eos": loaded.tokenizer.convert_tokens_to_ids("<|im_end|>") in loaded.eos_token_ids,
    }
    del loaded
    yield DefaultModelCache(root, cache, first)
    shutil.rmtree(root, ignore_errors=True)  # 0.5 GB: do not keep it
