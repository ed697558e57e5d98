"""generate's TTL pins on the paged engine and a tiny real model: a pin outlives a burst of
another tenant's saves that evicts everything else, its prefix from a chat prompt's first
messages, read_tokens on the next request, a hit moving its expiry on, the tenant byte bound,
its expiry, and kv_session.list / delete with tenants and forget."""

from __future__ import annotations

import time

import pytest

from gnosis_daemon.wire import GenerateArgs, Pin
from station.core.pins import PinPlan
from station.core.requests import GenerationRequest, Prefill, SamplingParams, Sessions
from station.engine.calls import EngineCalls
from station.serving.ops import render_chat
from station.serving.pin_prefix import pin_plans
from gnosis_daemon.settings import Settings
from station.model.loader import load_model
from tests.station.engine.test_kv_sessions import BS, Engine
from tests.station.engine.test_paged_engine import Collector, prompt_of, reference
from tests.support.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("few_threads")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("pins") / "llama", "llama")
    return path, load_model(Settings(model=str(path),
                                     runtime_dir=str(tmp_path_factory.mktemp("rt"))))


def run(e: Engine, prompt, n: int = 3, pins=(), tenant: str = "a", **sessions) -> Collector:
    """One greedy request of ``tenant``; ``pins``: (session id, ttl_s, num_tokens) each."""
    e.n += 1
    collector = Collector()
    plans = tuple(PinPlan(sid, ttl, num) for sid, ttl, num in pins)
    e.engine.add_request(GenerationRequest(
        f"r{e.n}", list(prompt), SamplingParams(max_tokens=n, temperature=0.0),
        Sessions(tenant=tenant, pins=tuple(Pin(session_id=p.session_id, ttl_s=p.ttl_s)
                                           for p in plans), **sessions), pins=plans), collector)
    return collector.wait()


def pin_report(c: Collector):
    [report] = c.one(Prefill).pins
    return report


def test_a_live_pin_outlives_another_tenants_burst_and_is_read_back(tiny):
    path, loaded = tiny
    pinned, plain = prompt_of(1, 22), prompt_of(2, 22)
    with Engine(loaded, num_blocks=40, kv_session_budget=2, kv_session_tenant_share=1.0) as e:
        first = run(e, pinned, pins=[("a.pin", 60.0, 22)])
        report = pin_report(first)
        assert (report.num_tokens, report.read_tokens, report.pinned, report.reason) == (
            20, 0, True, None)
        run(e, plain, save_session="a.plain")
        # b's burst: 48-token prompts, each saved. The pool (40 blocks: the pin, two of b's
        # sessions and a running prompt do not fit) and the count budget (2 unpinned
        # sessions) expire every session but the pin and b's newest two.
        for i in range(6):
            run(e, prompt_of(10 + i, 48), tenant="b", save_session=f"b.{i}")
        kv = e.engine.kv
        assert [s.session_id for s in kv.sessions.sessions()] == ["a.pin", "b.4", "b.5"]
        assert kv.sessions.num_expired == 5
        stats = e.engine.stats()
        assert (stats["kv_pins"], stats["kv_pinned_bytes"]) == (1, 5 * kv.pins.bytes_per_block)
        again = run(e, pinned + prompt_of(3, 5), n=4, match_session=True)
        pre = again.one(Prefill)
        assert (pre.session_loaded, pre.session_id, pre.session_tokens) == (True, "a.pin", 20)
        assert again.tokens == reference(path, pinned + prompt_of(3, 5), 4)


def test_read_tokens_count_only_what_a_live_pin_of_the_tenant_held(tiny):
    path, loaded = tiny
    prompt, more = prompt_of(4, 18), prompt_of(5, 6)
    with Engine(loaded) as e:
        run(e, prompt, save_session="plain")  # cached, but by no pin
        unpinned = run(e, prompt + more, pins=[("p", 60.0, 24)])
        pre = unpinned.one(Prefill)
        assert pre.cached_tokens == 18 and pin_report(unpinned).read_tokens == 0
        assert pin_report(unpinned).num_tokens == 24
        read = run(e, prompt + more + [7], pins=[("p", 60.0, 25)])
        # The pin's 6 blocks hit (24 tokens, the last one short of the prompt's end).
        assert (read.one(Prefill).cached_tokens, pin_report(read).read_tokens) == (24, 24)
        assert pin_report(read).num_tokens == 24
        other = run(e, prompt + more + [7], tenant="z", pins=[("z.p", 60.0, 25)])
        assert (other.one(Prefill).cached_tokens, pin_report(other).read_tokens) == (0, 0)
        assert read.tokens == reference(path, prompt + more + [7], 3)


def test_a_hit_moves_the_expiry_on(tiny):
    _, loaded = tiny
    prompt = prompt_of(6, 17)
    with Engine(loaded) as e:
        run(e, prompt, pins=[("p", 30.0, 17)])
        before = e.engine.kv.pins.get("p").expires_at
        time.sleep(0.05)
        hit = run(e, prompt + [1, 2], match_session=True)
        assert hit.one(Prefill).session_id == "p"
        after = e.engine.kv.pins.get("p").expires_at
        assert after > before
        listed = e.call(EngineCalls.kv_list, tenant="a")["sessions"]
        assert [(s["session_id"], s["pinned"], s["ttl_s"], s["expires_at"]) for s in listed] == [
            ("p", True, 30.0, after)]


