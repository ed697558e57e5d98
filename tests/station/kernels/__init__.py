"""Tests of station/kernels/."""
