"""Tests of station/tier/."""
