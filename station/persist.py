"""The KV-session disk tier: sessions are written when the station stops and restored
when it starts, so liquid memory survives a station restart (an upgrade, a crash-free
redeploy, ``gnosis-daemon restart station``).

Layout: ``<state_dir>/kv-sessions/manifest.json`` (sessions: id, tenant, tokens, block
refs) and ``kv.pt`` (the sessions' distinct blocks, ``[L, 2, n, block_size, kv_heads,
head_dim]``). A tier is written into a temporary directory and swapped in by rename, so a
crash mid-write leaves the previous tier whole. The manifest names the model fingerprint,
dtype, block size and KV shape; a tier written by another model or layout is ignored (and
logged), never loaded: wrong KV would silently corrupt outputs.

Both functions run while the engine thread is stopped (before ``start``, after
``shutdown``), so they touch the pool and the registry without locks. A SIGKILLed station
writes nothing: its sessions are lost, and the last clean stop's tier (if any) is what the
next start restores.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from gnosis_daemon.logs import get_logger
from station.block_pool import block_hashes_for, prefix_extra_keys

log = get_logger()

FORMAT = 1


def _layout(engine: Any) -> dict[str, Any]:
    kv = engine.kv_cache.kv  # [L, 2, num_blocks, bs, H, D]
    return {"format": FORMAT, "fingerprint": engine.loaded.fingerprint,
            "block_size": engine.block_size, "dtype": str(kv.dtype),
            "kv_shape": [kv.shape[0], kv.shape[1], *kv.shape[3:]]}


def save_sessions(engine: Any, directory: Path) -> int:
    """Write every KV session to ``directory``; returns how many were written."""
    sessions = engine.sessions.sessions()  # least recently used first: restored in order
    if not sessions:
        shutil.rmtree(directory, ignore_errors=True)
        return 0
    block_ids: list[int] = []
    index: dict[int, int] = {}  # sessions of one conversation share blocks: store each once
    entries = []
    for session in sessions:
        refs = []
        for block in session.blocks:
            if block.block_id not in index:
                index[block.block_id] = len(block_ids)
                block_ids.append(block.block_id)
            refs.append(index[block.block_id])
        entries.append({"session_id": session.session_id, "tenant": session.tenant,
                        "token_ids": list(session.token_ids), "blocks": refs})
    ids = torch.tensor(block_ids, dtype=torch.long, device=engine.kv_cache.kv.device)
    kv = engine.kv_cache.kv.index_select(2, ids).cpu()
    directory.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = directory.with_name(directory.name + ".tmp")
    old = directory.with_name(directory.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    torch.save(kv, tmp / "kv.pt")
    (tmp / "manifest.json").write_text(json.dumps({**_layout(engine), "sessions": entries}))
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        directory.rename(old)
    tmp.rename(directory)
    shutil.rmtree(old, ignore_errors=True)
    log.info("kv_sessions_saved", sessions=len(entries), blocks=len(block_ids), path=str(directory))
    return len(entries)


def restore_sessions(engine: Any, directory: Path) -> int:
    """Load the tier in ``directory`` into the pool as pinned sessions; returns how many."""
    manifest_path = directory / "manifest.json"
    if not manifest_path.exists():
        return 0
    try:
        manifest = json.loads(manifest_path.read_text())
        layout = {key: manifest[key] for key in _layout(engine)}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("kv_tier_ignored", reason=f"unreadable manifest: {exc}", path=str(directory))
        return 0
    if layout != _layout(engine):
        log.warning("kv_tier_ignored", reason="written by another model or KV layout",
                    path=str(directory), tier=layout, here=_layout(engine))
        return 0
    kv = torch.load(directory / "kv.pt", map_location=engine.kv_cache.kv.device, weights_only=True)
    num_blocks = kv.shape[2]
    pool = engine.pool
    if not pool.can_allocate(num_blocks):
        log.warning("kv_tier_ignored", reason=f"{num_blocks} blocks do not fit the pool",
                    path=str(directory))
        return 0
    blocks = pool.allocate(num_blocks)
    ids = torch.tensor([b.block_id for b in blocks], dtype=torch.long, device=kv.device)
    engine.kv_cache.kv.index_copy_(2, ids, kv.to(engine.kv_cache.kv.dtype))
    bs = engine.block_size
    for entry in manifest["sessions"]:
        tokens = entry["token_ids"]
        session_blocks = [blocks[i] for i in entry["blocks"]]
        keys = prefix_extra_keys(engine.loaded.fingerprint, engine.settings.tenant_salt,
                                 entry["tenant"])
        # Re-key the blocks under this run's salt: the automatic prefix cache hits them too.
        for i, (block, block_hash) in enumerate(zip(session_blocks, block_hashes_for(tokens, bs, keys))):
            pool.cache_full_block(block, block_hash, tokens[i * bs:(i + 1) * bs])
        engine.sessions.save(entry["session_id"], entry["tenant"], tokens, session_blocks)
    pool.free(blocks)  # drop the allocation's reference: the sessions' pins hold the blocks
    log.info("kv_sessions_restored", sessions=len(manifest["sessions"]), blocks=num_blocks,
             path=str(directory))
    return len(manifest["sessions"])
