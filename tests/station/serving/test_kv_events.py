"""KV events: the pool's hooks, the tenant-agnostic counting, the wire format vllm-router
decodes (msgpack ``[ts, [event...], rank]``, events as maps tagged ``type``), the ZMQ
framing and replay, and the re-sync after a drop or a restart."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from station.core.block_pool import BlockPool, block_hashes_for, ext_block_hash, ext_block_hashes
from station.serving.kv_events import (CLEARED, REMOVED, STORED, KVEventPublisher, coalesce,
                                       encode_batch)
from tests.support.procs import free_port

BS = 4


class Recorder:
    def __init__(self):
        self.events = []

    def stored(self, ext, parent, tokens):
        self.events.append((STORED, ext, parent, tuple(tokens)))

    def removed(self, ext):
        self.events.append((REMOVED, ext))

    def cleared(self):
        self.events.append((CLEARED,))


def _cache(pool, tokens, extra=()):
    hashes = block_hashes_for(tokens, BS, extra)
    blocks = pool.allocate(len(hashes))
    for i, (b, h) in enumerate(zip(blocks, hashes)):
        pool.cache_full_block(b, h, tokens[i * BS:(i + 1) * BS], blocks[i - 1] if i else None)
    return blocks


def test_ext_hash_is_a_token_only_chain_a_router_can_recompute():
    tokens = list(range(10))
    exts = ext_block_hashes(tokens, BS)
    assert len(exts) == 2  # full blocks only
    assert exts[0] == ext_block_hash(None, tokens[:4])
    assert exts[1] == ext_block_hash(exts[0], tokens[4:8])
    assert all(0 <= e < 2**63 for e in exts)
    assert ext_block_hashes([9, 9, 9, 9] + tokens[4:8], BS)[1] != exts[1]  # chained


def test_pool_reports_stored_removed_and_cleared_with_parents():
    pool = BlockPool(4, BS)
    pool.events = rec = Recorder()
    tokens = list(range(8))
    blocks = _cache(pool, tokens)
    exts = ext_block_hashes(tokens, BS)
    assert rec.events == [(STORED, exts[0], None, (0, 1, 2, 3)),
                          (STORED, exts[1], exts[0], (4, 5, 6, 7))]
    pool.free(blocks)
    rec.events.clear()
    pool.allocate(4)  # evicts both cached blocks
    assert sorted(rec.events) == sorted([(REMOVED, exts[0]), (REMOVED, exts[1])])
    rec.events.clear()
    pool.reset_prefix_cache()
    assert rec.events == [(CLEARED,)]


def test_two_tenants_one_router_block_until_the_last_copy_goes():
    pub = _Publisher()
    pool = BlockPool(8, BS)
    pool.events = pub.listener
    tokens = list(range(4))
    a = _cache(pool, tokens, ("model", "tenant-a"))
    b = _cache(pool, tokens, ("model", "tenant-b"))  # other station hash, same ext hash
    assert [e[0] for e in pub.items] == [STORED]
    pool.free(a)
    pool.free(b)
    pool.allocate(7)  # the free blocks first, then one of the two copies
    assert [e[0] for e in pub.items] == [STORED]
    pool.allocate(1)  # the last copy
    assert [e[0] for e in pub.items] == [STORED, REMOVED]


def test_batch_wire_format_is_what_vllm_router_decodes():
    events = coalesce([(STORED, (1,), None, (1, 2, 3, 4)), (STORED, (2,), 1, (5, 6, 7, 8)),
                       (REMOVED, (7,), None, ()), (REMOVED, (8,), None, ()),
                       (CLEARED, (), None, ())])
    ts, body, rank = msgpack.unpackb(encode_batch(events, BS, ts=12.5))
    assert (ts, rank) == (12.5, 0)
    assert body == [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "block_size": BS, "lora_id": None,
         "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [7, 8], "medium": "GPU"},
        {"type": "AllBlocksCleared"}]


class _Publisher:
    """The listener's queue side only (no sockets)."""

    def __init__(self):
        from station.serving.kv_events import Listener
        self.items = []
        self.listener = Listener(self)

    def put(self, event):
        self.items.append(event)


@pytest.fixture
def publisher():
    port, rport = free_port(), free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", BS, replay_endpoint=f"tcp://127.0.0.1:{rport}",
                           max_queue=4)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 3000)
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # the subscription reaches the publisher
    yield pub, sub, ctx, rport
    sub.close(0)
    pub.close()
    ctx.term()


def _recv(sub):
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)


def test_framing_sequence_and_replay(publisher):
    pub, sub, ctx, rport = publisher
    pub.listener.cleared()
    pub.flush()
    time.sleep(0.1)
    pub.listener.stored(5, None, (1, 2, 3, 4))
    topic, seq0, batch = _recv(sub)
    assert topic == b"" and batch[1][0]["type"] == "AllBlocksCleared"
    _, seq1, batch = _recv(sub)
    assert seq1 == seq0 + 1 and batch[1][0]["block_hashes"] == [5]
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 3000)
    dealer.connect(f"tcp://127.0.0.1:{rport}")
    dealer.send_multipart([b"", seq1.to_bytes(8, "big")])
    _, seq, payload = dealer.recv_multipart()
    assert int.from_bytes(seq, "big") == seq1 and msgpack.unpackb(payload)[1][0]["block_hashes"] == [5]
    _, end, _ = dealer.recv_multipart()
    assert int.from_bytes(end, "big", signed=True) == -1
    dealer.close(0)


