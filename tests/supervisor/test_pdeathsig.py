"""A grandchild spawned with the preexec hook dies when its parent is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supervisor import pdeathsig

pytestmark = pytest.mark.skipif(not pdeathsig.supported(), reason="PR_SET_PDEATHSIG is Linux-only")

PARENT = r"""
import subprocess, sys, time
from supervisor.pdeathsig import make_preexec
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                     preexec_fn=make_preexec(), start_new_session=True)
print(p.pid, flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); only a running process counts.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_grandchild_dies_with_its_parent():
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, env=env)
    try:
        grandchild = int(parent.stdout.readline())
        assert alive(grandchild)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 2.0
        while alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(grandchild)
    finally:
        parent.kill()
        parent.wait()
