"""The stored responses' records on disk (``host.response_store``): per tenant, atomic files,
a chain rebuilt oldest first, the LRU bound and the expiry."""

from __future__ import annotations

import json
import os
import time

import pytest

from host.response_store import ResponseRecord, ResponseStore, new_id, valid_id


def record(tenant: str, previous: str | None = None, text: str = "out",
           created_at: int | None = None) -> ResponseRecord:
    return ResponseRecord(id=new_id(), tenant=tenant,
                          created_at=int(time.time()) if created_at is None else created_at,
                          model="tiny", instructions=None,
                          input=[{"role": "user", "content": "in"}], output_text=text,
                          previous_response_id=previous, session_id=f"{tenant}.r.x")


def test_a_record_round_trips_and_is_only_its_tenants(tmp_path):
    store = ResponseStore(tmp_path, 10, 3600)
    made = record("alice")
    assert store.put(made) == []
    assert store.get("alice", made.id) == made
    assert store.get("bob", made.id) is None
    path = store.path("alice", made.id)
    assert json.loads(path.read_text())["output_text"] == "out"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert store.delete("bob", made.id) is None and store.get("alice", made.id) == made
    assert store.delete("alice", made.id) == made
    assert store.get("alice", made.id) is None and not path.exists()


def test_the_chain_runs_from_the_first_turn_and_stops_where_a_link_is_gone(tmp_path):
    store = ResponseStore(tmp_path, 10, 3600)
    one = record("t", text="1")
    two = record("t", one.id, "2")
    three = record("t", two.id, "3")
    for r in (one, two, three):
        store.put(r)
    assert [r.output_text for r in store.chain("t", three.id)] == ["1", "2", "3"]
    store.delete("t", one.id)
    assert [r.output_text for r in store.chain("t", three.id)] == ["2", "3"]
    assert store.chain("t", one.id) is None
    assert store.chain("other", three.id) is None


def test_past_the_bound_the_least_recently_used_go_and_are_returned(tmp_path):
    store = ResponseStore(tmp_path, 3, 3600)
    made = [record("t") for _ in range(3)]
    for i, r in enumerate(made):
        store.put(r)
        at = time.time() - 100 + i  # in order, and well inside the ttl
        os.utime(store.path("t", r.id), (at, at))
    store.get("t", made[0].id)  # a read is a use: made[1] is now the least recently used
    newest = record("t")
    assert store.put(newest) == [made[1]]
    assert store.count("t") == 3 and store.get("t", made[1].id) is None
    assert store.put(record("u")) == []  # another tenant's bound is its own


def test_an_expired_record_reads_as_missing_and_is_deleted(tmp_path):
    store = ResponseStore(tmp_path, 10, 60)
    old = record("t", created_at=int(time.time()) - 120)
    store.put(old)
    assert store.get("t", old.id) is None
    assert not store.path("t", old.id).exists()
    stale = record("t", created_at=int(time.time()) - 120)
    store.put(stale)
    os.utime(store.path("t", stale.id), (time.time() - 120, time.time() - 120))
    assert store.put(record("t")) == [stale]  # untouched past the ttl: swept on a put


@pytest.mark.parametrize("bad", ["resp_xyz", "../resp_" + "a" * 32, "resp_" + "A" * 32, ""])
def test_ids_this_host_did_not_make_are_never_paths(tmp_path, bad):
    assert not valid_id(bad)
    assert ResponseStore(tmp_path, 10, 60).get("t", bad) is None
    assert valid_id(new_id())