def test_a_full_queue_drops_counts_and_resyncs_everything_cached(publisher):
    pub, sub, ctx, _ = publisher
    wakes = []
    pub.request_resync = lambda: wakes.append(1)
    pool = BlockPool(64, BS)
    pool.events = pub.listener
    pub._stop.set()  # hold the sender so the queue (4) overflows
    pub._thread.join()
    for i in range(6):
        _cache(pool, [i] * 8)
    assert pub.dropped > 0 and pub.resync_wanted and wakes == [1]
    pub.resync(pool.cached_ext_blocks())  # what the engine does at its next step boundary
    assert not pub.resync_wanted
    pub._stop.clear()
    pub._thread = __import__("threading").Thread(target=pub._run, daemon=True)
    pub._thread.start()
    _, _, batch = _recv(sub)
    kinds = [e["type"] for e in batch[1]]
    assert kinds[0] == "AllBlocksCleared"
    stored = [h for e in batch[1][1:] for h in e["block_hashes"]]
    assert sorted(stored) == sorted(e for e, _, _ in pool.cached_ext_blocks())
    # parents come before their children, so a router can anchor every chain
    seen = set()
    for e in batch[1][1:]:
        assert e["parent_block_hash"] is None or e["parent_block_hash"] in seen
        seen.update(e["block_hashes"])


# -- the disk tier (medium DISK)

def _disk_index(*sessions):
    from station.core.disk_sessions import DiskSessions
    index = DiskSessions()
    index.add_all(sessions)
    return index


def _disk_session(session_id, tokens, tenant="alice"):
    from station.core.disk_sessions import DiskSession
    hashes = tuple(block_hashes_for(tokens, BS, ("model", tenant)))
    return DiskSession(session_id, tenant, tuple(tokens), hashes, hashes, 0.0)


def test_disk_sessions_are_counted_per_block_and_published_as_disk_runs():
    pub = _Publisher()
    pub.block_size = BS
    index = _disk_index()
    index.events = pub.listener
    pub.listener.disk = index
    a = list(range(12))
    exts = ext_block_hashes(a, BS)
    index.add(_disk_session("a", a))
    assert pub.items == [(STORED, tuple(exts), None, tuple(a), "DISK")]  # one chain
    # Another tenant, the same tokens: one router block, as in the pool.
    index.add(_disk_session("a2", a, tenant="bob"))
    # Sharing the first two blocks: only the new run, with its parent.
    b = a[:8] + [99] * 8
    bx = ext_block_hashes(b, BS)
    index.add(_disk_session("b", b))
    assert pub.items[1:] == [(STORED, tuple(bx[2:]), bx[1], tuple(b[8:]), "DISK")]
    assert bx[:2] == exts[:2]
    del pub.items[:]
    index.remove("a")
    assert pub.items == []  # a2 still names every block of a
    index.remove("a2")
    assert pub.items == [(REMOVED, (exts[2],), None, (), "DISK")]  # b names the first two
    # A new copy of an id replaces the old one: the blocks both name stay published.
    del pub.items[:]
    index.add(_disk_session("b", b[:12]))
    assert pub.items == [(REMOVED, (bx[3],), None, (), "DISK")]
    del pub.items[:]
    pub.listener.cleared()  # a pool reset: the router clears every tier, DISK follows again
    assert pub.items == [("resync", [(CLEARED, (), None, ()),
                                     (STORED, tuple(bx[:3]), None, tuple(b[:12]), "DISK")])]


def test_disk_events_on_the_wire_and_never_coalesced_with_gpu():
    events = coalesce([(STORED, (1,), None, (1, 2, 3, 4)), (STORED, (2,), 1, (5, 6, 7, 8), "DISK"),
                       (REMOVED, (7,), None, ()), (REMOVED, (8,), None, (), "DISK")])
    _, body, _ = msgpack.unpackb(encode_batch(events, BS, ts=1.0))
    assert [(e["type"], e["block_hashes"], e["medium"]) for e in body] == [
        ("BlockStored", [1], "GPU"), ("BlockStored", [2], "DISK"),
        ("BlockRemoved", [7], "GPU"), ("BlockRemoved", [8], "DISK")]
    assert body[1]["parent_block_hash"] == 1 and body[1]["token_ids"] == [5, 6, 7, 8]


def test_a_resync_sends_the_disk_set_after_the_pool(publisher):
    pub, sub, ctx, _ = publisher
    pool = BlockPool(16, BS)
    pool.events = pub.listener
    index = _disk_index()
    index.events = pub.listener
    pub.listener.disk = index
    gpu_tokens, disk_tokens = [1] * 8, [2] * 8
    _cache(pool, gpu_tokens)
    index.add(_disk_session("d", disk_tokens))
    pub.flush()
    time.sleep(0.1)
    while sub.poll(200):
        sub.recv_multipart()
    pub.resync(pool.cached_ext_blocks())
    _, _, batch = _recv(sub)
    assert [(e["type"], e.get("block_hashes"), e.get("medium")) for e in batch[1]] == [
        ("AllBlocksCleared", None, None),
        ("BlockStored", ext_block_hashes(gpu_tokens, BS), "GPU"),
        ("BlockStored", ext_block_hashes(disk_tokens, BS), "DISK")]
