"""The load's memory figures (``station.model.memory``): this process's resident set and its
peak since a reset, read from ``/proc/self/status``."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from station.model.memory import load_figures, reset_peak, resident

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")

MIB = 1024 * 1024


def test_the_peak_counts_memory_freed_since_and_a_reset_forgets_it():
    base = reset_peak()
    assert base.rss > 0 and base.peak <= base.rss + 4 * MIB
    block = np.ones(256 * MIB, dtype=np.uint8)  # touched: resident
    held = resident()
    assert held.rss - base.rss >= 250 * MIB
    del block
    after = resident()
    assert after.rss < held.rss - 200 * MIB  # given back (a large block is its own mapping)
    assert after.peak >= base.rss + 250 * MIB  # the peak remembers it
    figures = load_figures(base, 128 * MIB)
    assert figures["file_mib"] == 128.0 and figures["load_peak_per_file"] >= 250 / 128
    assert reset_peak().peak < after.peak - 200 * MIB  # a new peak starts at what is resident now
