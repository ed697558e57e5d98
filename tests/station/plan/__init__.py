"""Tests of station.plan: the decode plan chosen at start, where it is shown, and the start check."""
