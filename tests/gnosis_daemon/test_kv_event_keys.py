"""With API keys configured, the KV events (every tenant's prompt tokens) are never bound
where another machine can read them without CURVE: the settings refuse it, and so the
daemon refuses to start, saying why."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gnosis_daemon.kv_event_keys import is_loopback
from gnosis_daemon.settings import Settings, SettingsError
from tests.support.procs import REPO, child_env


@pytest.mark.parametrize("endpoint, local", [
    ("tcp://127.0.0.1:5557", True), ("tcp://127.8.9.1:5557", True), ("tcp://[::1]:5557", True),
    ("tcp://localhost:5557", True), ("ipc:///run/gnosis/kv.sock", True),
    ("tcp://*:5557", False), ("tcp://0.0.0.0:5557", False), ("tcp://[::]:5557", False),
    ("tcp://10.0.0.7:5557", False), ("tcp://eth0:5557", False), ("tcp://pod-0.svc:5557", False),
])
def test_what_counts_as_loopback(endpoint, local):
    assert is_loopback(endpoint) is local


@pytest.mark.parametrize("name", ["kv_events_endpoint", "kv_events_replay_endpoint"])
def test_keys_and_an_open_endpoint_are_refused(tmp_path, name):
    values = {"kv_events_endpoint": "tcp://127.0.0.1:5557", name: "tcp://*:5558"}
    with pytest.raises(SettingsError, match=f"setting '{name}' = 'tcp://\\*:5558' is refused: "
                                            "with API keys configured"):
        Settings(runtime_dir=str(tmp_path), api_keys="sk-one", **values)
    keys = tmp_path / "keys"
    keys.write_text("sk-two team\n")
    with pytest.raises(SettingsError, match="refused"):
        Settings(runtime_dir=str(tmp_path), api_keys_file=str(keys), **values)
    Settings(runtime_dir=str(tmp_path), **values)  # no keys: one local user, open as before
    Settings(runtime_dir=str(tmp_path), api_keys="sk-one",  # loopback: the router beside it
             kv_events_endpoint="tcp://127.0.0.1:5557",
             kv_events_replay_endpoint="tcp://127.0.0.1:5558")


def test_the_daemon_refuses_to_start_and_says_why(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "gnosis_daemon.cli", "run", "--runtime-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env=child_env(GNOSIS_API_KEYS="sk-one", GNOSIS_KV_EVENTS_ENDPOINT="tcp://*:5557"))
    assert proc.returncode == 2
    assert "setting 'kv_events_endpoint' = 'tcp://*:5557' is refused" in proc.stderr
    assert "kv_events_curve_secret_file" in proc.stderr


def test_the_advertised_host_is_a_bare_name(tmp_path):
    with pytest.raises(SettingsError, match="kv_events_advertise_host"):
        Settings(runtime_dir=str(tmp_path), kv_events_advertise_host="evil:1@x")
