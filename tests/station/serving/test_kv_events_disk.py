"""KV events of the disk tier, on the tiny model with real ZMQ sockets on loopback: the
sessions only the disk holds are published as medium DISK under the external hashes the
pool's GPU events use for the same tokens; a read-back publishes GPU and drops DISK; a
station restart sends AllBlocksCleared at seq 0, then exactly the disk sessions' blocks.

After every step the events received so far, applied as a router applies them (a set of
hashes per medium; AllBlocksCleared empties both), must equal the engine's state: GPU =
the pool's cached blocks, DISK = the blocks of the sessions in ``kv.disk``."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
import zmq.utils.monitor

from gnosis_daemon.settings import Settings
from station.core.block_pool import ext_block_hashes
from station.core.requests import Prefill
from station.engine.loop import PagedEngine
from station.tier.start import open_tier
from station.serving.kv_events import KVEventPublisher
from tests.station.tier.test_disk_tier import BS, TierEngine, tier_model
from tests.station.engine.test_paged_engine import prompt_of
from tests.support.procs import free_port

pytestmark = pytest.mark.usefixtures("few_threads")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tier_model(tmp_path_factory)


class EventEngine(TierEngine):
    """``TierEngine`` with a KV event publisher attached as the station attaches it:
    before the disk tier opens (``station.main._TorchThread``)."""

    def __init__(self, loaded, state, num_blocks: int, publisher: KVEventPublisher,
                 **overrides) -> None:
        self.settings = Settings(model=loaded.path, runtime_dir=str(state.parent / "rt"),
                                 state_dir=str(state), kv_block_size=BS, **overrides)
        self.engine = PagedEngine(loaded, self.settings, num_blocks=num_blocks)
        publisher.attach(self.engine)  # AllBlocksCleared
        self.report = open_tier(self.engine, self.settings)
        self.n = 0


class Router:
    """A SUB socket and the view a router builds from what it receives."""

    def __init__(self, ctx: zmq.Context, port: int) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        # A TCP connection is not enough: the publisher drops what it sends before the
        # ZMTP handshake (and the subscription after it) completes.
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.view: dict[str, set[int]] = {"GPU": set(), "DISK": set()}

    def connected(self, timeout_s: float = 10.0) -> None:
        """Wait for the SUB's (re)connection's handshake, then for its subscription. A SUB
        sends its subscription on a new connection only when its own thread next uses the
        socket (a router polls all the time): ``getsockopt`` is that use here."""
        assert self.monitor.poll(int(timeout_s * 1000)), "the SUB never connected"
        zmq.utils.monitor.recv_monitor_message(self.monitor)
        self.sub.getsockopt(zmq.EVENTS)
        time.sleep(0.2)

    def close(self) -> None:
        self.sub.disable_monitor()
        self.monitor.close(0)
        self.sub.close(0)

    def drain(self, pub: KVEventPublisher, quiet_ms: int = 300) -> list[tuple[int, list[dict]]]:
        """Every batch sent until the publisher is idle and nothing came for ``quiet_ms``:
        ``(seq, events)``, applied to ``view``."""
        pub.flush()
        batches = []
        while self.sub.poll(quiet_ms):
            _topic, seq, payload = self.sub.recv_multipart()
            _ts, events, _rank = msgpack.unpackb(payload)
            batches.append((int.from_bytes(seq, "big"), events))
            for e in events:
                if e["type"] == "AllBlocksCleared":
                    self.view = {"GPU": set(), "DISK": set()}
                elif e["type"] == "BlockStored":
                    assert e["parent_block_hash"] is None or \
                        e["parent_block_hash"] in self.view[e["medium"]], e  # parents first
                    assert len(e["token_ids"]) == len(e["block_hashes"]) * BS
                    self.view[e["medium"]].update(e["block_hashes"])
                else:
                    self.view[e["medium"]].difference_update(e["block_hashes"])
        return batches

    def check(self, engine: PagedEngine) -> None:
        """The view is the engine's state (read while the engine is idle)."""
        pool = {ext for ext, _, _ in engine.kv.pool.cached_ext_blocks()}
        disk = {ext for s in engine.kv.disk.sessions() for ext in ext_block_hashes(s.token_ids, BS)}
        assert self.view == {"GPU": pool, "DISK": disk}


def events_of(batches, medium: str, kind: str) -> list[dict]:
    return [e for _, events in batches for e in events
            if e["type"] == kind and e.get("medium") == medium]


def hashes(events) -> list[int]:
    return [h for e in events for h in e["block_hashes"]]


