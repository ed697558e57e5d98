"""API keys under the supervisor: a bad keys file stops the daemon at start (exit 2, the
line named) instead of a host that fails at every restart; with ``health_requires_key`` the
supervisor's own ``/health`` probe carries a key, so the host is seen running."""

from __future__ import annotations

import subprocess
import sys

import httpx

from tests.supervisor.conftest import (
    MODEL_NAME,
    REPO,
    both_running,
    clean_env,
    start_daemon,
    stop_daemon,
)


def test_a_bad_keys_file_stops_the_daemon_at_start(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-good team-a\nsk-bad has three fields\n")
    result = subprocess.run(
        [sys.executable, "-m", "gnosis_daemon.cli", "run", "--model", str(tiny_model_dir),
         "--runtime-dir", str(tmp_path / "run"), "--port", "0"],
        cwd=REPO, env=clean_env(GNOSIS_API_KEYS_FILE=str(keys)), capture_output=True,
        text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"api_keys_file {str(keys)!r} line 2" in result.stderr
    assert not (tmp_path / "run" / "station.sock").exists()  # no child was started


def test_health_requires_key_the_supervisor_probe_sends_one(tiny_model_dir, tmp_path):
    daemon = start_daemon(tiny_model_dir, tmp_path, GNOSIS_API_KEYS="sk-one,sk-two",
                          GNOSIS_HEALTH_REQUIRES_KEY="1")
    try:
        status = daemon.status()
        assert both_running(status)
        # The host is published with its liquid-memory state, which only /health carries.
        assert status["children"]["host"]["capabilities"]["liquid_memory"] is True
        assert httpx.get(f"{daemon.base_url}/health", timeout=10).status_code == 401
        ok = httpx.get(f"{daemon.base_url}/health", timeout=10,
                       headers={"Authorization": "Bearer sk-two"})
        assert ok.status_code == 200 and ok.json()["status"] == "ok"
        chat = httpx.post(f"{daemon.base_url}/v1/chat/completions", timeout=60,
                          headers={"Authorization": "Bearer sk-one"},
                          json={"model": MODEL_NAME, "max_tokens": 2, "temperature": 0,
                                "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text
    finally:
        stop_daemon(daemon)
