"""asyncio helpers that the services share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop's event loop when it is installed (a dependency; as
    vLLM's server runs): its loop, transports and callbacks are C, and every token a
    service passes on goes through them several times. Without it, asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``asyncio.wait_for`` that never swallows a cancellation of the calling task.

    Python 3.11's ``wait_for`` returns the result when the awaited future completes in
    the same loop iteration as the caller's cancellation, and the cancel is then lost:
    a loop that a service's ``close()`` cancelled would run on, and ``close()`` would
    wait for it forever.
    """
    result = await asyncio.wait_for(aw, timeout)
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
    return result
