"""The step profile: a step's phases from the scheduler's and the worker's timings,
idle time between steps, and the summary that answers profile queries."""

from __future__ import annotations

import json

import pytest

from shared.step_profile import WORKER_PHASES, StepProfile


def worker_timings(**seconds: float) -> list[float]:
    return [seconds.get(phase, 0.0) for phase in WORKER_PHASES]


def test_a_step_takes_the_worker_phases_and_the_result_decode_out_of_the_round_trip():
    profile = StepProfile()
    scheduler = {"schedule": 0.001, "encode": 0.0005, "bus_round_trip": 0.030, "update": 0.002}
    profile.end_step(4, scheduler, worker_timings(unpack=0.001, forward=0.020, sampling=0.004), 0.0005, True)
    [(num_reqs, phases)] = profile.steps
    assert num_reqs == 4
    assert phases["bus_round_trip"] == pytest.approx(0.030 - 0.001 - 0.020 - 0.004 - 0.0005)
    assert phases["result_decode"] == 0.0005
    assert (phases["unpack"], phases["forward"], phases["sampling"]) == (0.001, 0.020, 0.004)
    assert phases["schedule"] == 0.001 and phases["update"] == 0.002
    assert scheduler["bus_round_trip"] == 0.030  # the caller's phases are left alone


def test_a_step_without_worker_timings_keeps_the_whole_round_trip():
    profile = StepProfile()
    profile.end_step(1, {"bus_round_trip": 0.010}, [], 0.001, True)
    [(_, phases)] = profile.steps
    assert phases == {"bus_round_trip": pytest.approx(0.009), "result_decode": 0.001}


def test_idle_time_counts_only_for_a_step_with_nothing_ahead_while_work_waits():
    profile = StepProfile()
    assert "idle" not in profile.start_step(nothing_in_flight=True).durations  # no step yet
    profile.end_step(1, {"bus_round_trip": 0.0}, [], 0.0, more_work=True)
    assert profile.start_step(nothing_in_flight=True).durations["idle"] >= 0.0
    assert "idle" not in profile.start_step(nothing_in_flight=False).durations
    # The engine ran out of work: waiting for a request is not the step loop's overhead.
    profile.end_step(1, {"bus_round_trip": 0.0}, [], 0.0, more_work=False)
    assert "idle" not in profile.start_step(nothing_in_flight=True).durations


def test_the_answer_summarises_resets_and_restricts_to_a_batch_size():
    profile = StepProfile()
    assert json.loads(profile.answer(b"")) == {"num_steps": 0}
    profile.add(1, {"schedule": 0.001, "forward": 0.009})
    profile.add(1, {"schedule": 0.003, "forward": 0.009})
    profile.add(8, {"schedule": 0.010, "forward": 0.030})
    summary = json.loads(profile.answer(json.dumps({"num_reqs": 1}).encode()))
    assert summary["num_steps"] == 2
    assert summary["median_ms"] == pytest.approx({"schedule": 2.0, "forward": 9.0})
    assert summary["median_step_ms"] == pytest.approx(11.0)
    # The median of the steps' shares: 1/10 and 3/12.
    assert summary["overhead_share"] == pytest.approx((0.1 + 0.25) / 2)
    assert json.loads(profile.answer(b"{}"))["num_steps"] == 3
    assert json.loads(profile.answer(json.dumps({"reset": True}).encode())) == {"num_steps": 0}
    assert not profile.steps
