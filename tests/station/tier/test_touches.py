"""The disk tier's uses of durable sessions (``station.tier.jobs.Touches``): a session's first
use goes at once, later ones at most every ``every_s`` as one touch with the newest use, and a
clean stop hands over every pending one."""

from __future__ import annotations

from station.tier.jobs import Touches


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_first_use_goes_at_once_and_later_ones_together_when_due():
    clock = Clock()
    touches = Touches(every_s=10.0, clock=clock)
    assert touches.wait_s() is None and touches.due() == []
    touches.add({"a": 1.0})
    assert touches.wait_s() == 0 and touches.due() == [("a", 1.0)]
    touches.add({"a": 2.0, "b": 2.5})  # b is new: due now; a waits until 110
    assert touches.due() == [("b", 2.5)]
    clock.now = 104.0
    touches.add({"a": 3.0})
    assert touches.due() == [] and touches.wait_s() == 6.0
    clock.now = 110.0
    assert touches.wait_s() == 0 and touches.due() == [("a", 3.0)]  # the newest use only
    assert touches.wait_s() is None


def test_a_queued_write_drops_the_pending_use_it_carries():
    touches = Touches(every_s=10.0, clock=Clock())
    touches.add({"a": 1.0})
    touches.due()
    touches.add({"a": 2.0})
    touches.drop("a")
    assert touches.wait_s() is None and touches.due(flush=True) == []


def test_a_clean_stop_hands_over_every_pending_use():
    clock = Clock()
    touches = Touches(every_s=10.0, clock=clock)
    touches.add({"a": 1.0})
    touches.due()
    touches.add({"a": 2.0})
    assert touches.due() == [] and touches.due(flush=True) == [("a", 2.0)]


def test_what_no_longer_waits_is_forgotten():
    clock = Clock()
    touches = Touches(every_s=10.0, clock=clock)
    for i in range(1500):  # all within every_s: each is remembered
        touches.add({f"s{i}": float(i)})
        assert touches.due() == [(f"s{i}", float(i))]
    assert len(touches._sent_at) == 1500
    clock.now += 11.0
    for i in range(1500, 2100):  # the next look past its bound forgets the first 1,500
        touches.add({f"s{i}": float(i)})
        touches.due()
    assert 0 < len(touches._sent_at) <= 600
    touches.add({"s0": 5.0})  # forgotten, so due at once again
    assert touches.due() == [("s0", 5.0)]
