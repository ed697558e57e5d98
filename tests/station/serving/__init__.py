"""Tests of station/serving/."""
