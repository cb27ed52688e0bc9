"""asyncio helpers that the services share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


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
