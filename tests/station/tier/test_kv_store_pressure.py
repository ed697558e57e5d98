"""The KV store's own rules under pressure, as pure file I/O on small random tensors
(``station.tier.store.pressure``, ``station.tier.store.layouts``, quarantine's budget in
``station.tier.store.quarantine``): which session the disk budget evicts between tenants,
the directory each layout gets, and quarantine's oldest-first deletion."""

from __future__ import annotations

import json

import pytest
import torch

from station.core.block_pool import block_hashes_for
from station.tier.store.store import KVStore, Quarantined
from station.tier.store.layouts import LAYOUT_FILE, LAYOUTS_DIR, layout_tag
from tests.station.tier.test_kv_store import (BS, FP, KEYS, SHAPE, block_file, kv_for, open_store, put,
                                         tokens_of)

SHAPE8 = (2, 2, 8, 2, 3)  # the same KV at 8 tokens a block


def put_any(store: KVStore, session_id: str, tokens: list[int]) -> list[bytes]:
    """``put`` in whatever layout ``store`` has."""
    bs = store.layout.block_size
    hashes = block_hashes_for(tokens, bs, KEYS)
    for i, h in enumerate(hashes):
        store.write_block(h, tokens[i * bs:(i + 1) * bs], kv_for(h, torch.float32, store.layout.shape))
    store.write_session(session_id, "t", tokens, hashes, 1.0)
    return hashes


def test_the_over_share_tenant_pays_with_its_own_sessions(tmp_path):
    root = tmp_path / "kv"
    with open_store(root) as store:
        put(store, "bob.0", tokens_of(1, 2), last_used=1.0, tenant="bob")  # the oldest
        put(store, "bob.1", tokens_of(2, 2), last_used=2.0, tenant="bob")
        for i in range(6):
            put(store, f"alice.{i}", tokens_of(10 + i, 2), last_used=10.0 + i, tenant="alice")
        one = store.index.bytes // 8
    # A budget of 5.5 sessions, a share of 0.5: alice (6 of 8) is over it, bob (2) is not.
    with open_store(root, budget=5 * one + one // 2) as store:
        store.tenant_share = 0.5
        evicted = store.evict_to_budget(tenant="bob")  # bob writing: alice still pays
        assert evicted.sessions == ("alice.0", "alice.1", "alice.2")
        assert store.index.stats()["evicted_over_share"] == 3
        assert {r.session_id for r in store.load_sessions()} == {
            "bob.0", "bob.1", "alice.3", "alice.4", "alice.5"}
    # 2.5 sessions: both over their share (1.25), the writer's own LRU first, then alice's.
    with open_store(root, budget=2 * one + one // 2) as store:
        store.tenant_share = 0.5
        assert store.evict_to_budget(tenant="bob").sessions == ("bob.0", "alice.3", "alice.4")


def test_under_the_share_the_least_recently_used_of_all_goes(tmp_path):
    root = tmp_path / "kv"
    with open_store(root) as store:
        put(store, "bob.0", tokens_of(1, 2), last_used=1.0, tenant="bob")
        put(store, "alice.0", tokens_of(2, 2), last_used=2.0, tenant="alice")
        put(store, "carol.0", tokens_of(3, 2), last_used=3.0, tenant="carol")
        one = store.index.bytes // 3
    with open_store(root, budget=2 * one + one // 2) as store:
        store.tenant_share = 0.5  # each holds a third of the store, half of the budget: none over
        assert store.evict_to_budget(tenant="carol").sessions == ("bob.0",)
        assert store.index.stats()["evicted_over_share"] == 0


def test_each_layout_has_its_own_directory_and_the_first_claims_the_model_dir(tmp_path):
    root = tmp_path / "kv"
    with open_store(root) as store:
        hashes = put(store, "s.4", tokens_of(1, 2))
        assert store.root == root and store.other_layouts == []
    tag4 = layout_tag(BS, SHAPE, torch.float32)
    assert json.loads((root / LAYOUT_FILE).read_text()) == {"tag": tag4}
    with open_store(root, block_size=8, shape=SHAPE8) as store:
        tag8 = layout_tag(8, SHAPE8, torch.float32)
        assert store.root == root / LAYOUTS_DIR / tag8 and store.other_layouts == [tag4]
        assert store.load_sessions() == [] and store.stats()["quarantined_total"] == 0
        put_any(store, "s.8", tokens_of(2, 2))
    with open_store(root) as store:
        assert [r.session_id for r in store.load_sessions()] == ["s.4"]
        assert store.other_layouts == [tag8] and all(block_file(store, h).is_file() for h in hashes)
    # Another dtype is another layout too (a model's dtype also changes its fingerprint).
    with open_store(root, dtype=torch.bfloat16) as store:
        assert store.root.name == layout_tag(BS, SHAPE, torch.bfloat16) and store.load_sessions() == []


def test_an_unmarked_tier_is_claimed_by_the_layout_of_its_files(tmp_path):
    root = tmp_path / "kv"
    with open_store(root, block_size=8, shape=SHAPE8) as store:
        put_any(store, "s.8", tokens_of(2, 2))
    (root / LAYOUT_FILE).unlink()  # as a version without markers left it
    with open_store(root) as store:  # block size 4 opens it: the files say 8
        assert store.root == root / LAYOUTS_DIR / layout_tag(BS, SHAPE, torch.float32)
        assert store.other_layouts == [layout_tag(8, SHAPE8, torch.float32)]
    with open_store(root, block_size=8, shape=SHAPE8) as store:
        assert store.root == root and [r.session_id for r in store.load_sessions()] == ["s.8"]


def test_quarantine_deletes_its_oldest_files_past_its_budget(tmp_path):
    root = tmp_path / "kv"
    with open_store(root) as store:
        hashes = put(store, "s", tokens_of(1, 4))
    sizes = []
    for h in hashes:  # four damaged blocks, quarantined in the order read
        path = root / "blocks" / h.hex()[:2] / f"{h.hex()}.kvb"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
        sizes.append(len(data))
    with KVStore(root, FP, BS, SHAPE, torch.float32, 10**9, quarantine_budget_bytes=sizes[2] + sizes[3]) as store:
        for i, h in enumerate(hashes):
            with pytest.raises(Quarantined):
                store.read_block(h, tokens_of(1, 4)[i * BS:(i + 1) * BS])
        stats = store.stats()
        assert (stats["quarantine_kept"], stats["quarantine_deleted"]) == (2, 2)
        assert stats["quarantine_kept_reasons"] == {"checksum": 2}
        assert stats["quarantine_kept_bytes"] == sizes[2] + sizes[3]
    kept = sorted(p.name.split(".")[0] for p in (root / "quarantine").iterdir())
    assert kept == sorted(h.hex() for h in hashes[2:])  # the two read last
    with open_store(root) as store:  # a restart still knows why (quarantine.json)
        assert store.stats()["quarantine_kept_reasons"] == {"checksum": 2}
    (root / "quarantine.json").unlink()
    with open_store(root) as store:  # without it, the files are kept all the same
        assert store.stats()["quarantine_kept_reasons"] == {"earlier": 2}
