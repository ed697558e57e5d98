"""Which directory of a model's disk tier holds one KV layout (``station.tier.store.store.KVStore``).

A model's tier (``<state_dir>/kv-tier/<first 16 hex of its fingerprint>``) is written in
one layout: block size, block shape and dtype. A station started with another
``kv_block_size`` (or any other layout) over it must never read, evict, quarantine or
overwrite those files: they are another configuration's sessions, whole, and the daemon
configured back must find them again. So each layout has a directory of its own, set aside
by name and never moved::

    <model dir>/layout.json                the layout the model directory itself holds
    <model dir>/blocks/ sessions/ ...      that layout's tier
    <model dir>/layouts/<tag>/blocks/ ...  every other layout's tier, <tag> naming it
                                           (``bs16-float32-2x2x16x2x32``)

The first layout opened claims the model directory (its ``layout.json``); a tier written
before the marker existed is claimed by the layout of its first file whose checksum holds
(a manifest tells the block size, a block file all of it), so an upgrade over an existing
tier keeps using it. Deciding and claiming happen under ``layout.lock`` (replicas of a
fleet's shared tier may open it at once).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import Iterator

from station.tier.format import (
    BLOCK_MAGIC, SESSION_MAGIC, KVLayout, KVStoreError, _read, write_atomic,
)

LAYOUT_FILE = "layout.json"
LAYOUTS_DIR = "layouts"
_LEGACY_PROBES = 8  # files of an unmarked tier read to learn its layout, at most


def layout_tag(block_size: int, shape: tuple[int, ...] | None, dtype: object | None) -> str:
    """A layout's directory name: ``bs<block size>-<dtype>-<shape>`` (a manifest alone
    tells only the block size: ``bs<n>``)."""
    if shape is None or dtype is None:
        return f"bs{block_size}"
    return f"bs{block_size}-{str(dtype).removeprefix('torch.')}-{'x'.join(map(str, shape))}"


def tag_of(layout: KVLayout) -> str:
    return layout_tag(layout.block_size, layout.shape, layout.dtype)


@contextlib.contextmanager
def _locked(model_dir: Path) -> Iterator[None]:
    fd = os.open(model_dir / "layout.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _probe(path: Path) -> str | None:
    """The tag of the layout ``path`` was written in, when its checksum holds."""
    try:
        header, _payload, _size = _read(path, BLOCK_MAGIC if path.suffix == ".kvb" else SESSION_MAGIC)
    except KVStoreError:
        return None
    block_size, shape, dtype = header.get("block_size"), header.get("shape"), header.get("dtype")
    if not isinstance(block_size, int):
        return None
    if path.suffix == ".kvb" and isinstance(shape, list) and isinstance(dtype, str):
        return layout_tag(block_size, tuple(shape), dtype)
    return layout_tag(block_size, None, None)


def _unmarked_tag(model_dir: Path, layout: KVLayout) -> str:
    """The layout of a tier written before ``layout.json`` (or ``layout``'s, if empty)."""
    ours = tag_of(layout)
    for pattern in ("blocks/*/*.kvb", "sessions/*.kvs"):
        for n, path in enumerate(sorted(model_dir.glob(pattern))):
            if n >= _LEGACY_PROBES:
                break
            tag = _probe(path)
            if tag is not None:  # a manifest of our block size: taken as ours
                return ours if tag in (ours, f"bs{layout.block_size}") else tag
    return ours


def layout_root(model_dir: Path, layout: KVLayout) -> tuple[Path, list[str]]:
    """The directory ``layout``'s tier lives in under ``model_dir``, created if need be,
    and the tags of the other layouts set aside there (untouched)."""
    model_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    ours = tag_of(layout)
    with _locked(model_dir):
        marker = model_dir / LAYOUT_FILE
        try:
            claimed = json.loads(marker.read_text())["tag"]
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            claimed = _unmarked_tag(model_dir, layout)
            write_atomic(marker, [json.dumps({"tag": claimed}).encode()])
        others = sorted((_listed(model_dir / LAYOUTS_DIR) | {claimed}) - {ours})
        if claimed == ours:
            return model_dir, others
        root = model_dir / LAYOUTS_DIR / ours
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        return root, others


def _listed(directory: Path) -> set[str]:
    try:
        return {p.name for p in directory.iterdir() if p.is_dir()}
    except FileNotFoundError:
        return set()
