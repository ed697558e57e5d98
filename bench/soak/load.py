"""The drill's load: what each client sends, and how each answer is classified."""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import trio

from bench.soak.measures import Record

TENANTS = 4
ROUTES = ("chat", "chat-stream", "completions", "completions-stream", "embeddings", "chat-session")
MIX = (("chat", 20), ("chat-stream", 20), ("completions", 10), ("completions-stream", 10),
       ("embeddings", 15), ("chat-session", 25))
TOPICS = ("the tide tables", "a lighthouse lamp", "winter storms", "the harbour cat",
          "copper wire", "an old compass", "the ferry timetable", "fog signals")


class Load:
    """``--clients`` clients over one HTTP client, each request recorded on the drill's clock."""

    def __init__(self, http: httpx.AsyncClient, args: argparse.Namespace, keys: list[str],
                 now: Callable[[], float]) -> None:
        self.http = http
        self.args = args
        self.keys = keys
        self.now = now
        self.rng = random.Random(args.seed)
        self.records: list[Record] = []
        self.liquid: Counter = Counter()

    async def keys_enforced(self) -> bool:
        response = await self.http.post("/v1/embeddings", json={"input": "hello"})
        return response.status_code == 401

    async def warm_up(self) -> None:
        """One request of each kind must succeed before the load starts."""
        for route in ROUTES:
            for _ in range(50):
                record = await self._request(route, 0, {"turns": []}, warm=True)
                if record.ok:
                    break
                await trio.sleep(0.2)
            else:
                raise SystemExit(f"warm-up: {route} never succeeded (last: {record.outcome})")

    # -- load
    async def run(self, scope: trio.CancelScope) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                for client in range(self.args.clients):
                    nursery.start_soon(self._client, client)

    async def _client(self, client: int) -> None:
        rng = random.Random(self.args.seed * 1000 + client)
        conversation: dict[str, Any] = {"turns": [], "n": 0}
        routes, weights = zip(*MIX)
        while True:
            route = rng.choices(routes, weights)[0]
            record = await self._request(route, client, conversation, rng=rng)
            if record.outcome in ("429", "503"):
                await trio.sleep(record.retry_after)  # as OpenAI's clients do
            elif not record.ok:
                await trio.sleep(0.25)  # a refused connection: retried, not hammered

    def _body(self, route: str, client: int, conversation: dict[str, Any],
              rng: random.Random) -> dict[str, Any]:
        topic = rng.choice(TOPICS)
        max_tokens = self.args.max_tokens
        if route in ("chat", "chat-stream"):
            return {"messages": [{"role": "user", "content": f"Tell me about {topic}."}],
                    "max_tokens": max_tokens, "temperature": 0.7, "stream": route == "chat-stream"}
        if route in ("completions", "completions-stream"):
            return {"prompt": f"A short note on {topic}:", "max_tokens": max_tokens,
                    "temperature": 0.7, "stream": route == "completions-stream"}
        if route == "embeddings":
            return {"input": [f"{topic} {i}" for i in range(rng.randint(1, 4))]}
        # a named conversation: every turn re-sends the whole history under one session_id
        if len(conversation["turns"]) >= 8:
            conversation["turns"] = []
            conversation["n"] = conversation.get("n", 0) + 1
        conversation["turns"].append({"role": "user", "content": f"And what about {topic}?"})
        return {"messages": [{"role": "system", "content": "You are a patient harbour guide."},
                             *conversation["turns"]],
                "max_tokens": max_tokens, "temperature": 0,
                "session_id": f"client-{client}-conv-{conversation.get('n', 0)}"}

    async def _request(self, route: str, client: int, conversation: dict[str, Any], *,
                       rng: random.Random | None = None, warm: bool = False) -> Record:
        body = self._body(route, client, conversation, rng or self.rng)
        key = self.keys[client % len(self.keys)]
        headers = {"Authorization": f"Bearer {key}"}
        path = {"chat": "/v1/chat/completions", "chat-stream": "/v1/chat/completions",
                "chat-session": "/v1/chat/completions", "completions": "/v1/completions",
                "completions-stream": "/v1/completions", "embeddings": "/v1/embeddings"}[route]
        start = self.now()
        outcome, answer, retry_after = "hang", None, 0.0
        # The drill's own end cancels from outside: such a request is not recorded.
        with trio.move_on_after(self.args.hang_s):
            outcome, answer, retry_after = await self._send(path, body, headers,
                                                            body.get("stream") is True)
        record = Record(route, outcome, start, self.now(), retry_after)
        if not warm:
            self.records.append(record)
        if route == "chat-session":
            if outcome == "200":
                conversation["turns"].append({"role": "assistant", "content": answer or "ok"})
            elif conversation["turns"]:
                conversation["turns"].pop()  # the turn did not happen
        return record

    async def _send(self, path: str, body: dict[str, Any], headers: dict[str, str],
                    stream: bool) -> tuple[str, str | None, float]:
        """(outcome, the answer's text when known, seconds the server asked to wait)."""
        try:
            if not stream:
                response = await self.http.post(path, json=body, headers=headers)
                if response.status_code != 200:
                    return str(response.status_code), None, _retry_after(response)
                data = response.json()
                self._note_liquid(data.get("_gnosis"))
                choice = (data.get("choices") or [{}])[0]
                return "200", (choice.get("message") or {}).get("content") or choice.get("text"), 0.0
            async with self.http.stream("POST", path, json=body, headers=headers) as response:
                if response.status_code != 200:
                    await response.aread()
                    return str(response.status_code), None, _retry_after(response)
                done = False
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            return "200 cut", None, 0.0
                        if chunk.get("_gnosis"):
                            self._note_liquid(chunk["_gnosis"])
                return ("200" if done else "200 cut"), None, 0.0
        except httpx.HTTPError:
            return "conn error", None, 0.0
        except (ValueError, KeyError):
            return "bad body", None, 0.0

    def _note_liquid(self, gnosis: dict[str, Any] | None) -> None:
        if gnosis and gnosis.get("liquid_memory"):
            self.liquid[gnosis["liquid_memory"]] += 1


def _retry_after(response: httpx.Response) -> float:
    """The response's Retry-After in seconds (capped at 5; 1 when absent or not a number)."""
    try:
        return min(5.0, max(0.0, float(response.headers.get("Retry-After", "1"))))
    except ValueError:
        return 1.0
