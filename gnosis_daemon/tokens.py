"""Token-sequence helpers shared by the station and the host (torch-free)."""

from __future__ import annotations

from typing import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences (lists or tuples, mixed).

    Slice comparisons run in C and a binary search over the length needs O(log n) of
    them, so a 2,000-token prompt against hundreds of saved sessions stays cheap.
    """
    a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
