"""Tests of station/model/."""
