"""Every model family answers as ``model.generate`` does, past its sliding window too.

One real station process per family (tiny random weights, windows of ``WINDOW`` = 8 tokens
at 4-token blocks, prompts of up to 53 tokens: several windows), through its socket:

* alone, a short and a long prompt; the long one again (a prefix hit);
* 8 streams at once (batched decodes beside prompt chunks of 16 tokens);
* ``n = 2`` (the second choice forks from the first's prefill);
* a SIGKILL and a new station: the saved session read back from the disk tier (for
  ``RESTARTED``: the tier reads and writes the same bytes for every family, whose
  attention over them the prefix hit above has checked; each restart is a ~5 s station
  start, and these three cover full, sliding and soft-capped alternating layers).

Each greedy answer is ``generate``'s token for token, and ``hello`` names each layer's kind
and the start check that passed before the station served.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
import trio

from gnosis_daemon.client import open_station_client
from tests.station.conftest import start_station
from tests.station.tier.test_persistence import wait_written
from tests.support.tiny_models import ATTENTION_FAMILIES, WINDOW, build_tiny_model, reference_generate

ENV = {"GNOSIS_KV_BLOCK_SIZE": "4", "GNOSIS_PREFILL_CHUNK_TOKENS": "16"}
TENANT = "t"
NEW = 10  # tokens generated per answer
RESTARTED = ("llama", "mistral_sw", "gemma2")


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(length)]


async def _generate(sock: Path, tokens: list[int], **args) -> tuple[dict, dict]:
    async with open_station_client(sock) as conn:
        async with conn.open_stream("generate", {"tokens": tokens, "max_tokens": NEW, "temperature": 0,
                                                 "tenant": TENANT, **args}) as stream:
            prefill = [e async for e in stream if e.get("type") == "prefill"][0]
        return prefill, stream.result


def generate(station, tokens: list[int], **args) -> tuple[dict, dict]:
    return trio.run(lambda: _generate(station.socket, tokens, **args))


def generate_together(station, prompts: list[list[int]]) -> list[list[int]]:
    async def main():
        out: list = [None] * len(prompts)

        async def one(i):
            out[i] = (await _generate(station.socket, prompts[i]))[1]["token_ids"]

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        return out

    return trio.run(main)


def reference(path: Path, prompt: list[int]) -> list[int]:
    return reference_generate(path, prompt, NEW)


@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_family_answers_as_generate_alone_batched_hit_forked_and_after_a_restart(tmp_path, family):
    path = build_tiny_model(tmp_path / family, family)
    runtime = tmp_path / "run"
    short, long_ = prompt_of(1, 12), prompt_of(2, 53)
    station = start_station(path, runtime, **ENV)
    try:
        model = station.hello["model"]
        kinds = model["attention"]["kinds"]
        check = model["start_check"]
        assert check["passed"] and check["logprobs_compared"] > 0
        if family == "llama":
            assert kinds == {"full": 2} and check["longest_window"] is None
        else:
            assert model["attention"]["longest_window"] == WINDOW
            assert any(kind.startswith(f"sliding {WINDOW}") for kind in kinds), kinds
            assert check["probe_tokens"] > WINDOW
        if family == "gemma2":
            assert all("softcap 50" in kind for kind in kinds), kinds

        want_short, want_long = reference(path, short), reference(path, long_)
        assert generate(station, short)[1]["token_ids"] == want_short
        prefill, result = generate(station, long_, save_session="conv")
        assert prefill["cached_tokens"] == 0 and prefill["saved"] is True
        assert result["token_ids"] == want_long
        prefill, result = generate(station, long_)  # a prefix hit, past several windows
        # Every prompt token (its first token from the logits the first run kept).
        assert prefill["cached_tokens"] == len(long_) and result["token_ids"] == want_long

        prompts = [prompt_of(10 + i, 20 + 4 * i) for i in range(8)]
        assert generate_together(station, prompts) == [reference(path, p) for p in prompts]

        forked = generate(station, prompt_of(3, 41), n=2)[1]
        want = reference(path, prompt_of(3, 41))
        assert [c["token_ids"] for c in forked["choices"]] == [want, want]

        if family not in RESTARTED:
            return
        wait_written(station, sessions=1)
        station.proc.send_signal(signal.SIGKILL)
        station.proc.wait()
        station = start_station(path, runtime, **ENV)
        prefill, result = generate(station, long_, load_session="conv")
        assert prefill["session_tier"] == "disk" and prefill["cached_tokens"] == 52
        assert result["token_ids"] == want_long
    finally:
        station.stop()
