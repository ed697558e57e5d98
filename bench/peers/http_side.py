"""One client for both sides: streamed greedy ``/v1/completions`` through an OpenAI API.

A completion must decode exactly the tokens asked for, or the figure is void: the daemon is
sent ``ignore_eos`` (and ``stream_options.include_usage``, so its usage block counts them);
llama.cpp's server is sent ``logit_bias`` of -100 on every end-of-generation token, and its
count is taken from ``usage`` when the stream carries one, else from ``finish_reason ==
"length"`` (it stopped because it had decoded ``max_tokens``). Anything else raises.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field

from bench.common import http_client

WORDS = ("river stone lantern harbor quiet meadow copper signal orbit garden winter mirror "
         "canyon thunder pillar ember violet marble falcon cedar island north paper candle "
         "silver forest bridge window summer engine").split()


def text_prompt(n_words: int, seed: int) -> str:
    """About ``n_words`` tokens of ordinary words (one SmolLM2 token each, give or take),
    different from the first word on for different seeds."""
    rng = random.Random(seed)
    head = f"Note {seed}:"
    return head + "".join(" " + rng.choice(WORDS) for _ in range(max(1, n_words - 3)))


# SmolLM2's tokens per word of ``text_prompt`` (2,000 words are about 2,067 tokens, 8,000
# about 8,260: past the model's 8,192-token context)
TOKENS_PER_WORD = 1.034


def text_prompt_tokens(n_tokens: int, seed: int) -> str:
    """``text_prompt`` of about ``n_tokens`` SmolLM2 tokens (not words): an 8,000-token point
    then fits the model's context."""
    return text_prompt(max(4, round(n_tokens / TOKENS_PER_WORD)), seed)


class CountMismatch(RuntimeError):
    pass


@dataclass
class Completion:
    start: float  # perf_counter at send
    first: float  # the first streamed chunk's arrival
    end: float  # the finish chunk's arrival
    tokens: int  # completion tokens, verified == max_tokens
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def ttft_s(self) -> float:
        return self.first - self.start

    @property
    def decode_tps(self) -> float:
        """Tokens after the first over the time from the first chunk to the finish."""
        return (self.tokens - 1) / (self.end - self.first) if self.end > self.first else 0.0


@dataclass
class Endpoint:
    """An OpenAI-compatible server and what its requests must carry to decode exactly N."""

    name: str
    port: int
    extra: dict = field(default_factory=dict)
    model: str | None = None

    def complete(self, prompt: str, max_tokens: int) -> Completion:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                **self.extra}
        if self.model:
            body["model"] = self.model
        start = time.perf_counter()
        first = end = None
        finish = None
        usage = None
        with http_client().stream("POST", f"http://127.0.0.1:{self.port}/v1/completions",
                                  json=body) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    if first is None:
                        first = time.perf_counter()
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
                        end = time.perf_counter()
        if first is None or end is None:
            raise CountMismatch(f"{self.name}: no chunk or no finish streamed")
        tokens = _verified_count(self.name, usage, finish, max_tokens)
        details = (usage or {}).get("prompt_tokens_details") or {}
        return Completion(start, first, end, tokens, (usage or {}).get("prompt_tokens"),
                          details.get("cached_tokens"))


def _verified_count(name: str, usage: dict | None, finish: str | None, max_tokens: int) -> int:
    if usage and usage.get("completion_tokens") is not None:
        tokens = usage["completion_tokens"]
    elif finish == "length":
        tokens = max_tokens
    else:
        raise CountMismatch(f"{name}: finished with {finish!r} and no usage: token count unknown")
    if tokens != max_tokens:
        raise CountMismatch(f"{name}: decoded {tokens} tokens, asked for {max_tokens} "
                            f"(finish_reason {finish!r})")
    return tokens


def daemon_endpoint(port: int) -> Endpoint:
    return Endpoint("daemon", port, {"ignore_eos": True, "stream_options": {"include_usage": True}})


def peer_endpoint(port: int, eog: list[int]) -> Endpoint:
    return Endpoint("llama.cpp server", port,
                    {"logit_bias": {str(t): -100.0 for t in eog}, "logit_bias_type": "input_ids"})


def aggregate(side, prompts: list[str], max_tokens: int) -> tuple[float, list[Completion]]:
    """``len(prompts)`` concurrent streams: every completion token over the wall time from
    the first send to the last finish (prefills included: a server that serves one stream
    at a time pays them in turn, one that batches them overlaps them)."""
    results: list[Completion | BaseException] = [None] * len(prompts)  # type: ignore[list-item]

    def one(i: int) -> None:
        try:
            results[i] = side.complete(prompts[i], max_tokens)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            results[i] = exc

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():  # a timed join, so that Ctrl-C reaches the bench at once
            thread.join(0.5)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    done: list[Completion] = results  # type: ignore[assignment]
    return sum(c.tokens for c in done) / (max(c.end for c in done) - start), done
