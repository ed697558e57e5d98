"""Suite-wide pytest hooks."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One torch (OpenMP) thread a worker, as the stations the tests start have: two workers
    # on two cores, a worker's second OpenMP thread spun between a tiny model's ops on the
    # core the other worker needs (the station and model tests ran 12-15% longer with two).
    # Tests of the multithreaded paths ask for their threads (``threads=2``).
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


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
    """Converts the default GGUF once a run (about 12 s), into the run's temp dir.

    Every test that runs the default model reads this cache: one conversion a run instead
    of one per test, and no 0.5 GB checkpoint left in ~/.cache by each fresh clone's run
    (the cache is keyed by the package file's mtime, which every new venv changes). Under
    pytest-xdist the workers share one (the run's temp dir is their parent's): the first
    converts under a lock, the others load what it wrote, and the last one out removes it.
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / "default-model-cache"
    with _locked(shared / "default-model-cache.lock"):
        users = shared / "default-model-cache.users"
        count = int(users.read_text()) if users.exists() else 0
        users.write_text(str(count + 1))
        record = root / "first-load.json"
        if not record.exists():
            root.mkdir(exist_ok=True)
            record.write_text(json.dumps(_convert(root)))
        first = json.loads(record.read_text())
    from gnosis_daemon.settings import Settings
    from station.model.loader import default_model_path, gguf_cache_dir

    yield DefaultModelCache(root, gguf_cache_dir(default_model_path(), Settings(model_cache_dir=str(root))),
                            first)
    with _locked(shared / "default-model-cache.lock"):
        count = int(users.read_text()) - 1
        users.write_text(str(count))
        if count == 0:
            shutil.rmtree(root, ignore_errors=True)  # 0.5 GB: do not keep it


def _convert(root: Path) -> dict:
    """Load the default model with ``root`` as the cache (converting it): what it reported."""
    from gnosis_daemon.settings import Settings
    from station.model.loader import load_model

    loaded = load_model(Settings(model_cache_dir=str(root)))
    return {
        "converted": loaded.converted, "loaded_from": loaded.loaded_from,
        "served_id": loaded.served_id, "model_type": loaded.model_type,
        "fingerprint": loaded.fingerprint, "entries": sorted(p.name for p in root.iterdir()),
        "im_end_is_eos": loaded.tokenizer.convert_tokens_to_ids("<|im_end|>") in loaded.eos_token_ids,
    }


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
