"""Conversations through a router with the official `openai` client, and what each turn got."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass, field

import openai

TOPICS = ("lighthouse", "orchard", "observatory", "harbour", "glacier", "library", "vineyard",
          "foundry", "monastery", "railway", "apiary", "shipyard", "quarry", "bakery", "mill",
          "ferry")
WORDS = ("keeps", "records", "weather", "lamp", "tide", "ships", "ledger", "north", "storm",
         "calm", "visitors", "repairs", "supplies", "signals", "night", "morning", "log",
         "entry", "wind", "fog", "bell", "chart", "rope", "oil", "glass", "stone", "path")


@dataclass(frozen=True)
class Script:
    """One conversation: a distinct system prompt (its first words name it, so no other
    conversation shares its KV) and its user turns."""

    conv_id: str
    system: str
    users: tuple[str, ...]


def scripts(tag: str, n: int, turns: int, system_words: int, seed: int) -> list[Script]:
    out = []
    for i in range(n):
        rng = random.Random(f"{seed}-{tag}-{i}")
        topic = TOPICS[i % len(TOPICS)]
        body = " ".join(rng.choice(WORDS) for _ in range(system_words))
        system = f"[{tag}-{i}] You are the keeper of the {topic}. Your standing orders: {body}."
        users = tuple(f"Entry {t + 1} of the {topic} log, please." for t in range(turns))
        out.append(Script(f"{tag}-{i}", system, users))
    return out


@dataclass
class TurnResult:
    conv_id: str
    turn: int  # 0-based
    replica: str | None = None
    liquid: str | None = None
    cached: int = 0
    prompt: int = 0
    ttft_ms: float | None = None
    tier: str | None = None  # a hit: where its KV was (pool, host, disk)
    text: str | None = None
    error: str | None = None

    @property
    def kept(self) -> bool:
        """A hit that served most of the prompt: the conversation's own KV, not a block or two
        another conversation happens to share."""
        return self.liquid == "hit" and self.cached >= self.prompt // 2


@dataclass
class Conversation:
    script: Script
    answers: list[str] = field(default_factory=list)
    results: list[TurnResult] = field(default_factory=list)

    def messages(self, turn: int) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.script.system}]
        for t in range(turn):
            msgs += [{"role": "user", "content": self.script.users[t]},
                     {"role": "assistant", "content": self.answers[t]}]
        return msgs + [{"role": "user", "content": self.script.users[turn]}]


def client_for(base_url: str, max_retries: int = 6) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=120,
                         max_retries=max_retries)


def run_turn(client: openai.OpenAI, model: str, conv: Conversation, turn: int,
             max_tokens: int, session_header: bool) -> TurnResult:
    """One turn through the router; with ``session_header`` the conversation's id goes as
    ``X-Session-Id`` (what the router hashes; the daemon names the session by it)."""
    result = TurnResult(conv.script.conv_id, turn)
    headers = {"X-Session-Id": conv.script.conv_id} if session_header else {}
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=conv.messages(turn), max_tokens=max_tokens, temperature=0,
            extra_headers=headers)
        body = json.loads(raw.http_response.text)
        gnosis = body.get("_gnosis") or {}
        result.replica = raw.headers.get("X-Gnosis-Replica")
        result.liquid = gnosis.get("liquid_memory")
        result.cached = int(gnosis.get("cached_tokens") or 0)
        result.prompt = int(gnosis.get("prompt_tokens") or 0)
        result.ttft_ms = gnosis.get("ttft_ms")
        result.tier = gnosis.get("tier")
        result.text = body["choices"][0]["message"]["content"] or ""
    except openai.OpenAIError as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    conv.results.append(result)
    conv.answers.append(result.text if result.text is not None else "")
    return result


def run_turns(client: openai.OpenAI, convs: list[Conversation], turns: range, max_tokens: int,
              session_header: bool = True, seed: int = 0) -> None:
    """Every conversation's ``turns``, turn by turn, in a shuffled order each turn (so a round
    robin cannot line a conversation's turns up on one replica by accident)."""
    model = client.models.list().data[0].id
    rng = random.Random(seed)
    for turn in turns:
        order = list(convs)
        rng.shuffle(order)
        for conv in order:
            run_turn(client, model, conv, turn, max_tokens, session_header)


@dataclass
class HitRate:
    kept: int
    total: int
    ttft_hit_ms: float | None
    ttft_miss_ms: float | None

    @property
    def rate(self) -> float:
        return self.kept / self.total if self.total else 0.0

    def text(self) -> str:
        return f"{self.kept}/{self.total} = {self.rate:.2f}"


def hit_rate(results: list[TurnResult]) -> HitRate:
    """Over turn-2+ results: how many were hits on their own KV, and median TTFTs."""
    hits = [r.ttft_ms for r in results if r.kept and r.ttft_ms is not None]
    misses = [r.ttft_ms for r in results if not r.kept and r.ttft_ms is not None]
    return HitRate(sum(r.kept for r in results), len(results),
                   statistics.median(hits) if hits else None,
                   statistics.median(misses) if misses else None)


def later_turns(convs: list[Conversation], turns: range | None = None) -> list[TurnResult]:
    return [r for c in convs for r in c.results if r.turn > 0 and (turns is None or r.turn in turns)]
