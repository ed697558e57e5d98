from __future__ import annotations

import random

from gnosis_daemon.tokens import common_prefix_len


def test_common_prefix_len_matches_a_plain_scan_on_mixed_lists_and_tuples():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = a[:rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 10))]
        expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, tuple(b)) == expected
        assert common_prefix_len(tuple(b), a) == expected
