"""Tests of station/core/."""
