"""Children die with the supervisor, even when it is SIGKILLed: Linux's parent-death signal.

``prctl(PR_SET_PDEATHSIG, sig)`` runs in the child between fork and exec (``preexec_fn``).
Two facts that bite:

- The signal fires when the *thread* that forked the child exits, not the process. trio's
  ``open_process`` forks from a worker thread, and idle worker threads exit after a few
  seconds, which would kill a healthy child. ``child.py`` therefore forks from the trio
  (main) thread with a plain ``subprocess.Popen``.
- If the parent dies between fork and ``prctl``, no signal ever comes. The child checks its
  parent pid after setting it and kills itself when the parent is already gone.

Resource handling: the preexec function only calls a libc function bound in the parent (no
imports, no allocation-heavy work after fork). Elsewhere than Linux it is ``None``, and a
SIGKILLed supervisor can leave orphans there (systemd's cgroup still kills them).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable

PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def supported() -> bool:
    return _prctl is not None


def make_preexec(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` that sets the parent-death signal to ``sig`` (None where unsupported)."""
    prctl = _prctl
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            os._exit(126)  # a child that cannot be tied to us must not run at all
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def current_pdeathsig() -> int:
    """This process's parent-death signal (0 = none); tests use it in a child."""
    assert _prctl is not None
    value = ctypes.c_int(0)
    assert _prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0) == 0
    return value.value
