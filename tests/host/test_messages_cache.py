"""Anthropic's cache_control on a real station and hosts (the official ``anthropic`` client,
a tiny random model): a breakpoint on a long system prompt is created on turn 1 and read on
turn 2, counted in whole KV blocks, with greedy output equal to ``model.generate``'s; after
its TTL (a host with a shortened ``cache_ttl_5m_s``) the next request creates it again; a
5m pin outlives another tenant's burst that drops an unpinned session of the same shape,
and a station SIGKILL and restart within its TTL (read back from the disk tier); a pin past
the tenant's pin budget is downgraded and says so, as is a breakpoint on a host without
liquid memory."""

from __future__ import annotations

import os
import signal
import time

import anthropic
import httpx
import pytest
import trio
from transformers import AutoTokenizer

from gnosis_daemon.client import open_station_client
from tests.host.conftest import spawn, station_call
from tests.host.liquid_support import wait_health
from tests.support.metrics import scrape, value
from tests.support.procs import free_port, stop_process, wait_for
from tests.support.tiny_models import reference_generate

KEY, OTHER = "cache-key-a", "cache-key-b"
MAX_TOKENS = 6
SHORT_TTL_S = 5.0
# The tiny model's KV block: 2 layers x K and V x 2 heads x 16 dims x 4 bytes x 16 tokens.
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16
GREEDY = {"temperature": 0}
# Long enough for several KV blocks; each test leads it with its own word, so no test's
# pin or saved session serves another's prompt.
SYSTEM = ("You are a meticulous assistant. Read every instruction twice, answer in short "
          "plain sentences, never invent facts, say when you do not know, and keep each "
          "reply under fifty words unless asked for more detail by the user.")


class Stack:
    def __init__(self, root, model, station_env):
        self.root, self.model, self.station_env = root, model, station_env
        self.run = root / "run"
        self.station = self.spawn_station()
        self.hosts = []

    def spawn_station(self):
        return spawn("station", self.run, self.root / "station.log", "--model", str(self.model),
                     env=self.station_env)

    def host(self, liquid: bool = True, **env) -> str:
        port = free_port()
        proc = spawn("host", self.run, self.root / f"host-{port}.log", "--port", str(port),
                     env={"GNOSIS_API_KEYS": f"{KEY},{OTHER}", **env})
        self.hosts.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_health(url, proc, self.station.pid, liquid_memory=liquid)
        return url

    def stop(self):
        for proc in [*self.hosts, self.station]:
            stop_process(proc)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama):
    s = Stack(tmp_path_factory.mktemp("cache"), tiny_llama, {})
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def url(stack):
    return stack.host()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def block_size(socket) -> int:
    async def hello():
        async with open_station_client(socket) as conn:
            return conn.hello

    return trio.run(hello)["kv_pool"]["block_size"]


def station_sessions(socket_path) -> list[dict]:
    return station_call(socket_path, "kv_session.list", {})["sessions"]


def client(url, key=KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=key, base_url=url, max_retries=0)


def system(word: str, ttl: str | None = None) -> list[dict]:
    control = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    return [{"type": "text", "text": f"{word}. {SYSTEM}", "cache_control": control}]


def ask(c, model, sys_blocks, turns, **kw):
    return c.messages.create(model=model, max_tokens=MAX_TOKENS, system=sys_blocks,
                             messages=turns, extra_body=GREEDY, **kw)


def pinned_tokens(tokenizer, blocks: int, sys_text: str, turns: list[dict]) -> int:
    """The system prompt's tokens as the station pins them: its rendering's longest common
    prefix with the prompt, in whole blocks."""
    head = tokenizer.apply_chat_template([{"role": "system", "content": sys_text}],
                                         tokenize=True)["input_ids"]
    whole = prompt_ids(tokenizer, sys_text, turns)
    common = next((i for i, (a, b) in enumerate(zip(head, whole)) if a != b), len(head))
    return common // blocks * blocks


def prompt_ids(tokenizer, sys_text, turns):
    return tokenizer.apply_chat_template([{"role": "system", "content": sys_text}, *turns],
                                         add_generation_prompt=True, tokenize=True)["input_ids"]


@pytest.fixture(scope="module")
def model(url) -> str:
    return httpx.get(url + "/v1/models", headers={"x-api-key": KEY}).json()["data"][0]["id"]


