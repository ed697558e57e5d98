"""Tests of station/engine/."""
