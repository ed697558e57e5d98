"""Tests of station/sampling/."""
