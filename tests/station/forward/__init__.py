"""Tests of station/forward/."""
