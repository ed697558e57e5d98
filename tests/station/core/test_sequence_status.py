"""A sequence's status changes only along ``TRANSITIONS``, through ``change_status``."""

from __future__ import annotations

import itertools

import pytest

from station.core.requests import SamplingParams
from station.core.sequence import TRANSITIONS, IllegalTransition, Sequence, SequenceStatus

S = SequenceStatus

# The path that reaches each status from WAITING, along allowed moves only.
_REACH = {S.WAITING: [], S.RUNNING: [S.RUNNING], S.PARKED: [S.PARKED], S.FINISHED: [S.FINISHED]}


def seq_in(status: SequenceStatus) -> Sequence:
    seq = Sequence("s", [1, 2, 3], SamplingParams(max_tokens=4))
    for step in _REACH[status]:
        seq.change_status(step)
    assert seq.status is status
    return seq


def test_the_table_names_every_status_and_the_expected_moves():
    assert set(TRANSITIONS) == set(S)
    assert TRANSITIONS == {
        S.WAITING: {S.RUNNING, S.PARKED, S.FINISHED},  # admitted or forked; kv_session.load; ended
        S.RUNNING: {S.WAITING, S.PARKED, S.FINISHED},  # preempted; its call done; ended
        S.PARKED: {S.RUNNING, S.FINISHED},  # resumed; released
        S.FINISHED: set(),
    }


def test_a_new_sequence_waits():
    assert Sequence("s", [1], SamplingParams(max_tokens=1)).status is S.WAITING


def _ordered(statuses) -> list[SequenceStatus]:  # a stable order: xdist workers must agree
    return sorted(statuses, key=lambda status: status.value)


@pytest.mark.parametrize("old,new", [(old, new) for old in _ordered(TRANSITIONS)
                                     for new in _ordered(TRANSITIONS[old])])
def test_every_allowed_transition(old: SequenceStatus, new: SequenceStatus):
    seq = seq_in(old)
    seq.change_status(new)
    assert seq.status is new


@pytest.mark.parametrize("old,new", [(old, new) for old, new in itertools.product(S, S)
                                     if new not in TRANSITIONS[old]])  # (enum order: stable)
def test_every_forbidden_transition_raises_and_changes_nothing(old: SequenceStatus,
                                                               new: SequenceStatus):
    seq = seq_in(old)
    with pytest.raises(IllegalTransition, match=f"{old.value} -> {new.value} is not allowed"):
        seq.change_status(new)
    assert seq.status is old


def test_finish_sets_the_reason_once():
    seq = seq_in(S.RUNNING)
    seq.finish("stop")
    assert (seq.status, seq.finish_reason) == (S.FINISHED, "stop")
    with pytest.raises(IllegalTransition):
        seq.finish("length")
    assert seq.finish_reason == "stop"


def test_status_is_not_assigned_directly():
    seq = seq_in(S.WAITING)
    with pytest.raises(AttributeError):
        seq.status = S.RUNNING  # type: ignore[misc]
    assert seq.status is S.WAITING
