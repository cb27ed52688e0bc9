"""shared.aio: wait_for keeps a cancellation that races the awaited result; run takes
uvloop's loop when it is installed, asyncio's otherwise."""

import asyncio
import importlib.util
import sys

import pytest

from shared.aio import run, wait_for


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed")
def test_run_takes_uvloop_when_installed():
    assert run(_loop_module()).startswith("uvloop")


def test_run_takes_asyncio_without_uvloop(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # an import of it fails
    assert run(_loop_module()).startswith("asyncio")


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