@pytest.fixture
def zmq_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def test_evicted_sessions_are_published_as_disk_and_a_read_back_as_gpu(tiny, tmp_path, zmq_ctx):
    _path, loaded = tiny
    port = free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", BS)
    router = Router(zmq_ctx, port)
    router.connected()
    prompts = [prompt_of(1200 + i, 23) for i in range(2)]
    try:
        # 16 blocks and one resident session: the second save sends the first to disk.
        with EventEngine(loaded, tmp_path / "state", 16, pub, kv_session_budget=1) as t:
            t.save_each(prompts, "alice.p", 4)
            batches = router.drain(pub)
            assert batches[0][0] == 0 and batches[0][1][0] == {"type": "AllBlocksCleared"}
            on_disk = t.engine.kv.disk.get("alice.p.0")
            assert on_disk is not None and len(t.engine.kv.disk) == 1
            exts = ext_block_hashes(on_disk.token_ids, BS)
            assert len(exts) == 5
            disk_stored = events_of(batches, "DISK", "BlockStored")
            assert hashes(disk_stored) == exts  # one chain, the session's blocks in order
            assert disk_stored[0]["parent_block_hash"] is None
            assert disk_stored[0]["token_ids"] == list(on_disk.token_ids)
            assert disk_stored[0]["block_size"] == BS
            gpu_stored = hashes(events_of(batches, "GPU", "BlockStored"))
            assert set(exts) <= set(gpu_stored)  # the same names the pool's events used
            assert not events_of(batches, "DISK", "BlockRemoved")
            router.check(t.engine)

            # Other prompts take the pool's free blocks: the disk session's cached copies go.
            for i in range(3):
                t.generate(prompt_of(1300 + i, 23), 4)
            router.drain(pub)
            router.check(t.engine)
            assert set(exts) <= router.view["DISK"] and not set(exts) & router.view["GPU"]

            hit = t.generate(prompts[0], 4, match_session=True)
            pre = hit.one(Prefill)
            assert (pre.session_loaded, pre.session_id, pre.session_tier) == (True, "alice.p.0", "disk")
            batches = router.drain(pub)
            stream = [(e["type"], e.get("medium"), h) for _, events in batches for e in events
                      for h in e.get("block_hashes", [])]
            removed_at = [i for i, (k, m, h) in enumerate(stream)
                          if (k, m) == ("BlockRemoved", "DISK") and h in exts]
            stored_at = [i for i, (k, m, h) in enumerate(stream)
                         if (k, m) == ("BlockStored", "GPU") and h in exts]
            assert sorted(stream[i][2] for i in removed_at) == sorted(exts)
            assert sorted(stream[i][2] for i in stored_at) == sorted(exts)
            assert max(stored_at) < min(removed_at)  # GPU before DISK goes: never neither
            # Loading it back expired the other session (budget 1) to disk: DISK now.
            assert t.engine.kv.disk.get("alice.p.1") is not None
            router.check(t.engine)
    finally:
        router.close()
        pub.close()


def test_a_restart_sends_cleared_at_seq_0_then_exactly_the_disk_sessions(tiny, tmp_path, zmq_ctx):
    _path, loaded = tiny
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    prompts = [prompt_of(1400 + i, 23) for i in range(3)]
    # Two sessions share a prefix: their common blocks are one router block each.
    prompts.append(prompts[0][:12] + prompt_of(1500, 11))
    pub = KVEventPublisher(endpoint, BS)
    router = Router(zmq_ctx, port)
    router.connected()
    try:
        with EventEngine(loaded, tmp_path / "state", 64, pub) as t:
            for i, prompt in enumerate(prompts):
                t.generate(prompt, 3, save_session=f"alice.p.{i}")
            saved = {f"alice.p.{i}": t.engine.kv.sessions.get(f"alice.p.{i}").token_ids
                     for i in range(len(prompts))}
        before = router.drain(pub)
        assert before and not events_of(before, "DISK", "BlockStored")  # all resident
        pub.close()

        # The station again, on the same state dir and endpoint; the router stays connected.
        pub = KVEventPublisher(endpoint, BS)
        router.connected()  # the router's SUB reconnects and subscribes again (the station
        # binds before it loads the model: a router reconnects meanwhile)
        with EventEngine(loaded, tmp_path / "state", 64, pub) as t:
            assert t.report["start_sessions"] == len(prompts)
            batches = router.drain(pub)
            assert batches[0][0] == 0  # a new sequence: vllm-router clears this replica
            seqs = [seq for seq, _ in batches]
            assert seqs == list(range(len(seqs)))
            events = [e for _, evs in batches for e in evs]
            assert events[0] == {"type": "AllBlocksCleared"}
            assert all(e["type"] == "BlockStored" and e["medium"] == "DISK" for e in events[1:])
            expected = {ext for tokens in saved.values() for ext in ext_block_hashes(tokens, BS)}
            published = hashes(events[1:])
            assert sorted(published) == sorted(expected)  # each shared block once
            assert len(published) == 4 * 5 - 3  # 5 blocks a session, 3 shared
            router.check(t.engine)

            hit = t.generate(prompts[3], 4, match_session=True)
            assert hit.one(Prefill).session_tier == "disk"
            batches = router.drain(pub)
            gone = hashes(events_of(batches, "DISK", "BlockRemoved"))
            mine = ext_block_hashes(saved["alice.p.3"], BS)
            assert sorted(gone) == sorted(mine[3:])  # its shared blocks: alice.p.0 names them
            router.check(t.engine)
    finally:
        router.close()
        pub.close()
