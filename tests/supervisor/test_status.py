"""The status file: atomic replacement, liveness check, `gnosis-daemon status` output."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from gnosis_daemon.settings import Settings
from supervisor.status import (
    StatusUnavailable,
    load_live_status,
    render,
    show,
    write_status,
)


def document(pid: int) -> dict:
    return {
        "version": 1, "updated_at": 1.0,
        "supervisor": {"pid": pid, "state": "running", "ready": True},
        "children": {
            "station": {"state": "running", "pid": 11, "restarts": 1, "uptime_s": 4.25,
                        "last_exit": {"code": None, "signal": 9, "signal_name": "SIGKILL",
                                      "at": 1.0, "uptime_s": 3.0, "reason": None},
                        "capabilities": {"generate": True, "kv_session": True}},
            "host": {"state": "backoff", "pid": None, "restarts": 0, "uptime_s": None,
                     "last_exit": None, "capabilities": {"liquid_memory": False,
                                                         "reason": "station lacks kv_session"}},
        },
    }


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "status.json"
    write_status(path, {"supervisor": {"pid": 1}, "n": 1})
    inode = os.stat(path).st_ino
    write_status(path, {"supervisor": {"pid": 1}, "n": 2})
    assert json.loads(path.read_text())["n"] == 2
    assert os.stat(path).st_ino != inode  # replaced by rename, never rewritten in place
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]


def test_failed_replace_removes_its_temp_file(tmp_path):
    path = tmp_path / "status.json"
    path.mkdir()  # os.replace(file, non-empty directory) fails after the temp file is written
    (path / "keep").write_text("x")
    with pytest.raises(OSError):
        write_status(path, {"supervisor": {"pid": 1}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]


def test_render_table():
    text = render(document(os.getpid()))
    lines = text.splitlines()
    assert lines[0].startswith(f"supervisor pid {os.getpid()}  state running")
    assert lines[1].split()[:5] == ["CHILD", "STATE", "PID", "RESTARTS", "UPTIME_S"]
    assert lines[2].split()[:5] == ["station", "running", "11", "1", "4.2"]
    assert "signal SIGKILL" in lines[2] and lines[2].endswith("generate,kv_session")
    assert lines[3].split()[:3] == ["host", "backoff", "-"]
    assert lines[3].endswith("liquid_memory=off,reason=station lacks kv_session")


def test_show_json_and_table(tmp_path, capsys):
    settings = Settings(runtime_dir=str(tmp_path))
    write_status(settings.status_file, document(os.getpid()))  # pytest's cmdline has no "gnosis"
    out = io.StringIO()
    # our own pid is alive, but its command line is pytest's: treated as a reused pid
    assert show(settings, as_json=True, out=out) == 1
    assert "not running" in capsys.readouterr().err


def test_show_live_supervisor(tmp_path, capsys):
    settings = Settings(runtime_dir=str(tmp_path))
    # a live process whose command line names gnosis, standing in for the supervisor
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "gnosis"])
    try:
        write_status(settings.status_file, document(proc.pid))
        out = io.StringIO()
        assert show(settings, as_json=True, out=out) == 0
        assert json.loads(out.getvalue()) == document(proc.pid)
        out = io.StringIO()
        assert show(settings, as_json=False, out=out) == 0
        assert out.getvalue().startswith(f"supervisor pid {proc.pid}")
    finally:
        proc.kill()
        proc.wait()
    assert show(settings, as_json=True, out=io.StringIO()) == 1
    err = capsys.readouterr().err
    assert f"the supervisor is not running (pid {proc.pid}" in err


def test_no_status_file(tmp_path, capsys):
    settings = Settings(runtime_dir=str(tmp_path / "nothing"))
    assert show(settings, as_json=False) == 1
    assert "no status file at" in capsys.readouterr().err
    with pytest.raises(StatusUnavailable, match="not a gnosis-daemon status"):
        (tmp_path / "x.json").write_text("[1]")
        load_live_status(tmp_path / "x.json")
