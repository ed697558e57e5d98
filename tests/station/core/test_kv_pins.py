"""TTL pins in the KV cache manager, on a clock the test moves: exempt from the count
budget and from pool reclaim while live (but for a durable pin the disk tier takes), a use
refreshes them, the per-tenant byte bound, and the expiry that drops them."""

from __future__ import annotations

from station.core.kv_manager import KVCacheManager
from station.core.pins import PinTable, read_from_pins
from station.core.requests import SamplingParams
from station.core.sequence import Sequence

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def manager(num_blocks: int = 16, budget: int = 2, **kwargs) -> tuple[KVCacheManager, Clock]:
    clock = Clock()
    return KVCacheManager(num_blocks, BS, budget, clock=clock, bytes_per_block=100,
                          **kwargs), clock


def save(kv: KVCacheManager, name: str, first_token: int, num_blocks: int,
         tenant: str = "t", ttl_s: float | None = None):
    """A session of ``num_blocks`` fresh blocks whose sequence has ended."""
    blocks = kv.pool.allocate(num_blocks)
    tokens = [first_token + i for i in range(num_blocks * BS)]
    kv.pin(name, tenant, tokens, blocks, ttl_s=ttl_s)
    kv.pool.free(blocks)
    return blocks


def test_a_live_pin_is_no_victim_of_the_count_budget_until_it_expires():
    kv, clock = manager(budget=2)
    save(kv, "pin", 0, 1, ttl_s=10.0)
    for i in range(4):
        clock.now += 1
        save(kv, f"s{i}", 100 + 10 * i, 1)
    # Two ordinary sessions beside the pin: the budget counts only those.
    assert [s.session_id for s in kv.sessions.sessions()] == ["pin", "s2", "s3"]
    assert kv.sessions.num_expired == 2
    assert kv.stats()["kv_pins"] == 1 and kv.stats()["kv_pinned_bytes"] == 100
    clock.now += 10  # past expires_at: an ordinary session, the LRU one
    assert not kv.pins.live("pin")
    save(kv, "s4", 200, 1)
    assert [s.session_id for s in kv.sessions.sessions()] == ["s3", "s4"]


def test_reclaim_passes_over_a_live_pin_and_takes_unpinned_sessions_first():
    kv, clock = manager(num_blocks=8, budget=8)
    save(kv, "pin", 0, 3, ttl_s=60.0)
    clock.now += 1
    save(kv, "plain", 50, 3)
    running = kv.pool.allocate(2)
    assert kv.pool.num_free_blocks == 0
    assert kv.sessions.reclaim(3) == 1  # the newer ordinary one goes, the older pin stays
    assert [s.session_id for s in kv.sessions.sessions()] == ["pin"]
    assert kv.sessions.reclaim(5) == 0  # only the pin could make room: nothing expires
    assert kv.get_session("pin") is not None
    kv.pool.free(running)


def test_pool_pressure_moves_a_durable_pin_to_the_disk_tier_which_keeps_it_pinned():
    kv, clock = manager(num_blocks=4, budget=8)
    kv.enable_disk_tier()
    save(kv, "pin", 0, 3, ttl_s=60.0)
    seq = Sequence("r", list(range(16)), SamplingParams(max_tokens=1))
    assert not kv.allocate_slots(seq, 16)  # not durable yet: it would be lost
    kv.get_session("pin").durable = True  # the write-behind landed
    assert kv.allocate_slots(seq, 16)
    assert kv.get_session("pin") is None and "pin" in kv.disk
    assert kv.pins.live("pin") and kv.num_offloaded == 1 and kv.num_lost == 0


def test_a_load_refreshes_a_live_pin():
    kv, clock = manager()
    save(kv, "pin", 0, 2, ttl_s=30.0)
    assert kv.pins.get("pin").expires_at == 1030.0
    clock.now += 20
    kv._use(kv.get_session("pin"))  # what admission and kv_session.load do on a hit
    assert kv.pins.get("pin").expires_at == 1050.0
    clock.now += 30
    assert kv.pins.refresh("pin") is None  # expired: a hit no longer brings it back