def test_turn_one_creates_the_system_prefix_and_turn_two_reads_it(stack, url, model, tokenizer,
                                                                  tiny_llama):
    c = client(url)
    blocks = system("Alpha")
    turns = [{"role": "user", "content": "What is a lighthouse?"}]
    first = ask(c, model, blocks, turns)
    expected = pinned_tokens(tokenizer, block_size(stack.run / "station.sock"),
                             blocks[0]["text"], turns)
    assert expected >= 32  # several blocks
    assert first.usage.cache_creation_input_tokens == expected
    assert first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation.ephemeral_5m_input_tokens == expected
    ids = prompt_ids(tokenizer, blocks[0]["text"], turns)
    assert first.usage.input_tokens == len(ids) - expected
    assert first.model_dump()["_gnosis"]["cache_pins"] == [
        {"ttl": "5m", "tokens": expected, "pinned": True, "reason": None}]
    reply = first.content[0].text
    turns += [{"role": "assistant", "content": reply},
              {"role": "user", "content": "And who keeps one?"}]
    second = ask(c, model, blocks, turns)
    assert second.usage.cache_read_input_tokens == expected
    assert second.usage.cache_creation_input_tokens == 0
    ids2 = prompt_ids(tokenizer, blocks[0]["text"], turns)
    assert second.usage.input_tokens == len(ids2) - expected
    for msg, prompt in ((first, ids), (second, ids2)):
        reference = tokenizer.decode(reference_generate(tiny_llama, prompt, MAX_TOKENS),
                                     skip_special_tokens=True)
        assert msg.content[0].text == reference
    # Streamed, the counts come in message_start.
    with c.messages.stream(model=model, max_tokens=MAX_TOKENS, system=blocks, messages=turns,
                           extra_body=GREEDY) as s:
        start = next(e for e in s if e.type == "message_start")
        final = s.get_final_message()
    assert start.message.usage.cache_read_input_tokens == expected
    assert final.content[0].text == second.content[0].text
    # Another tenant never reads this tenant's pin.
    theirs = ask(client(url, OTHER), model, blocks, turns)
    assert theirs.usage.cache_read_input_tokens == 0
    assert theirs.usage.cache_creation_input_tokens == expected


def test_a_breakpoint_inside_the_system_prompt_pins_up_to_its_block(stack, url, model,
                                                                    tokenizer):
    """Two system blocks, the breakpoint on the first: the pin ends where that block's text
    ends in the joined system message (its rendering cut there), not at the message's end
    and not before the message; turn 2, whose second block differs, reads it."""
    c = client(url)
    head = f"Zeta. {SYSTEM}"
    blocks = [{"type": "text", "text": head, "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": " Today the answer must mention the sea."}]
    turns = [{"role": "user", "content": "What is a lighthouse?"}]
    first = ask(c, model, blocks, turns)
    bs = block_size(stack.run / "station.sock")
    cut = tokenizer.apply_chat_template([{"role": "system", "content": head}],
                                        tokenize=True)["input_ids"]
    whole = prompt_ids(tokenizer, head + blocks[1]["text"], turns)
    common = next(i for i, (a, b) in enumerate(zip(cut, whole)) if a != b)
    expected = common // bs * bs  # the cut rendering's shared tokens, in whole blocks
    assert expected >= 32 and common < len(cut)  # it stops inside the system turn
    assert first.usage.cache_creation_input_tokens == expected
    assert first.model_dump()["_gnosis"]["cache_pins"] == [
        {"ttl": "5m", "tokens": expected, "pinned": True, "reason": None}]
    other = [blocks[0], {"type": "text", "text": " Today the answer must mention the hills."}]
    second = ask(c, model, other, turns)
    assert second.usage.cache_read_input_tokens == expected
    assert second.usage.cache_creation_input_tokens == 0


def test_a_1h_breakpoint_counts_as_1h_creation(url, model):
    c = client(url)
    blocks = system("Beta", "1h")
    msg = ask(c, model, blocks, [{"role": "user", "content": "Hi"}])
    assert msg.usage.cache_creation.ephemeral_1h_input_tokens == \
        msg.usage.cache_creation_input_tokens > 0
    assert msg.usage.cache_creation.ephemeral_5m_input_tokens == 0


def test_after_its_ttl_the_next_request_creates_the_pin_again(stack, model):
    short = stack.host(GNOSIS_CACHE_TTL_5M_S=str(SHORT_TTL_S))
    c = client(short)
    blocks, turns = system("Gamma"), [{"role": "user", "content": "Name a river."}]
    made = ask(c, model, blocks, turns).usage.cache_creation_input_tokens
    assert made > 0
    assert ask(c, model, blocks, turns).usage.cache_read_input_tokens == made  # within it
    time.sleep(SHORT_TTL_S + 1.0)
    again = ask(c, model, blocks, turns)
    assert (again.usage.cache_read_input_tokens, again.usage.cache_creation_input_tokens) == \
        (0, made)
    samples = scrape(httpx.get(short + "/metrics", timeout=10).text)
    assert {outcome: value(samples, "gnosis_cache_pins_total", ttl="5m", outcome=outcome)
            for outcome in ("created", "read", "downgraded", "refused")} == \
        {"created": 2, "read": 1, "downgraded": 0, "refused": 0}
    assert value(samples, "gnosis_requests_by_dialect_total", dialect="messages") == 3


