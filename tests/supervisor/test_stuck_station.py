"""A station whose serving side is stuck fails its health check, though the ``health`` op
(answered inline on the socket's trio thread) still answers; the supervisor restarts it.

Both stalls are made the real way, with legitimately slow work and small bounds, no test
hook: the tokenizer workers are held by two embedding requests whose texts take seconds to
encode (each 256 texts near the size bound: huge inputs holding every worker, as two huge
schemas did in production), the engine thread by one long prefill chunk on a model big
enough for it to take seconds on a CPU. A stuck station and a slow one look the same from the
health op: the engine loop has not turned while work is pending, every tokenizer worker is
on an old job; the bounds (``engine_stall_s``, ``tokenizer_stall_s``) tell them apart.
"""

from __future__ import annotations

import contextlib

import pytest
import trio

from gnosis_daemon.client import StationError, open_station_client
from supervisor.probes import ProbeFailed, station_health
from tests.station.conftest import start_station
from tests.supervisor.conftest import both_running, start_daemon, stop_daemon

FRAME = 16 * 1024 * 1024


# The most texts one embed takes (256), each within the size bound (the test's max_model_len
# 4096 x 13 characters a token): a job of about 2 s on an idle 2-core machine (half of it at
# 2048 tokens, when the probes' bounds and interval left a window that a quiet machine missed).
SLOW_TEXTS = [("lorem ipsum dolor sit amet, " * 2000)[:50_000]] * 256
STALL_S = 0.5  # the tokenizer workers' bound: a job older than this is stuck


async def _until(conn, predicate, timeout: float) -> dict:
    with trio.fail_after(timeout):
        while not predicate(health := await conn.request("health")):
            await trio.sleep(0.05)
    return health


def test_stuck_tokenizer_workers_fail_the_probe_and_the_station_is_restarted(
        tiny_model_dir, tmp_path):
    # Three failed probes 0.2 s apart: the supervisor kills about 1.1 s into a 2 s job, after
    # the test's own probes (at 0.5 s) and well before the job ends; the next two jobs (queued
    # behind both workers) leave another such window should a probe fall between jobs.
    daemon = start_daemon(tiny_model_dir, tmp_path, GNOSIS_TOKENIZER_STALL_S=str(STALL_S),
                          GNOSIS_HEALTH_FAILURES_BEFORE_KILL="3", GNOSIS_HEALTH_INTERVAL_S="0.2",
                          GNOSIS_MAX_MODEL_LEN="4096")
    try:
        stuck = daemon.child("station")
        sock = daemon.runtime_dir / "station.sock"

        async def wedge() -> tuple[dict, str]:
            async with open_station_client(sock, max_frame_bytes=FRAME) as conn, \
                    contextlib.AsyncExitStack() as streams:
                for _ in range(4):  # both workers, twice: every other request waits behind them
                    await streams.enter_async_context(conn.open_stream(
                        "embed", {"texts": SLOW_TEXTS}))
                health = await _until(conn, lambda h: h["serving"]["stalled"], 30)
                with pytest.raises(ProbeFailed) as failed:
                    await station_health(sock, FRAME, 60.0, STALL_S)
                # The same answer passes a probe with looser bounds: the figures decide.
                await station_health(sock, FRAME, 60.0, 600.0)
                return health, str(failed.value)

        try:
            health, failure = trio.run(wedge)
        except StationError:
            pytest.fail("the station went away before the stall was seen\n" + daemon.log_tail())
        serving = health["serving"]
        assert health["status"] == "ok"  # the op itself answers: only its figures say stuck
        assert serving["tokenizer_workers"] == 2 and len(serving["tokenizer_jobs_s"]) == 2
        assert min(serving["tokenizer_jobs_s"]) > STALL_S
        assert serving["stalled"].startswith("all 2 tokenizer workers have been on one job")
        assert "serving is stuck: all 2 tokenizer workers" in failure
        status = daemon.wait(lambda s: both_running(s)
                             and s["children"]["station"]["pid"] != stuck["pid"],
                             60, "the stuck station replaced")
        new = status["children"]["station"]
        assert new["restarts"] == stuck["restarts"] + 1
        assert new["last_exit"]["reason"] == "unresponsive: 3 failed health checks"
        assert "serving is stuck" in daemon.log_path.read_text(errors="replace")
    finally:
        stop_daemon(daemon)


def _engine_model(path):
    """A random Llama big enough that one 2048-token prefill chunk takes seconds on a CPU
    (hidden 512, 4 layers), with the tiny tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.support.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=4096, bos_token_id=257, eos_token_id=258,
                         pad_token_id=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_an_engine_loop_that_does_not_turn_fails_the_probe(tmp_path):
    model = _engine_model(tmp_path / "model")
    station = start_station(model, tmp_path / "rt", GNOSIS_ENGINE_STALL_S="0.5",
                            GNOSIS_PREFILL_CHUNK_TOKENS="2048", GNOSIS_MAX_MODEL_LEN="4096",
                            GNOSIS_KV_PERSISTENCE="0")
    sock = station.socket

    async def scenario() -> tuple[dict, str, dict]:
        async with open_station_client(sock, max_frame_bytes=FRAME) as conn:
            idle = await conn.request("health")
            assert idle["serving"]["engine_busy"] is False and idle["serving"]["stalled"] is None
            await station_health(sock, FRAME, 0.5, 60.0)  # an idle engine is never stuck
            async with conn.open_stream("generate", {"tokens": [5] * 2040,
                                                     "max_tokens": 1}) as stream:
                health = await _until(conn, lambda h: h["serving"]["stalled"], 30)
                with pytest.raises(ProbeFailed) as failed:
                    await station_health(sock, FRAME, 0.5, 60.0)
                async for _ in stream:  # the step ends, the request finishes
                    pass
            after = await _until(conn, lambda h: not h["serving"]["engine_busy"], 30)
            await station_health(sock, FRAME, 0.5, 60.0)
            return health, str(failed.value), after

    try:
        health, failure, after = trio.run(scenario)
    finally:
        assert station.stop() == 0
    serving = health["serving"]
    assert health["status"] == "ok" and health["running"] + health["waiting"] == 1
    assert serving["engine_busy"] is True and serving["engine_loop_age_s"] > 0.5
    assert serving["stalled"].startswith("the engine loop has not turned for")
    assert "serving is stuck: the engine loop has not turned" in failure
    assert after["serving"]["stalled"] is None and after["serving"]["engine_loop_age_s"] == 0.0
