"""The KV store (``station.tier.store.store``) as pure file I/O on small random tensors:
round trips, shared prefixes stored once, an index rebuilt from names alone, every kind
of bad file quarantined intact and counted, crash leftovers, and LRU eviction that never
drops a block a live session names."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from station.core.block_pool import block_hashes_for
from station.tier import format as kv_store_format
from station.tier.store.store import Evicted, KVStore, Missing, Quarantined, StoreBusy
from station.tier.format import BLOCK_MAGIC, SESSION_MAGIC, _pack, block_relpath, \
    session_name

REPO = Path(__file__).resolve().parents[3]
FP = "fp-0123456789abcdef"
BS = 4
SHAPE = (2, 2, BS, 2, 3)  # [L, 2, block_size, H, D]
KEYS = (FP, "tenant-digest")


def open_store(root: Path, fingerprint: str = FP, block_size: int = BS,
               shape: tuple[int, ...] = SHAPE, dtype: torch.dtype = torch.float32,
               budget: int = 10**9, shared: bool = False) -> KVStore:
    return KVStore(root, fingerprint, block_size, shape, dtype, budget, shared=shared)


def tokens_of(seed: int, n_blocks: int) -> list[int]:
    return random.Random(seed).choices(range(1000), k=n_blocks * BS)


def put(store: KVStore, session_id: str, tokens: list[int], last_used: float = 1.0,
        tenant: str = "t") -> list[bytes]:
    """Write a session's blocks, then its manifest, as the writer thread will."""
    bs = store.layout.block_size
    hashes = block_hashes_for(tokens, bs, KEYS)
    for i, h in enumerate(hashes):
        store.write_block(h, tokens[i * bs:(i + 1) * bs], kv_for(h, store.layout.dtype))
    store.write_session(session_id, tenant, tokens, hashes, last_used)
    store.sync_dirs()
    return hashes


