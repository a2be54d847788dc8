"""Small asyncio helpers shared by the worker's long-running tasks."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel the tasks and wait for them, cancelling again any that ignored it: on Python
    3.11, ``asyncio.wait_for`` (redis-py wraps socket writes in it) swallows a cancellation
    that races the write's completion, and the task would then block in its next read."""
    while pending := [task for task in tasks if not task.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.1)
    await asyncio.gather(*tasks, return_exceptions=True)
