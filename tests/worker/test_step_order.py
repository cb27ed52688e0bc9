"""A worker rank runs the steps of its scheduler in order: after a step lost on the bus it
runs none until the scheduler starts over, and its progress says so."""

from services.worker.step_order import StepOrder
from shared.protocol import SchedulerOutput


def step(step_id: int, incarnation: str = "s1", reset: bool = False) -> SchedulerOutput:
    return SchedulerOutput(step_id, [], reset_state=reset, incarnation=incarnation)


def run(order: StepOrder, s: SchedulerOutput) -> bool:
    taken = order.take(s)
    if taken:
        assert order.running_step_id == s.step_id
        order.finished(s)
    return taken


def test_steps_run_in_order_and_a_gap_drops_the_rest_until_a_reset():
    order = StepOrder("test")
    assert not run(order, step(1))  # no reset step yet: not this rank's scheduler
    assert run(order, step(1, reset=True)) and run(order, step(2)) and run(order, step(3))
    assert (order.incarnation, order.last_step_id, order.running_step_id) == ("s1", 3, 0)
    # Step 4 was lost: 5 and 6 would apply to the wrong state.
    assert not run(order, step(5)) and not run(order, step(6))
    assert order.last_step_id == 3  # idle and behind: the scheduler sees the loss
    assert run(order, step(7, reset=True)) and run(order, step(8))
    assert order.last_step_id == 8


def test_steps_of_another_incarnation_are_dropped():
    order = StepOrder("test")
    assert run(order, step(1, "s1", reset=True))
    assert run(order, step(1, "s2", reset=True))  # a restarted scheduler starts over
    assert not run(order, step(2, "s1"))  # late, from the dead one
    assert run(order, step(2, "s2"))


def test_a_step_queued_behind_a_running_one_keeps_the_rank_busy():
    """The next step queued on the forward thread: when the running one ends, the rank is
    still running a step (not idle and behind, which would read as a lost step)."""
    order = StepOrder("test")
    assert run(order, step(1, reset=True))
    assert order.take(step(2)) and order.take(step(3))
    assert order.running_step_id == 2
    order.finished(step(2))
    assert (order.last_step_id, order.running_step_id) == (2, 3)
    order.finished(step(3))
    assert (order.last_step_id, order.running_step_id) == (3, 0)


def test_a_late_step_of_a_restarted_scheduler_does_not_count_for_the_new_one():
    order = StepOrder("test")
    assert run(order, step(1, reset=True)) and order.take(step(2)) and order.take(step(3))
    assert order.take(step(1, "s2", reset=True))  # queued behind s1's steps 2 and 3
    order.finished(step(2))
    order.finished(step(3))
    assert (order.incarnation, order.last_step_id, order.running_step_id) == ("s2", 0, 1)
    order.finished(step(1, "s2"))
    assert (order.last_step_id, order.running_step_id) == (1, 0)
