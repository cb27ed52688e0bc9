"""shared.aio.wait_for keeps a cancellation that races the awaited result."""

import asyncio

import pytest

from shared.aio import wait_for


async def test_a_cancel_racing_the_result_is_not_lost():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    task = asyncio.create_task(wait_for(fut, 10))
    await asyncio.sleep(0)  # the task now waits on fut
    fut.set_result(1)  # the result and the cancel land in the same loop iteration
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_results_and_timeouts_pass_through():
    assert await wait_for(asyncio.sleep(0, result=5), 1) == 5
    with pytest.raises(asyncio.TimeoutError):
        await wait_for(asyncio.sleep(10), 0.01)