def test_prefix_cache_reads_of_pinned_blocks_count_and_refresh():
    kv, clock = manager()
    blocks = save(kv, "pin", 0, 3, ttl_s=30.0)
    for block, block_hash in zip(blocks, kv.get_session("pin").block_hashes):  # as prefill does
        kv.pool.cache_full_block(block, block_hash, [0] * BS)
    other = save(kv, "plain", 100, 1, tenant="u")
    kv.pool.cache_full_block(other[0], kv.get_session("plain").block_hashes[0], [1] * BS)
    clock.now += 10
    hashes = kv._block_hashes
    assert read_from_pins(kv.pins, "t", blocks[:2], hashes) == (2, ["pin"])
    assert kv.pins.get("pin").expires_at == 1040.0
    assert read_from_pins(kv.pins, "t", [*other, *blocks], hashes) == (0, [])  # not a pin's first
    assert read_from_pins(kv.pins, "u", blocks, hashes) == (0, [])  # another tenant's pin
    # On disk (evicted while durable, its blocks still cached): its reads count as well.
    kv.enable_disk_tier()
    kv.get_session("pin").durable = True
    kv.sessions._expire("pin")
    kv._take_evictions()
    assert "pin" in kv.disk and read_from_pins(kv.pins, "t", blocks, hashes) == (3, ["pin"])


def test_the_tenant_byte_bound_and_replacing_a_pin():
    table = PinTable(Clock(), bytes_per_block=100, tenant_bytes=500)
    table.add("a", "t", 10.0, 3)
    assert table.fits("b", "t", 2) and not table.fits("b", "t", 3)
    assert table.fits("a", "t", 5)  # a pin replacing itself counts once
    assert table.fits("b", "u", 5)  # per tenant
    table.add("a", "t", 10.0, 5)
    assert (table.num_pins, table.pinned_bytes) == (1, 500)


def test_expired_pins_are_due_once_and_unpin_drops_a_pin():
    kv, clock = manager()
    save(kv, "short", 0, 1, ttl_s=0.5)
    save(kv, "long", 10, 1, ttl_s=60.0)
    assert kv.pins.wait_s() == 0.5
    clock.now += 0.5
    assert kv.pins.wait_s() == 0.0 and kv.pins.due() == ["short"] and kv.pins.due() == []
    assert kv.pins.num_expired == 1 and kv.pins.wait_s() == 59.5
    assert kv.unpin("long") and "long" not in kv.pins and kv.pins.wait_s() is not None
    assert kv.pins.due() == [] and kv.pins.wait_s() is None


def test_an_ordinary_save_of_a_pinned_id_unpins_it():
    kv, _ = manager()
    save(kv, "s", 0, 1, ttl_s=60.0)
    save(kv, "s", 0, 1)
    assert "s" not in kv.pins and kv.stats()["kv_pins"] == 0


def test_the_pins_figures_by_ttl_class_follow_saves_expiries_and_downgrades():
    kv, clock = manager(num_blocks=16, budget=8)
    save(kv, "a", 0, 2, ttl_s=300)
    save(kv, "b", 100, 1, ttl_s=300)
    save(kv, "c", 200, 3, ttl_s=3600)
    kv.pins.downgraded(3600)
    by_ttl = kv.pins.stats()["kv_pins_by_ttl"]
    assert by_ttl == {"300": {"pins": 2, "bytes": 300, "expired": 0, "downgraded": 0},
                      "3600": {"pins": 1, "bytes": 300, "expired": 0, "downgraded": 1}}
    clock.now += 301
    assert sorted(kv.pins.due()) == ["a", "b"]
    kv.pins.drop("c")  # deleted: gone, not expired
    assert kv.pins.stats()["kv_pins_by_ttl"] == {
        "300": {"pins": 0, "bytes": 0, "expired": 2, "downgraded": 0},
        "3600": {"pins": 0, "bytes": 0, "expired": 0, "downgraded": 1}}
