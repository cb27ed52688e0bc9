"""The worker's choice of threads for small steps (services/worker/small_step_threads.py),
on a clock the test moves: each small step "takes" the time the test gives its thread
count, and the chooser must keep the faster count, measure the other again later, and
leave every other step on all threads. (That the count changes no result is
tests/worker/test_one_token_path.py's.)"""

from __future__ import annotations

import pytest

from services.worker import small_step_threads as sst
from services.worker.small_step_threads import SmallStepThreads
from shared.config import ConfigError, ModelRunConfig


class Machine:
    """Small steps back to back: each takes ``cost[threads]`` seconds of the fake clock."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.cost = cost
        self.now = 0.0
        self.used: list[int] = []

    def clock(self) -> float:
        return self.now

    def run(self, chooser: SmallStepThreads, steps: int, small: bool = True) -> list[int]:
        used = []
        for _ in range(steps):
            threads = chooser.threads(small)
            used.append(threads)
            self.now += self.cost[threads]
        self.used += used
        return used


@pytest.mark.parametrize("cost, faster", [({1: 0.018, 2: 0.0135}, 2), ({1: 0.0041, 2: 0.0048}, 1)])
def test_measures_both_then_keeps_the_faster(cost, faster):
    machine = Machine(cost)
    chooser = SmallStepThreads(2, "auto", clock=machine.clock)
    first = machine.run(chooser, 2 * sst.MIN_INTERVALS + 2 * sst.RUN_STEPS)
    assert first[:sst.RUN_STEPS] == [1] * sst.RUN_STEPS  # starts as the worker always did
    assert first.count(1) >= sst.MIN_INTERVALS and first.count(2) >= sst.MIN_INTERVALS
    assert chooser.chosen == faster
    assert machine.run(chooser, 500) == [faster] * 500
    assert chooser.median_ms(1) == pytest.approx(cost[1] * 1000)
    assert chooser.median_ms(2) == pytest.approx(cost[2] * 1000)


def test_measures_the_other_again_and_follows_a_change():
    machine = Machine({1: 0.004, 4: 0.005})
    chooser = SmallStepThreads(4, "auto", clock=machine.clock)
    machine.run(chooser, 300)
    assert chooser.chosen == 1
    machine.cost = {1: 0.02, 4: 0.01}  # say another process now takes a share of each core
    used = machine.run(chooser, sst.RETRY_EVERY + sst.MIN_INTERVALS + 10)
    # One thread until the next scheduled measurement, then one run of four, then four.
    retry = used.index(4)
    assert used[:retry] == [1] * retry and retry >= sst.RETRY_EVERY - 300
    assert used[retry:retry + sst.MIN_INTERVALS] == [4] * sst.MIN_INTERVALS
    assert chooser.chosen == 4 and set(used[retry:]) == {4}


def test_other_steps_take_every_thread_and_break_the_intervals():
    machine = Machine({1: 0.01, 2: 0.02})
    chooser = SmallStepThreads(2, "auto", clock=machine.clock)
    assert machine.run(chooser, 5, small=False) == [2] * 5
    for _ in range(40):  # one small step between prompts: no interval to time
        machine.run(chooser, 1)
        machine.now += 5.0
        machine.run(chooser, 1, small=False)
    assert not chooser.intervals[1] and not chooser.intervals[2] and chooser.chosen is None


def test_a_run_cut_short_keeps_the_choice():
    machine = Machine({1: 0.004, 2: 0.005})
    chooser = SmallStepThreads(2, "auto", clock=machine.clock)
    machine.run(chooser, 200)
    assert chooser.chosen == 1
    while machine.run(chooser, 1) != [2]:  # up to the run that measures two threads again
        pass
    machine.cost = {1: 0.004, 2: 0.001}
    # The run's other steps come one or two at a time between prompts: 7 intervals in all,
    # each of them far shorter than one thread's.
    for i in range(sst.MIN_INTERVALS - 1):
        machine.run(chooser, 2 if i < 6 else 1)
        machine.run(chooser, 1, small=False)
    assert len(chooser.intervals[2]) == 7 and chooser.median_ms(2) == pytest.approx(1.0)
    assert machine.run(chooser, 5) == [1] * 5 and chooser.chosen == 1


def test_a_pause_between_small_steps_does_not_sway_the_choice():
    machine = Machine({1: 0.01, 2: 0.02})
    chooser = SmallStepThreads(2, "auto", clock=machine.clock)
    for _ in range(2 * sst.MIN_INTERVALS + 2 * sst.RUN_STEPS):
        machine.run(chooser, 1)
        if machine.used[-1] == 1 and len(machine.used) % 5 == 0:
            machine.now += 3.0  # e.g. the scheduler held up: a long interval on one thread
    assert chooser.chosen == 1


@pytest.mark.parametrize("mode, threads", [("one", 1), ("all", 2)])
def test_fixed_choices(mode, threads):
    machine = Machine({1: 0.02, 2: 0.01} if mode == "one" else {1: 0.01, 2: 0.02})
    chooser = SmallStepThreads(2, mode, clock=machine.clock)
    assert machine.run(chooser, 300) == [threads] * 300
    assert machine.run(chooser, 3, small=False) == [2] * 3


def test_one_thread_machine_and_bad_values():
    machine = Machine({1: 0.01})
    assert machine.run(SmallStepThreads(1, "auto", clock=machine.clock), 50) == [1] * 50
    with pytest.raises(ValueError):
        SmallStepThreads(2, "two")
    with pytest.raises(ConfigError):
        ModelRunConfig(cpu_small_step_threads="sometimes")
