"""KV cache events for token-aware routers, in vLLM's wire format (``kv_events_endpoint``).

What a router (vllm-router's ``kv_aware``, llm-d's precise prefix-cache scorer) needs is
which token prefixes each replica holds in its prefix cache. The station's own block hashes
cannot serve: they chain sha256 over the model fingerprint and a salted tenant digest, which
no router can compute. So every cached block also gets an **external hash**
(``ext_block_hash``), a chain over token ids alone, and that is what the events name:

    ext(block 0) = H(None, tokens[0:B]); ext(block i) = H(ext(block i-1), tokens[iB:(i+1)B])
    H(parent, tokens) = int.from_bytes(sha256(b"gnosis-kv-v1" + (parent or 0).to_bytes(8,
        "big") + b"".join(t.to_bytes(4, "little") for t in tokens)).digest()[:8], "big")
        & (2**63 - 1)

B is ``kv_block_size``. Routers read ``token_ids`` and recompute their own keys from them
(vllm-router: sha256 of each block's u32 little-endian ids; llm-d: its FNV/CBOR chain); the
external hashes are the keys that link a block to its parent and name it in BlockRemoved.

Tenancy: the external hash has no tenant, so the same tokens cached by two tenants are one
router block. The listener counts the station blocks behind each external hash: BlockStored
when the first is cached, BlockRemoved when the last is evicted. A request routed here by a
block another tenant cached misses (the station's cache is per tenant) and caches its own.

Threads: ``Listener`` methods run on the engine thread, inside the pool's bookkeeping, and
only count, build a tuple and ``put_nowait`` it; the sender thread encodes and sends. A full
queue drops the event and counts it; the sender then asks the engine for a re-sync
(AllBlocksCleared, then BlockStored for every cached block), which the engine builds at its
next step boundary, so a router never keeps a stale view without being told.

Wire (checked against vllm-router 0.1.17, ``src/kv_index/wire.rs`` and ``subscriber.rs``):
ZMQ PUB multipart ``[topic, seq (8-byte big-endian), payload]``; payload is msgpack
``[ts, [event, ...], data_parallel_rank]`` (vLLM's ``EventBatch``, positional), each event a
map tagged ``"type"`` (vLLM's msgspec structs, ``tag=True``)::

    {"type": "BlockStored", "block_hashes": [int], "parent_block_hash": int | None,
     "token_ids": [int], "block_size": int, "lora_id": None, "medium": "GPU",
     "lora_name": None}
    {"type": "BlockRemoved", "block_hashes": [int], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

The disk tier (``medium: "DISK"``): the blocks of the sessions only the disk holds (the
``DiskSession``s of ``KVCacheManager.disk``) are published too, named by the same external
hashes the pool's events use for the same tokens. ``DiskSessions`` tells the listener of
every session that joins or leaves that index (the tier's index at start, an eviction to
disk, a late write-behind, a shared tier's rescan; a read-back, a delete, the disk budget's
evictions); the listener counts the disk sessions naming each external hash: DISK
BlockStored when it goes 0 -> 1, DISK BlockRemoved when 1 -> 0. Independent of the pool: a
block both hold is published as GPU and as DISK, because vllm-router keeps one claim per
(replica, tier) and matches each tier's prefix from the first block (``kv_index/indexer.rs``
``find_matches``): withdrawing DISK for the blocks the pool also holds would cut the disk
tier's chains at their first block. vllm-router 0.1.17 maps ``medium`` case-insensitively:
GPU / DEVICE -> device, CPU / HOST / HOST_PINNED -> host, DISK / STORAGE -> disk (scored
with ``--kv-penalty-disk``); anything else is refused or read as the device.
AllBlocksCleared clears every tier of the replica in the router, so every clear (the
publisher's attach at start, a pool reset, a re-sync) is followed by the DISK set again.

The replay socket (``kv_events_replay_endpoint``, ZMQ ROUTER) answers a request
``[identity, b"", start_seq (8 bytes big-endian)]`` with every kept batch from ``start_seq``
as ``[identity, b"", seq, payload]``, then ``[identity, b"", -1 (8 bytes, signed), b""]``,
as vLLM's ``ZmqEventPublisher`` does.

Who reads them: the token ids are every tenant's prompts. With CURVE keys configured
(``gnosis_daemon.kv_event_keys``) both sockets are CURVE servers that let in only the
configured client keys (``kv_events_auth``); with API keys and no CURVE the settings refuse
any endpoint but a loopback one.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter, deque
from typing import Any, Callable, Iterable, Sequence

import msgpack

from gnosis_daemon.kv_event_keys import CurveKeys, load_curve_keys
from gnosis_daemon.logs import get_logger
from station.core.block_pool import ext_block_hashes
from station.serving import kv_events_auth

log = get_logger(__name__)

MEDIUM = "GPU"  # vLLM's name for the KV pool tier, whatever the device (CPU pools included)
DISK = "DISK"  # the disk tier's sessions (vllm-router: its disk tier, ``--kv-penalty-disk``)
END_SEQ = (-1).to_bytes(8, "big", signed=True)

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"


def encode_batch(events: Iterable[tuple], block_size: int, ts: float | None = None,
                 dp_rank: int = 0) -> bytes:
    """msgpack of one ``KVEventBatch`` of queued events ``(kind, hashes, parent, tokens[,
    medium])`` (no medium: the pool's, GPU)."""
    body: list[dict[str, Any]] = []
    for event in events:
        kind, hashes, parent, tokens = event[:4]
        medium = _medium(event)
        if kind == STORED:
            body.append({"type": STORED, "block_hashes": list(hashes),
                         "parent_block_hash": parent, "token_ids": list(tokens),
                         "block_size": block_size, "lora_id": None, "medium": medium,
                         "lora_name": None})
        elif kind == REMOVED:
            body.append({"type": REMOVED, "block_hashes": list(hashes), "medium": medium})
        else:
            body.append({"type": CLEARED})
    return msgpack.packb([time.time() if ts is None else ts, body, dp_rank])


def coalesce(events: list[tuple]) -> list[tuple]:
    """Merge runs the way vLLM sends them: consecutive stores of one chain (one medium)
    become one BlockStored, consecutive removals of one medium one BlockRemoved. Order is
    kept; every event comes out with its medium, ``(kind, hashes, parent, tokens, medium)``."""
    out: list[tuple] = []
    for ev in events:
        last = out[-1] if out else None
        medium = _medium(ev)
        if last is not None and last[4] != medium:
            last = None
        if last is not None and ev[0] == last[0] == STORED and ev[2] == last[1][-1]:
            out[-1] = (STORED, last[1] + list(ev[1]), last[2], last[3] + tuple(ev[3]), medium)
        elif last is not None and ev[0] == last[0] == REMOVED:
            out[-1] = (REMOVED, last[1] + list(ev[1]), None, (), medium)
        else:
            out.append((ev[0], list(ev[1]), ev[2], tuple(ev[3]), medium))
    return out


def _medium(event: tuple) -> str:
    return event[4] if len(event) > 4 else MEDIUM


class Listener:
    """The pool's and the disk index's view of the publisher (engine thread only): counts
    the station blocks behind each external hash (GPU) and the disk sessions naming it
    (DISK), and queues an event when one appears or disappears."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        self._pub = publisher
        self.counts: Counter[int] = Counter()
        self.disk_counts: Counter[int] = Counter()
        self.disk: Any = None  # the ``DiskSessions`` published as DISK (``attach``)

    def stored(self, ext: int, parent: int | None, token_ids: Sequence[int]) -> None:
        self.counts[ext] += 1
        if self.counts[ext] == 1:
            self._pub.put((STORED, (ext,), parent, tuple(token_ids)))

    def removed(self, ext: int) -> None:
        n = self.counts[ext] - 1
        if n > 0:
            self.counts[ext] = n
            return
        self.counts.pop(ext, None)
        self._pub.put((REMOVED, (ext,), None, ()))

    def cleared(self) -> None:
        """The pool was reset (or is new): AllBlocksCleared, which a router applies to every
        tier of this replica, so the disk sessions' blocks follow it again."""
        self.counts.clear()
        # One queue item however large the disk index (a restart's): ``resync``'s form.
        self._pub.put(("resync", [(CLEARED, (), None, ()), *self.disk_snapshot()]))

    # -- the disk tier (``DiskSessions.events``)
    def disk_added(self, session: Any) -> None:
        """A session joined the disk index: DISK BlockStored for its blocks no other disk
        session names (one event per run of them, in chain order, parent given)."""
        for event in self._disk_add(session, self.disk_counts):
            self._pub.put(event)

    def disk_removed(self, session: Any) -> None:
        """A session left the disk index: DISK BlockRemoved for the blocks it alone named."""
        gone = []
        for ext in self._disk_exts(session):
            n = self.disk_counts[ext] - 1
            if n > 0:
                self.disk_counts[ext] = n
            else:
                self.disk_counts.pop(ext, None)
                gone.append(ext)
        if gone:
            self._pub.put((REMOVED, tuple(gone), None, (), DISK))

    def disk_snapshot(self) -> list[tuple]:
        """Recount the disk index from scratch: the DISK BlockStored events of all of it,
        parents before children (after an AllBlocksCleared)."""
        self.disk_counts.clear()
        events: list[tuple] = []
        for session in self.disk.sessions() if self.disk is not None else ():
            events.extend(self._disk_add(session, self.disk_counts))
        return events

    def _disk_add(self, session: Any, counts: Counter[int]) -> list[tuple]:
        exts = self._disk_exts(session)
        bs = self._pub.block_size
        events: list[tuple] = []
        start = None  # the first block of the current run of newly named blocks
        for i, ext in enumerate((*exts, None)):
            new = ext is not None and counts[ext] == 0
            if ext is not None:
                counts[ext] += 1
            if new and start is None:
                start = i
            elif not new and start is not None:
                events.append((STORED, exts[start:i], exts[start - 1] if start else None,
                               tuple(session.token_ids[start * bs:i * bs]), DISK))
                start = None
        return events

    def _disk_exts(self, session: Any) -> tuple[int, ...]:
        """The session's external hashes, the pool's for the same tokens (kept on it)."""
        if session.ext_hashes is None:
            session.ext_hashes = tuple(ext_block_hashes(session.token_ids, self._pub.block_size))
        return session.ext_hashes


class KVEventPublisher:
    """ZMQ PUB (and optional ROUTER replay) sender thread fed by ``Listener``."""

    def __init__(self, endpoint: str, block_size: int, *, replay_endpoint: str = "",
                 max_queue: int = 10000, buffer_steps: int = 10000, topic: str = "",
                 max_batch: int = 1024, curve: CurveKeys | None = None) -> None:
        import zmq  # only a station that publishes needs pyzmq loaded

        self.block_size = block_size
        self.listener = Listener(self)
        self._queue: queue.Queue[tuple] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._topic = topic.encode()
        self._max_batch = max_batch
        self._seq = 0
        self._lock = threading.Lock()
        self.dropped = 0  # events the full queue refused
        self.resyncs = 0
        self.batches_sent = 0
        self._resync_wanted = False  # set by ``put`` on a drop, taken by the engine
        self.request_resync: Callable[[], None] = lambda: None  # the engine's wake-up
        self._ctx = zmq.Context()
        # CURVE: the ZAP handler runs before the first bind (kv_events_auth)
        self._auth = kv_events_auth.start_authenticator(self._ctx, curve) if curve else None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        if curve:
            for sock in filter(None, (self._pub, self._replay)):
                kv_events_auth.secure(sock, curve)
        self._pub.bind(endpoint)
        if self._replay is not None:
            self._replay.bind(replay_endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("kv_events_publishing", endpoint=endpoint, replay_endpoint=replay_endpoint or None,
                 block_size=block_size, curve=curve is not None)

    def attach(self, engine: Any) -> None:
        """Publish ``engine``'s prefix-cache and disk-index changes (before it starts): a
        new pool, so AllBlocksCleared first, then the disk sessions it already has (the
        station attaches before ``open_tier``: those then follow as the tier opens)."""
        engine.kv_events = self
        self.request_resync = engine._wake
        engine.kv.pool.events = self.listener
        engine.kv.disk.events = self.listener
        self.listener.disk = engine.kv.disk
        self.listener.cleared()

    # -- engine thread
    def put(self, event: tuple) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            with self._lock:
                self.dropped += 1
                first = not self._resync_wanted
                self._resync_wanted = True
            if first:
                log.warning("kv_events_dropped", queue=self._queue.maxsize)
                self.request_resync()

    @property
    def resync_wanted(self) -> bool:
        return self._resync_wanted

    def resync(self, cached: Iterable[tuple[int, int | None, Sequence[int]]]) -> None:
        """Engine thread, at a step boundary: AllBlocksCleared, then one BlockStored per
        cached block ``(ext, parent_ext, token_ids)`` in chain order, then the disk index's
        blocks (DISK), as one item the queue always takes (the queued events it replaces
        are dropped first)."""
        with self._lock:
            self._resync_wanted = False
        self.listener.counts.clear()
        events: list[tuple] = [(CLEARED, (), None, ())]
        for ext, parent, tokens in cached:
            self.listener.counts[ext] += 1
            if self.listener.counts[ext] == 1:
                events.append((STORED, (ext,), parent, tuple(tokens)))
        events.extend(self.listener.disk_snapshot())
        while True:  # what is queued is older than this snapshot: drop it, keep order
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(("resync", events))
        self.resyncs += 1

    # -- sender thread
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # noqa: BLE001 - replay is best effort
                    log.exception("kv_events_replay_failed")
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            pending = [first]
            while len(pending) < self._max_batch:
                try:
                    pending.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            events: list[tuple] = []
            for item in pending:
                if item[0] == "resync":
                    events.extend(item[1])
                else:
                    events.append(item)
            try:
                self._send(coalesce(events))
            except Exception:  # noqa: BLE001 - the publisher must not die
                log.exception("kv_events_send_failed")

    def _send(self, events: list[tuple]) -> None:
        for i in range(0, len(events), self._max_batch):
            payload = encode_batch(events[i:i + self._max_batch], self.block_size)
            seq = self._seq
            self._seq += 1
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.batches_sent += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def flush(self, timeout: float = 2.0) -> None:
        """Wait until the queue is empty (tests, clean stop)."""
        deadline = time.monotonic() + timeout
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.flush(1.0)
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._pub.close(linger=200)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def stats(self) -> dict[str, Any]:
        return {"kv_events_batches": self.batches_sent, "kv_events_dropped": self.dropped,
                "kv_events_resyncs": self.resyncs, "kv_events_queued": self._queue.qsize()}


def start_publisher(settings: Any) -> KVEventPublisher | None:
    """The publisher ``kv_events_endpoint`` asks for (None when empty: no events)."""
    if not settings.kv_events_endpoint:
        return None
    return KVEventPublisher(settings.kv_events_endpoint, settings.kv_block_size,
                            replay_endpoint=settings.kv_events_replay_endpoint,
                            max_queue=settings.kv_events_queue,
                            buffer_steps=settings.kv_events_buffer_steps,
                            curve=load_curve_keys(settings))
