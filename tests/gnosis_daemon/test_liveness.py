"""The stuck-or-not verdict on a station's ``serving`` figures (the health op's, the probe's)."""

from __future__ import annotations

from gnosis_daemon.liveness import stall_reason


def test_a_busy_engine_past_the_bound_is_stuck_an_idle_one_never():
    busy = {"engine_busy": True, "engine_loop_age_s": 12.5, "tokenizer_workers": 2,
            "tokenizer_jobs_s": []}
    assert stall_reason(busy, 10, 60) == ("the engine loop has not turned for 12.5 s with "
                                          "work pending (engine_stall_s 10)")
    assert stall_reason(busy, 20, 60) is None
    assert stall_reason({**busy, "engine_busy": False}, 10, 60) is None


def test_tokenizer_workers_are_stuck_only_when_all_are_on_old_jobs():
    base = {"engine_busy": False, "engine_loop_age_s": 0.0, "tokenizer_workers": 2}
    assert stall_reason({**base, "tokenizer_jobs_s": [90.0, 61.0]}, 10, 60) == (
        "all 2 tokenizer workers have been on one job for over 61.0 s (tokenizer_stall_s 60)")
    assert stall_reason({**base, "tokenizer_jobs_s": [90.0, 1.0]}, 10, 60) is None  # one serves
    assert stall_reason({**base, "tokenizer_jobs_s": [90.0]}, 10, 60) is None  # one is free


def test_a_station_that_reports_nothing_is_not_judged():
    assert stall_reason(None, 1, 1) is None and stall_reason({}, 1, 1) is None
