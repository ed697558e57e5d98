"""The client dialects' second turns for `make bench`: Anthropic Messages with a
``cache_control`` breakpoint on a long system prompt, and the Responses API chained by
``previous_response_id``, each through its official client against the liquid host.

Turn 1 carries the long prompt; turn 2 adds a short question. Both are streamed, and each
turn's TTFT is the time from the call to its first text delta, as a client sees it. The
ratio is the issue's goal (<= 0.1): turn 2 must come from the KV turn 1 left, pinned by the
breakpoint or stored with the response, never from a second prefill. Each dialect's system
text starts with its own word, so neither hits the other's (or the chat rows') blocks.
"""

from __future__ import annotations

import time

import httpx

from bench.common import Report
from bench.liquid import long_system_prompt

ASK = "Summarise the words above in one sentence."
FOLLOW = "Now in three words."


def _model(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"]


def _messages_turn(client, model: str, system: list[dict], turns: list[dict]) -> tuple[float, str, dict]:
    """(TTFT s, text, usage) of one streamed ``/v1/messages`` turn."""
    start = time.perf_counter()
    first = None
    with client.messages.stream(model=model, max_tokens=24, system=system, messages=turns,
                                extra_body={"temperature": 0}) as stream:
        for event in stream:
            if first is None and event.type == "content_block_delta":
                first = time.perf_counter()
        final = stream.get_final_message()
    text = "".join(b.text for b in final.content if b.type == "text")
    return (first or time.perf_counter()) - start, text, final.usage.model_dump()


def messages_figure(report: Report, port: int, first_turn_tokens: int) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="bench")
    model = _model(port)
    system = [{"type": "text", "text": "Messages. " + long_system_prompt(first_turn_tokens * 19 // 20),
               "cache_control": {"type": "ephemeral"}}]
    turn1 = [{"role": "user", "content": ASK}]
    first_s, text, usage1 = _messages_turn(client, model, system, turn1)
    turn2 = turn1 + [{"role": "assistant", "content": text or "."},
                     {"role": "user", "content": FOLLOW}]
    second_s, _, usage2 = _messages_turn(client, model, system, turn2)
    report.add(f"/v1/messages turn-2 TTFT / turn-1 TTFT (cache_control on a "
               f"{first_turn_tokens:,}-token system prompt)", second_s / first_s, "<=", 0.1,
               f"turn 2 {second_s * 1000:.0f} ms (cache_read_input_tokens "
               f"{usage2.get('cache_read_input_tokens')}), turn 1 {first_s * 1000:.0f} ms "
               f"(cache_creation_input_tokens {usage1.get('cache_creation_input_tokens')}, "
               f"input_tokens {usage1.get('input_tokens')})")


def _responses_turn(client, model: str, **kwargs) -> tuple[float, str, dict]:
    """(TTFT s, response id, usage) of one streamed ``/v1/responses`` turn."""
    start = time.perf_counter()
    first = None
    done = None
    for event in client.responses.create(model=model, max_output_tokens=24, temperature=0,
                                         stream=True, **kwargs):
        if first is None and event.type == "response.output_text.delta":
            first = time.perf_counter()
        if event.type in ("response.completed", "response.incomplete"):
            done = event.response
    assert done is not None, "the response stream ended without its last event"
    usage = done.usage.model_dump() if done.usage is not None else {}
    return (first or time.perf_counter()) - start, done.id, usage


def responses_figure(report: Report, port: int, first_turn_tokens: int) -> None:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench")
    model = _model(port)
    instructions = "Responses. " + long_system_prompt(first_turn_tokens * 19 // 20)
    first_s, first_id, usage1 = _responses_turn(client, model, instructions=instructions, input=ASK)
    second_s, _, usage2 = _responses_turn(client, model, instructions=instructions, input=FOLLOW,
                                          previous_response_id=first_id)
    cached = (usage2.get("input_tokens_details") or {}).get("cached_tokens")
    report.add(f"/v1/responses turn-2 TTFT / turn-1 TTFT (previous_response_id after a "
               f"{first_turn_tokens:,}-token turn)", second_s / first_s, "<=", 0.1,
               f"turn 2 {second_s * 1000:.0f} ms (cached {cached} of {usage2.get('input_tokens')}), "
               f"turn 1 {first_s * 1000:.0f} ms ({usage1.get('input_tokens')} input tokens)")


def dialect_figures(report: Report, port: int, first_turn_tokens: int) -> None:
    messages_figure(report, port, first_turn_tokens)
    responses_figure(report, port, first_turn_tokens)