def test_a_pin_past_the_tenant_bytes_is_an_ordinary_session(tiny):
    _, loaded = tiny
    with Engine(loaded) as e:
        per_block = e.engine.kv.pins.bytes_per_block
    with Engine(loaded, kv_pin_tenant_bytes=6 * per_block) as e:
        big = run(e, prompt_of(7, 28), pins=[("big", 60.0, 28)])
        report = pin_report(big)
        assert (report.pinned, report.reason, report.num_tokens, report.expires_at) == (
            False, "pin_budget", 28, None)
        small = run(e, prompt_of(8, 20), pins=[("small", 60.0, 20)])
        assert (pin_report(small).pinned, pin_report(small).reason) == (True, None)
        listed = {s["session_id"]: s for s in e.call(EngineCalls.kv_list)["sessions"]}
        assert (listed["big"]["pinned"], listed["big"]["bytes"]) == (False, 7 * per_block)
        assert (listed["small"]["pinned"], listed["small"]["bytes"]) == (True, 5 * per_block)
        assert e.engine.stats()["kv_pins_downgraded"] == 1
        # A prefix shorter than a block is refused, nothing saved.
        refused = run(e, prompt_of(9, 3), pins=[("tiny", 60.0, 3)])
        assert (pin_report(refused).pinned, pin_report(refused).reason) == (
            False, "its prefix holds no whole KV block of 4 tokens")
        assert "tiny" not in e.engine.kv.sessions


def test_an_expired_pin_is_deleted_by_the_engine_itself(tiny):
    _, loaded = tiny
    with Engine(loaded) as e:
        run(e, prompt_of(11, 16), pins=[("short", 0.5, 16)])
        assert e.engine.kv.pins.live("short")
        deadline = time.monotonic() + 30
        while "short" in e.engine.kv.sessions and time.monotonic() < deadline:
            time.sleep(0.05)  # no request: the loop wakes at the expiry
        assert "short" not in e.engine.kv.sessions and "short" not in e.engine.kv.pins
        assert e.engine.stats()["kv_pins_expired"] == 1


def test_a_messages_pin_keeps_the_rendered_prefix_in_whole_blocks(tiny):
    _, loaded = tiny
    chat = [{"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one?"}]
    args = GenerateArgs.from_wire({"messages": chat, "tenant": "a", "pins": [
        {"session_id": "system", "ttl_s": 60, "messages": 1},
        {"session_id": "turn", "ttl_s": 60, "messages": 2, "parts": 1},
        {"session_id": "all", "ttl_s": 60},
        {"session_id": "past", "ttl_s": 60, "messages": 4, "parts": 1}]})
    prompt = render_chat(loaded, chat, True)
    plans = pin_plans(loaded, args, prompt, BS)
    for plan, upto in zip(plans, (1, 3)):
        rendered = render_chat(loaded, chat[:upto], False)
        # ChatML writes a turn the same whether or not more follow: a prefix of the prompt.
        assert prompt[:len(rendered)] == rendered
        assert plan == PinPlan(plan.session_id, 60.0, len(rendered) // BS * BS)
    assert plans[2] == PinPlan("all", 60.0, len(prompt) // BS * BS)
    assert plans[3].num_tokens == 0 and plans[3].reason == (
        "the pin cuts at message 4 (parts 1) of a prompt of 4 messages")
    with Engine(loaded) as e:
        c = Collector()
        e.engine.add_request(GenerationRequest(
            "chat", prompt, SamplingParams(max_tokens=2, temperature=0.0), args.sessions,
            pins=plans), c)
        reports = c.wait().one(Prefill).pins
        assert [(r.session_id, r.num_tokens, r.pinned) for r in reports] == [
            ("system", plans[0].num_tokens, True), ("turn", plans[1].num_tokens, True),
            ("all", plans[2].num_tokens, True), ("past", 0, False)]
        assert e.engine.kv.sessions.get("turn").token_ids == tuple(prompt[:plans[1].num_tokens])


def test_list_and_delete_by_tenant_and_forget(tiny):
    _, loaded = tiny
    shared, rest = prompt_of(20, 12), prompt_of(21, 12)
    with Engine(loaded) as e:
        run(e, shared + rest, save_session="a.1")
        run(e, shared + prompt_of(22, 9), save_session="a.2")
        run(e, prompt_of(23, 9), tenant="b", save_session="b.1")
        listed = e.call(EngineCalls.kv_list, tenant="a")["sessions"]
        assert sorted(s["session_id"] for s in listed) == ["a.1", "a.2"]
        assert {s["pinned"] for s in listed} == {False} and listed[0]["expires_at"] is None
        assert e.call(EngineCalls.kv_delete, session_id="a.1", tenant="b") == {"deleted": False}
        assert e.call(EngineCalls.kv_delete, session_id="a.1", tenant="a",
                      forget=True) == {"deleted": True}
        # Forgotten: the same prompt again reuses only the 3 blocks a.2 still holds.
        again = run(e, shared + rest)
        assert again.one(Prefill).cached_tokens == 12
        assert e.call(EngineCalls.kv_delete, tenant="a", every=True) == {"deleted": 1}
        assert [s["session_id"] for s in e.call(EngineCalls.kv_list)["sessions"]] == ["b.1"]
        # Without forget the prefix cache keeps what it had: the same prompt is a whole hit
        # (its blocks, its tail and the logits kept after its last token).
        run(e, prompt_of(24, 13), save_session="a.3")
        e.call(EngineCalls.kv_delete, session_id="a.3")
        assert run(e, prompt_of(24, 13)).one(Prefill).cached_tokens == 13
