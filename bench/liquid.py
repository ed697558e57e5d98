"""Liquid-memory figures for `make bench`, through real HTTP and the real station socket.

Two host processes share one station: one with liquid memory on, one with
``THOTH_LIQUID_MEMORY=0`` (the native path). Decode speed is compared side by side on the
same prompt; the second turn of a chat whose first turn carried a ~2,000-token system prompt
is timed against the first turn; and ``decode_next``'s round trip per token is measured
against ``generate``'s per-token time on the same sequence.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.common import REPO, Pairs, Report, sse_chunks

WORDS = ("river stone lantern harbor quiet meadow copper signal orbit garden winter "
         "mirror canyon thunder pillar ember violet marble falcon cedar").split()


def start_host(settings, runtime_dir: Path, port: int, log_path: Path, *, liquid: bool):
    env = settings.child_environ()
    env.update({"GNOSIS_RUNTIME_DIR": str(runtime_dir), "GNOSIS_PORT": str(port),
                "GNOSIS_LOG_FORMAT": "json", "THOTH_LIQUID_MEMORY": "1" if liquid else "0"})
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gnosis_daemon.cli", "host"], cwd=REPO,
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
            if health.get("station_reachable") and health.get("liquid_memory") == liquid:
                return proc
        except (httpx.HTTPError, ValueError):
            pass
        if proc.poll() is not None:
            raise SystemExit(f"host exited with {proc.returncode}; see {log_path}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"host on port {port} did not report liquid_memory={liquid} in 120 s; see {log_path}")


@dataclass
class Streamed:
    ttft_s: float
    decode_tps: float
    text: str
    gnosis: dict


def stream_chat(port: int, messages: list[dict], max_tokens: int, *, user: str | None = None,
                ignore_eos: bool = False) -> Streamed:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": ignore_eos}
    if user:
        body["user"] = user
    start = time.perf_counter()
    first = end = None
    pieces: list[str] = []
    gnosis: dict = {}
    for chunk in sse_chunks(port, body):
        gnosis = chunk.get("_gnosis") or gnosis
        for choice in chunk.get("choices", []):
            content = (choice.get("delta") or {}).get("content")
            if content:
                if first is None:
                    first = time.perf_counter()
                pieces.append(content)
            if choice.get("finish_reason"):
                end = time.perf_counter()
    assert first is not None and end is not None, "no content or no finish streamed"
    # Decode rate as the client sees it: the tokens after the first (the station's count: a
    # token need not complete a character, so text chunks are not tokens) over the time
    # from the first token (the host's ttft, from our send) to the finish chunk's arrival.
    decoded = gnosis["completion_tokens"] - 1
    first_token = start + gnosis["ttft_ms"] / 1000
    rate = decoded / (end - first_token) if decoded > 0 and end > first_token else 0.0
    return Streamed(first - start, rate, "".join(pieces), gnosis)


def long_system_prompt(target_words: int) -> str:
    return " ".join(WORDS[(i * 7 + i // 3) % len(WORDS)] for i in range(target_words))


def liquid_figures(report: Report, liquid_port: int, native_port: int, decode_tokens: int,
                   rounds: int, first_turn_tokens: int) -> None:
    # Decode speed on the same prompt, both paths back to back in each round (alternating
    # which goes first). Both run the station's one generate loop, so the A/A control
    # (slowest / fastest native round) shows how much of any difference is this
    # machine's noise.
    ask = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    stream_chat(native_port, ask, 8)  # warm-up both paths
    stream_chat(liquid_port, ask, 8)
    pairs, native_rates = Pairs(), []  # (liquid, native) per round
    for r in range(rounds):
        first_port, second_port = (native_port, liquid_port) if r % 2 == 0 else (liquid_port, native_port)
        runs = {port: stream_chat(port, ask, decode_tokens, ignore_eos=True)
                for port in (first_port, second_port)}
        liquid, native = runs[liquid_port], runs[native_port]
        pairs.add(liquid.decode_tps, native.decode_tps)
        native_rates.append(native.decode_tps)
    control = min(native_rates) / max(native_rates)
    report.add("decode tok/s liquid path / native path", pairs.ratio, ">=", 1.0,
               f"liquid {pairs.median(0):.1f} tok/s ({liquid.gnosis.get('path')}), native "
               f"{pairs.median(1):.1f} tok/s ({native.gnosis.get('path')}); {pairs.spread()}; "
               f"predecessor: 0.08", noise=1.0 - control)
    report.add("A/A control: slowest / fastest native round", control, "info", None,
               "the machine's own noise between identical runs")

    # Second turn of a chat whose first turn carried ~first_turn_tokens tokens (these
    # words are about one SmolLM2 token each; the chat template adds the rest).
    system = long_system_prompt(first_turn_tokens * 19 // 20)
    turn1 = [{"role": "system", "content": system},
             {"role": "user", "content": "Summarise the words above in one sentence."}]
    first = stream_chat(liquid_port, turn1, 24, user="bench-chat")
    turn2 = turn1 + [{"role": "assistant", "content": first.text},
                     {"role": "user", "content": "Now in three words."}]
    second = stream_chat(liquid_port, turn2, 8, user="bench-chat")
    report.add(f"second-turn TTFT / first-turn TTFT ({first_turn_tokens:,}-token first turn)",
               second.ttft_s / first.ttft_s, "<=", 0.1,
               f"turn 2 {second.ttft_s * 1000:.0f} ms ({second.gnosis.get('liquid_memory')}, "
               f"cached {second.gnosis.get('cached_tokens')} of {second.gnosis.get('prompt_tokens')}), "
               f"turn 1 {first.ttft_s * 1000:.0f} ms ({first.gnosis.get('prompt_tokens')} prompt tokens)")


async def decode_next_figures(conn, report: Report, prompt_ids: list[int], decode_tokens: int,
                              rounds: int) -> None:
    """decode_next's round trip per token vs generate's per-token time, same sequence."""
    pairs = Pairs()  # (decode_next per token, generate per token)
    for r in range(rounds):
        sides = [_decode_next_per_token, _generate_per_token]
        measured = {measure: await measure(conn, prompt_ids, decode_tokens)
                    for measure in (sides if r % 2 == 0 else sides[::-1])}
        pairs.add(measured[_decode_next_per_token], measured[_generate_per_token])
    per_token, gen_per_token = pairs.median(0), pairs.median(1)
    report.add("decode_next round trip per token / generate per token", pairs.ratio,
               "info", None, f"decode_next {per_token * 1000:.2f} ms/token, generate "
               f"{gen_per_token * 1000:.2f} ms/token, round-trip overhead "
               f"{(per_token - gen_per_token) * 1000:.2f} ms; {pairs.spread()}")


async def _decode_next_per_token(conn, prompt_ids: list[int], decode_tokens: int) -> float:
    fwd = await conn.request("forward", {"tokens": prompt_ids})
    seq_id = fwd["seq_id"]
    try:
        await conn.request("decode_next", {"seq_id": seq_id, "temperature": 0})  # the first token
        start = time.perf_counter()
        for _ in range(decode_tokens):
            await conn.request("decode_next", {"seq_id": seq_id, "temperature": 0})
        return (time.perf_counter() - start) / decode_tokens
    finally:
        await conn.request("forward", {"seq_id": seq_id, "tokens": [], "release": True})


async def _generate_per_token(conn, prompt_ids: list[int], decode_tokens: int) -> float:
    first = last = None
    n = 0
    async with conn.open_stream("generate", {"tokens": prompt_ids, "max_tokens": decode_tokens + 1,
                                             "temperature": 0, "ignore_eos": True,
                                             "tenant": "decode-next-bench"}) as stream:
        async for event in stream:
            if event.get("type") == "tokens":
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    n += len(event["token_ids"])
                last = now
    return (last - first) / n