def kv_for(block_hash: bytes, dtype: torch.dtype = torch.float32,
           shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    """A block's KV, a function of its hash (so a test can check what it reads)."""
    gen = torch.Generator().manual_seed(int.from_bytes(block_hash[:6], "little"))
    return torch.randn(shape, generator=gen).to(dtype)


def block_file(store: KVStore, block_hash: bytes) -> Path:
    return store.blocks_dir / block_relpath(block_hash)


def block_files(root: Path) -> list[Path]:
    return sorted((root / "blocks").rglob("*.kvb"))


def quarantined_files(root: Path) -> list[Path]:
    return sorted((root / "quarantine").iterdir())


@pytest.fixture
def store(tmp_path):
    with open_store(tmp_path / "kv") as s:
        yield s


# -- round trips
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_round_trip_bit_for_bit_across_a_reopen(tmp_path, dtype):
    with open_store(tmp_path, dtype=dtype) as store:
        tokens = tokens_of(1, 3)
        hashes = put(store, "s", tokens)
    with open_store(tmp_path, dtype=dtype) as store:
        for i, h in enumerate(hashes):
            got = store.read_block(h, tokens[i * BS:(i + 1) * BS])
            assert got.dtype == dtype and tuple(got.shape) == SHAPE
            assert torch.equal(got.view(torch.uint8), kv_for(h, dtype).view(torch.uint8))
        assert store.stats()["reads"] == 3


def test_the_io_process_path_moves_raw_bytes_without_torch(tmp_path):
    """The tier's I/O process names the dtype (``DTypeName``) and moves a block's bytes:
    in a process that never imports torch, its files read back as the tensors written
    here, and what it reads back are those tensors' bytes, bit for bit (bfloat16 too)."""
    dtype = torch.bfloat16
    with open_store(tmp_path, dtype=dtype) as store:
        tokens = tokens_of(2, 2)
        hashes = put(store, "from-tensors", tokens)
    script = textwrap.dedent(f"""
        import sys
        import numpy
        import station.tier.io.worker  # what the I/O process imports
        from station.tier.store.store import KVStore
        from station.tier.dtype import DTypeName
        from station.core.block_pool import block_hashes_for
        tokens = {tokens!r}
        with KVStore(sys.argv[1], {FP!r}, {BS}, {SHAPE!r}, DTypeName("torch.bfloat16", 2), 10**9) as store:
            hashes = block_hashes_for(tokens, {BS}, {KEYS!r})
            for i, h in enumerate(hashes):
                raw = store.read_block(h, tokens[i * {BS}:(i + 1) * {BS}], raw=True)
                assert raw.dtype == numpy.uint8 and raw.size == store.layout.payload_bytes
                sys.stdout.write("block " + raw.tobytes().hex() + "\\n")
            # written back from raw bytes (reversed), as the writer thread does
            out = list(reversed(tokens))
            again = block_hashes_for(out, {BS}, {KEYS!r})
            for i, h in enumerate(again):
                raw = numpy.frombuffer(bytes(range(256)) * 2, dtype=numpy.uint8)[:store.layout.payload_bytes]
                store.write_block(h, out[i * {BS}:(i + 1) * {BS}], raw.copy())
            store.write_session("from-bytes", "t", out, again, 2.0)
        assert "torch" not in sys.modules, "the I/O process's path imported torch"
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("block ")]
    assert lines == [kv_for(h, dtype).view(torch.uint8).numpy().tobytes().hex() for h in hashes]
    with open_store(tmp_path, dtype=dtype) as store:
        assert [r.session_id for r in store.load_sessions()] == ["from-tensors", "from-bytes"]
        out = list(reversed(tokens))
        for i, h in enumerate(block_hashes_for(out, BS, KEYS)):
            got = store.read_block(h, out[i * BS:(i + 1) * BS])
            assert got.dtype == dtype and tuple(got.shape) == SHAPE
            assert got.view(torch.uint8).flatten().tolist() == (list(range(256)) * 2)[:got.numel() * 2]
    with pytest.raises(ValueError, match="raw bytes"):  # a wrong length is refused
        with open_store(tmp_path, dtype=dtype) as store:
            store.write_block(block_hashes_for(tokens_of(3, 1), BS, KEYS)[0], tokens_of(3, 1),
                              torch.zeros(7, dtype=torch.uint8).numpy())


def test_sessions_round_trip_least_recently_used_first(tmp_path):
    with open_store(tmp_path) as store:
        a = put(store, "conv-a", tokens_of(1, 2), last_used=20.5, tenant="alice")
        b = put(store, "conv-b", tokens_of(2, 1), last_used=10.25, tenant="bob")
        stats = store.stats()
        assert stats["writes"] == 5 and stats["sessions"] == 2 and stats["blocks"] == 3
    with open_store(tmp_path) as store:
        records = store.load_sessions()
        assert [(r.session_id, r.tenant, list(r.token_ids), list(r.block_hashes), r.last_used)
                for r in records] == [("conv-b", "bob", tokens_of(2, 1), b, 10.25),
                                      ("conv-a", "alice", tokens_of(1, 2), a, 20.5)]
        assert all(r.saved_at > 0 for r in records)
        assert store.has_session("conv-a") and store.count_present(a + [bytes(32)] + b) == 2
        assert store.stats()["bytes"] == sum(p.stat().st_size for p in tmp_path.rglob("*.kv[bs]"))


def test_files_are_private_and_named_by_hash(store):
    hashes = put(store, "secret-session-name", tokens_of(1, 1))
    root = store.root
    for d in (root, root / "blocks", root / "sessions", root / "quarantine",
              block_file(store, hashes[0]).parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    files = [p for p in root.rglob("*") if p.is_file()]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    assert block_file(store, hashes[0]) == root / "blocks" / hashes[0].hex()[:2] / f"{hashes[0].hex()}.kvb"
    assert not any("secret" in str(p) for p in files)  # manifests are named by a digest


def test_a_shared_prefix_is_stored_once(store):
    prefix = tokens_of(1, 3)
    a = put(store, "a", prefix + tokens_of(2, 1))
    b = put(store, "b", prefix + tokens_of(3, 2))
    assert a[:3] == b[:3]
    assert len(block_files(store.root)) == 4 + 2
    assert store.stats()["blocks"] == 6
    assert store.write_block(a[0], prefix[:BS], kv_for(a[0])) is False  # present: skipped


# -- the index at open
def test_reopen_indexes_names_without_reading_blocks(tmp_path, monkeypatch):
    with open_store(tmp_path) as store:
        tokens = tokens_of(1, 2)
        hashes = put(store, "s", tokens)
    path = block_file(store, hashes[1])
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x01  # a payload byte
    path.write_bytes(bytes(data))
    calls = []
    real = kv_store_format.decode_block
    monkeypatch.setattr("station.tier.store.store.decode_block",
                        lambda *a: calls.append(a) or real(*a))
    with open_store(tmp_path) as store:
        assert calls == []  # the open looked at names only
        assert store.has_block(hashes[1]) and store.stats()["quarantined_total"] == 0
        assert [r.session_id for r in store.load_sessions()] == ["s"]
        with pytest.raises(Quarantined) as exc:
            store.read_block(hashes[1], tokens[BS:])
        assert exc.value.reason == "checksum" and len(calls) == 1
        assert not store.has_block(hashes[1])


def test_temp_files_left_by_a_crash_are_removed_unread(tmp_path):
    with open_store(tmp_path) as store:
        hashes = put(store, "s", tokens_of(1, 1))
    path = block_file(store, hashes[0])
    torn = path.with_name(f".{path.name}.0123abcd.tmp")
    torn.write_bytes(path.read_bytes()[:50])
    (tmp_path / "sessions" / f".{session_name('t')}.99.tmp").write_bytes(b"half a manifest")
    with open_store(tmp_path) as store:
        assert not torn.exists() and not list((tmp_path / "sessions").glob("*.tmp"))
        stats = store.stats()
        assert stats["tmp_removed"] == 2 and stats["quarantined_total"] == 0
        assert stats["blocks"] == 1 and stats["sessions"] == 1


def test_a_failed_write_leaves_no_file_and_no_entry(store, monkeypatch):
    h = block_hashes_for(tokens_of(1, 1), BS, KEYS)[0]

    def crash(*_):
        raise OSError("disk full")
    monkeypatch.setattr(kv_store_format.os, "replace", crash)
    with pytest.raises(OSError):
        store.write_block(h, tokens_of(1, 1), kv_for(h))
    assert not store.has_block(h) and store.stats()["pending_blocks"] == 0
    assert not [p for p in store.blocks_dir.rglob("*") if p.is_file()]


def test_a_sigkilled_writer_leaves_only_whole_files(tmp_path):
    script = textwrap.dedent(f"""
        import sys, torch
        from station.tier.store.store import KVStore
        from station.core.block_pool import block_hashes_for
        store = KVStore(sys.argv[1], {FP!r}, {BS}, {SHAPE!r}, torch.float32, 10**9)
        n = 0
        while True:
            tokens = list(range(n, n + 8 * {BS}))
            hashes = block_hashes_for(tokens, {BS}, ())
            for i, h in enumerate(hashes):
                store.write_block(h, tokens[i * {BS}:(i + 1) * {BS}], torch.randn({SHAPE!r}))
            store.write_session(f"s{{n}}", "t", tokens, hashes, float(n))
            if n == 0:
                print("ready", flush=True)  # one session is whole: kill at any point now
            n += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=REPO,
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        lines = iter(proc.stdout.readline, b"")  # the store's log lines come first
        assert any(line == b"ready\n" for line in lines)
        time.sleep(random.uniform(0.05, 0.3))
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    with open_store(tmp_path) as store:
        records = store.load_sessions()
        assert records and store.stats()["quarantined_total"] == 0
        for record in records:
            for i, h in enumerate(record.block_hashes):
                store.read_block(h, record.token_ids[i * BS:(i + 1) * BS])
        assert not list(tmp_path.rglob("*.tmp"))


def test_a_second_store_on_the_same_root_is_refused(tmp_path):
    with open_store(tmp_path):
        with pytest.raises(StoreBusy):
            open_store(tmp_path)
    open_store(tmp_path).close()


# -- bad files
def _foreign_block(tmp_path: Path, block_hash: bytes, tokens: list[int], **layout) -> bytes:
    """The bytes another store (another model or layout) writes for ``block_hash``."""
    other = open_store(tmp_path / "other", **layout)
    try:
        dtype, shape = other.layout.dtype, other.layout.shape
        block_tokens = (tokens * 2)[:other.layout.block_size]
        other.write_block(block_hash, block_tokens, kv_for(block_hash, dtype, shape))
        return block_file(other, block_hash).read_bytes()
    finally:
        other.close()


def _corrupt(kind: str, data: bytes, tmp_path: Path, h: bytes, tokens: list[int]) -> bytes:
    if kind == "checksum":
        return data[:-100] + bytes([data[-100] ^ 0x40]) + data[-99:]  # a payload byte
    if kind == "truncated":
        return data[:len(data) // 2]
    if kind == "magic":
        return b"NOTMAGIC" + data[8:]
    if kind == "version":
        return data[:8] + (2).to_bytes(2, "little") + data[10:]
    if kind == "fingerprint":
        return _foreign_block(tmp_path, h, tokens, fingerprint="another-model")
    if kind == "block_size":
        return _foreign_block(tmp_path, h, tokens, block_size=8)
    if kind == "shape":
        return _foreign_block(tmp_path, h, tokens, shape=(2, 2, BS, 4, 3))
    if kind == "dtype":
        return _foreign_block(tmp_path, h, tokens, dtype=torch.bfloat16)
    if kind == "header":
        return _pack_file(BLOCK_MAGIC, {"fingerprint": FP, "block_size": BS, "shape": "big"})
    raise AssertionError(kind)


def _pack_file(magic: bytes, header: dict, payload: bytes = b"") -> bytes:
    """A file with a VALID checksum around whatever header: the field checks alone decide."""
    return b"".join(bytes(p) for p in _pack(magic, header, payload))


@pytest.mark.parametrize("kind", ["checksum", "truncated", "magic", "version", "fingerprint",
                                  "block_size", "shape", "dtype", "header"])
def test_a_bad_block_file_is_quarantined_intact_and_counted(tmp_path, kind):
    root = tmp_path / "kv"
    with open_store(root) as store:
        tokens = tokens_of(1, 2)
        hashes = put(store, "s", tokens)
    path = block_file(store, hashes[1])
    bad = _corrupt(kind, path.read_bytes(), tmp_path, hashes[1], tokens[BS:])
    path.write_bytes(bad)
    with open_store(root) as store:
        store.read_block(hashes[0], tokens[:BS])  # its neighbour is fine
        with pytest.raises(Quarantined) as exc:
            store.read_block(hashes[1], tokens[BS:])
        assert exc.value.reason == kind
        moved = exc.value.moved_to
        assert quarantined_files(root) == [moved]
        assert re.fullmatch(re.escape(path.name) + r"\.\d{8}T\d{6}Z", moved.name)
        assert moved.read_bytes() == bad and not path.exists()
        stats = store.stats()
        assert stats["quarantined"] == {kind: 1} and stats["quarantined_total"] == 1
        assert not store.has_block(hashes[1]) and store.count_present(hashes) == 1
        with pytest.raises(Missing):
            store.read_block(hashes[1], tokens[BS:])


def test_a_block_under_another_name_or_with_other_tokens_is_quarantined(store):
    tokens = tokens_of(1, 2)
    hashes = put(store, "s", tokens)
    block_file(store, hashes[1]).write_bytes(block_file(store, hashes[0]).read_bytes())
    with pytest.raises(Quarantined) as exc:
        store.read_block(hashes[1], tokens[BS:])
    assert exc.value.reason == "name"
    with pytest.raises(Quarantined) as exc:
        store.read_block(hashes[0], tokens[BS:])  # the caller's tokens are not the file's
    assert exc.value.reason == "tokens"
    assert store.stats()["quarantined"] == {"name": 1, "tokens": 1}
    assert len(quarantined_files(store.root)) == 2


def _other_session_file(tmp_path: Path, **layout) -> bytes:
    with open_store(tmp_path / "other", **layout) as other:
        tokens = tokens_of(9, 1) * (other.layout.block_size // BS)
        put(other, "victim", tokens)
        return (other.sessions_dir / session_name("victim")).read_bytes()


@pytest.mark.parametrize("kind, reason", [
    ("flip", "checksum"), ("cut", "truncated"), ("fingerprint", "fingerprint"),
    ("block_size", "block_size"), ("block file", "magic"), ("renamed", "name"),
    ("too few tokens", "header")])
def test_a_bad_session_manifest_is_quarantined_at_open(tmp_path, kind, reason):
    root = tmp_path / "kv"
    with open_store(root) as store:
        put(store, "keep", tokens_of(1, 1))
        hashes = put(store, "victim", tokens_of(2, 2))
    path = root / "sessions" / session_name("victim")
    data = path.read_bytes()
    bad = {"flip": lambda: data[:30] + bytes([data[30] ^ 1]) + data[31:],
           "cut": lambda: data[:-5],
           "fingerprint": lambda: _other_session_file(tmp_path, fingerprint="another-model"),
           "block_size": lambda: _other_session_file(tmp_path, block_size=8),
           "block file": lambda: block_file(store, hashes[0]).read_bytes(),
           "renamed": lambda: (root / "sessions" / session_name("keep")).read_bytes(),
           "too few tokens": lambda: _pack_file(SESSION_MAGIC, {
               "fingerprint": FP, "block_size": BS, "session_id": "victim", "tenant": "t",
               "token_ids": [1, 2], "block_hashes": [hashes[0].hex()], "last_used": 1.0,
               "saved_at": 1.0})}[kind]()
    path.write_bytes(bad)
    with open_store(root) as store:
        assert [r.session_id for r in store.load_sessions()] == ["keep"]
        stats = store.stats()
        assert stats["quarantined"] == {reason: 1} and stats["sessions"] == 1
        [moved] = quarantined_files(root)
        assert moved.name.startswith(path.name + ".") and moved.read_bytes() == bad
        # The victim's blocks are orphans now: the next eviction collects them.
        assert set(store.evict_to_budget().blocks) == set(hashes)


def test_stray_files_are_quarantined_as_misnamed(tmp_path):
    with open_store(tmp_path) as store:
        h = put(store, "s", tokens_of(1, 1))[0]
    sub = block_file(store, h).parent
    (sub / "notes.txt").write_text("hello")
    (tmp_path / "blocks" / "zz").mkdir()
    (tmp_path / "sessions" / "x.kvs").write_text("?")
    os.symlink(block_file(store, h), sub / f"{'0' * 64}.kvb")  # also in the wrong fan-out dir
    with open_store(tmp_path) as store:
        assert store.stats()["quarantined"] == {"name": 4}
        assert store.stats()["blocks"] == 1 and len(quarantined_files(tmp_path)) == 4


def test_random_corruptions_only_ever_raise_quarantined(tmp_path):
    rng = random.Random(1234)
    with open_store(tmp_path) as store:
        tokens = tokens_of(1, 1)
        h = put(store, "s", tokens)[0]
    paths = {BLOCK_MAGIC: block_file(store, h), SESSION_MAGIC: store.sessions_dir / session_name("s")}
    good = {magic: path.read_bytes() for magic, path in paths.items()}
    junk = [None, True, [], {}, [1.5], ["zz"], [-3]]  # wrong for every field
    for n in range(120):
        magic = BLOCK_MAGIC if n % 2 else SESSION_MAGIC
        data = bytearray(good[magic])
        kind = n // 2 % 4
        if kind == 0:  # flip a few bits anywhere
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind == 1:  # cut, or grow
            data = data[:rng.randrange(len(data))] if rng.random() < 0.7 else data + b"\0" * 3
        elif kind == 2:  # noise
            data = bytearray(rng.randbytes(rng.randrange(200)))
        else:  # a valid checksum around a header with one field made wrong
            start = 14 + int.from_bytes(data[10:14], "little")
            header = json.loads(bytes(data[14:start]))
            del header["payload_bytes"]
            header[rng.choice(sorted(header))] = rng.choice(junk)
            data = bytearray(_pack_file(magic, header, bytes(data[start:-16])))
        paths[magic].write_bytes(data)
        with open_store(tmp_path) as store:
            if magic == BLOCK_MAGIC:
                with pytest.raises(Quarantined):
                    store.read_block(h, tokens)
            else:  # a manifest is read at open
                assert not store.load_sessions()
            assert store.stats()["quarantined_total"] == 1, (n, kind)
        for f in (tmp_path / "quarantine").iterdir():
            f.unlink()
        for magic, path in paths.items():
            path.write_bytes(good[magic])


# -- budget and deletion
def test_a_session_missing_a_block_is_dropped_as_incomplete(tmp_path):
    with open_store(tmp_path) as store:
        hashes = put(store, "s", tokens_of(1, 3))
        put(store, "other", tokens_of(2, 1))
    block_file(store, hashes[1]).unlink()
    with open_store(tmp_path) as store:
        assert [r.session_id for r in store.load_sessions()] == ["other"]
        assert store.stats()["incomplete_sessions"] == 1
        assert not (tmp_path / "sessions" / session_name("s")).exists()
        assert not quarantined_files(tmp_path)  # sound bytes: deleted, not quarantined
        evicted = store.evict_to_budget()
        assert evicted.sessions == () and set(evicted.blocks) == {hashes[0], hashes[2]}


def test_eviction_drops_least_recently_used_sessions_and_keeps_shared_blocks(tmp_path):
    prefix = tokens_of(1, 2)
    with open_store(tmp_path) as store:
        old = put(store, "old", prefix + tokens_of(2, 1), last_used=1.0)
        mid = put(store, "mid", prefix + tokens_of(3, 1), last_used=2.0)
        new = put(store, "new", tokens_of(4, 1), last_used=3.0)
        store.touch_session("old", 4.0)  # used again: now the most recent
        total = store.stats()["bytes"]
        store.disk_budget_bytes = total - 1
        evicted = store.evict_to_budget()
        assert evicted.sessions == ("mid",) and evicted.blocks == (mid[2],)
        assert evicted.bytes == total - store.stats()["bytes"] > 0
        assert all(store.has_block(h) for h in old + new)  # the shared prefix stays
        store.disk_budget_bytes = 0
        evicted = store.evict_to_budget()
        assert evicted.sessions == ("new", "old")
    assert not block_files(tmp_path) and not list((tmp_path / "sessions").iterdir())
    with open_store(tmp_path) as store:
        assert store.stats()["bytes"] == 0


def test_eviction_spares_blocks_a_writer_is_about_to_name(store):
    put(store, "s", tokens_of(1, 1))
    tokens = tokens_of(2, 2)
    hashes = block_hashes_for(tokens, BS, KEYS)
    store.write_block(hashes[0], tokens[:BS], kv_for(hashes[0]))
    store.disk_budget_bytes = 0
    assert store.evict_to_budget().sessions == ("s",)
    assert store.has_block(hashes[0])  # pending: its manifest is not written yet
    store.write_block(hashes[1], tokens[BS:], kv_for(hashes[1]))
    store.write_session("s2", "t", tokens, hashes, 5.0)
    store.disk_budget_bytes = 10**9
    assert store.evict_to_budget().blocks == ()
    store.delete_session("s2")
    assert store.evict_to_budget() == Evicted((), (), 0)


def test_deleting_a_session_removes_the_blocks_only_it_named(store):
    prefix = tokens_of(1, 1)
    a = put(store, "a", prefix + tokens_of(2, 1))
    b = put(store, "b", prefix + tokens_of(3, 1))
    assert store.delete_session("a") is True and store.delete_session("a") is False
    assert not store.has_block(a[1]) and all(store.has_block(h) for h in b)
    assert not (store.sessions_dir / session_name("a")).exists()
    store.delete_session("b")
    assert store.stats()["blocks"] == 0 and not block_files(store.root)


def test_bad_arguments_are_refused_before_anything_is_written(store):
    tokens = tokens_of(1, 1)
    h = block_hashes_for(tokens, BS, KEYS)[0]
    for bad in (torch.zeros(SHAPE, dtype=torch.float16), torch.zeros(2, 2, BS, 2, 4)):
        with pytest.raises(ValueError):
            store.write_block(h, tokens, bad)
    with pytest.raises(ValueError):
        store.write_block(h, tokens[:3], kv_for(h))
    with pytest.raises(ValueError):
        store.write_block(b"short", tokens, kv_for(h))
    with pytest.raises(ValueError):  # its block was never written
        store.write_session("s", "t", tokens, [h], 1.0)
    strided = kv_for(h, shape=SHAPE[::-1]).permute(4, 3, 2, 1, 0)  # not contiguous: fine
    store.write_block(h, tokens, strided)
    assert torch.equal(store.read_block(h, tokens), strided)
    with pytest.raises(ValueError):
        store.write_session("s", "t", tokens + [1], [h], 1.0)
    with pytest.raises(Missing):
        store.read_block(bytes(32), tokens)
    assert store.stats()["writes"] == 1 and store.stats()["sessions"] == 0


# -- a fleet's shared tier: several replicas' stores on one root
def test_shared_stores_open_one_root_together_and_a_private_one_cannot(tmp_path):
    a = open_store(tmp_path, shared=True)
    b = open_store(tmp_path, shared=True)
    with pytest.raises(StoreBusy):
        open_store(tmp_path)  # a private store on a shared root
    a.close()
    b.close()
    private = open_store(tmp_path)
    with pytest.raises(StoreBusy):
        open_store(tmp_path, shared=True)
    private.close()


def test_a_shared_store_spares_another_replicas_fresh_temp_files_and_blocks(tmp_path):
    """What a private store removes at open or as an orphan is, on a shared tier, another
    replica's write in progress unless it is older than STALE_S."""
    from station.tier.store.store import STALE_S

    a = open_store(tmp_path, shared=True)
    hashes = put(a, "s1", tokens_of(1, 2))
    fresh_tmp = tmp_path / "sessions" / ".x.kvs.0123.tmp"
    old_tmp = tmp_path / "sessions" / ".y.kvs.4567.tmp"
    fresh_tmp.write_bytes(b"half")
    old_tmp.write_bytes(b"half")
    long_ago = time.time() - STALE_S - 60
    os.utime(old_tmp, (long_ago, long_ago))
    # a block another replica wrote, its manifest not yet written
    other = block_hashes_for(tokens_of(2, 1), BS, KEYS)[0]
    a.write_block(other, tokens_of(2, 1), kv_for(other))
    a.index.clear_pending()  # as if a's writer had moved on: only age protects it now
    b = open_store(tmp_path, shared=True, budget=0)
    assert fresh_tmp.exists() and not old_tmp.exists()
    assert b.index.stats()["tmp_removed"] == 1
    b.delete_session("s1")  # b's own eviction and deletes still remove what only s1 named
    assert not any(block_file(b, h).exists() for h in hashes)
    b.evict_to_budget()
    assert block_file(b, other).exists()  # fresh: spared
    os.utime(block_file(b, other), (long_ago, long_ago))
    b.evict_to_budget()
    assert not block_file(b, other).exists()  # stale: an orphan like any other
    a.close()
    b.close()


def test_rescan_reports_sessions_other_replicas_saved_replaced_and_removed(tmp_path):
    a = open_store(tmp_path, shared=True)
    b = open_store(tmp_path, shared=True)
    assert b.rescan() == ([], [])
    put(a, "s1", tokens_of(1, 2))
    put(a, "s2", tokens_of(2, 3))
    added, removed = b.rescan()
    assert sorted(r.session_id for r in added) == ["s1", "s2"] and removed == []
    assert b.rescan() == ([], [])  # nothing new: nothing re-read
    # b reads the blocks a wrote, every field checked
    record = b.index.session("s2")
    for i, h in enumerate(record.block_hashes):
        assert torch.equal(b.read_block(h, record.token_ids[i * BS:(i + 1) * BS]), kv_for(h))
    time.sleep(0.01)  # a new mtime for the replaced manifest
    put(a, "s1", tokens_of(3, 1))  # a later turn saved under the same id
    a.delete_session("s2")
    added, removed = b.rescan()
    assert [(r.session_id, r.token_ids) for r in added] == [("s1", tuple(tokens_of(3, 1)))]
    assert removed == ["s2"] and not b.index.has_session("s2")
    put(b, "s3", tokens_of(4, 1))
    assert b.rescan() == ([], [])  # its own write is no news
    assert [r.session_id for r in a.rescan()[0]] == ["s3"]
    a.close()
    b.close()