def test_a_pin_survives_a_station_sigkill_and_restart_within_its_ttl(stack, url, model):
    c = client(url)
    blocks, turns = system("Delta"), [{"role": "user", "content": "Name a mountain."}]
    made = ask(c, model, blocks, turns).usage.cache_creation_input_tokens
    assert made > 0

    wait_for(lambda: all(s["durable"] for s in station_sessions(stack.run / "station.sock")),
             30, "every session (the pin too) on the disk tier")
    os.kill(stack.station.pid, signal.SIGKILL)
    stack.station.wait(10)
    stack.station = stack.spawn_station()
    wait_for(lambda: httpx.get(url + "/health").json().get("station_pid") == stack.station.pid,
             90, "the host on the new station", stack.station)
    after = ask(c, model, blocks, turns)
    assert after.usage.cache_read_input_tokens == made
    assert after.model_dump()["_gnosis"]["tier"] == "disk"


@pytest.fixture(scope="module")
def small(tmp_path_factory, tiny_llama):
    """A station whose budgets drop what they evict: 4 sessions whichever tenant saves them,
    a pool of 64 blocks, no disk tier; and 20 blocks of pins a tenant."""
    s = Stack(tmp_path_factory.mktemp("cache-small"), tiny_llama, {
        "GNOSIS_KV_SESSION_BUDGET": "4", "GNOSIS_KV_SESSION_TENANT_SHARE": "1",
        "GNOSIS_KV_PERSISTENCE": "0", "GNOSIS_KV_CACHE_BYTES": str(64 * BLOCK_BYTES),
        "GNOSIS_KV_PIN_TENANT_BYTES": str(20 * BLOCK_BYTES)})
    try:
        yield s
    finally:
        s.stop()


def test_a_pin_outlives_another_tenants_burst_that_drops_an_unpinned_session(small, model):
    url = small.host()
    c = client(url)
    pinned = (system("Epsilon"), [{"role": "user", "content": "Name a bird."}])
    plain = ([{"type": "text", "text": f"Zeta. {SYSTEM}"}], [{"role": "user", "content": "Name a tree."}])
    made = ask(c, model, *pinned).usage.cache_creation_input_tokens
    assert made > 0
    assert ask(c, model, *plain).model_dump()["_gnosis"]["liquid_kv_saved"] is True
    for i in range(8):  # the other tenant: more sessions and blocks than the station keeps
        burst = ask(client(url, OTHER), model, [{"type": "text", "text": f"Burst {i}. {SYSTEM}"}],
                    [{"role": "user", "content": f"Question {i}?"}])
        assert burst.usage.cache_read_input_tokens == 0
    again = ask(c, model, *pinned)
    assert (again.usage.cache_read_input_tokens, again.usage.cache_creation_input_tokens) == (made, 0)
    dropped = ask(c, model, *plain).model_dump()["_gnosis"]
    assert dropped["liquid_memory"] == "miss"
    assert dropped["cached_tokens"] < block_size(small.run / "station.sock")


def test_a_pin_past_the_tenants_pin_budget_is_downgraded_and_says_so(small, model):
    url = small.host()
    c = client(url, OTHER)
    first = ask(c, model, system("Theta"), [{"role": "user", "content": "Hi"}])
    made = first.usage.cache_creation_input_tokens
    assert made > 0 and made // 16 <= 20  # within the tenant's 20 blocks
    over = ask(c, model, system("Iota"), [{"role": "user", "content": "Hi"}])
    assert (over.usage.cache_creation_input_tokens, over.usage.cache_read_input_tokens) == (0, 0)
    pins = over.model_dump()["_gnosis"]["cache_pins"]
    assert pins == [{"ttl": "5m", "tokens": pins[0]["tokens"], "pinned": False,
                     "reason": "pin_budget"}] and pins[0]["tokens"] > 0
    assert over.model_dump()["_gnosis"]["liquid_kv_saved"] is True  # still an LRU session
    samples = scrape(httpx.get(url + "/metrics", timeout=10).text)
    assert value(samples, "gnosis_cache_pins_total", ttl="5m", outcome="downgraded") == 1


def test_without_liquid_memory_a_breakpoint_is_refused_with_the_reason(stack, model):
    off = stack.host(liquid=False, THOTH_LIQUID_MEMORY="0")
    msg = ask(client(off), model, system("Kappa"), [{"role": "user", "content": "Hi"}])
    assert (msg.usage.cache_creation_input_tokens, msg.usage.cache_read_input_tokens) == (0, 0)
    assert msg.model_dump()["_gnosis"]["cache_pins"] == [
        {"ttl": "5m", "tokens": 0, "pinned": False, "reason": "disabled by THOTH_LIQUID_MEMORY=0"}]
