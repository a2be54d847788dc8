"""The gateway's long-lived responses: an SSE stream, and waiting on a client's presence.

``EventStream`` writes frames as its source yields them and watches the connection at the
same time: it stops (and closes the source, which stops following the job) as soon as the
client goes away, or when the client takes no bytes for ``send_timeout`` seconds, so a
stalled client cannot hold a connection slot forever. ``on_close(client_gone)`` runs
last, whatever happened.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable

from starlette.types import Receive, Scope, Send

log = logging.getLogger("chatstream.gateway")


SSE_HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",  # nginx: do not buffer the stream
}


async def client_gone(receive: Receive) -> None:
    """Returns when the client disconnects (the request body must have been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream:
    def __init__(
        self,
        frames: AsyncGenerator[bytes, None],
        *,
        headers: dict[str, str],
        send_timeout: float,
        on_close: Callable[[bool], Awaitable[None]],
    ) -> None:
        self.frames = frames
        self.headers = {**SSE_HEADERS, **headers}
        self.send_timeout = send_timeout
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = False  # a server shutdown cancels this call: not the client's doing
        try:
            raw = [(k.encode(), v.encode()) for k, v in self.headers.items()]
            await send({"type": "http.response.start", "status": 200, "headers": raw})
            gone = await self._stream(receive, send)
        finally:
            await self.on_close(gone)

    async def _stream(self, receive: Receive, send: Send) -> bool:
        """Writes the frames; True when the client went away (or stalled) first."""
        pump = asyncio.create_task(self._pump(send))
        watch = asyncio.create_task(client_gone(receive))
        try:
            await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watch):
                task.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
        if watch.done() and not watch.cancelled():
            return True
        error = None if pump.cancelled() else pump.exception()
        if isinstance(error, TimeoutError | OSError):  # stalled, or gone while we wrote
            return True
        if error is not None:
            log.error("gateway: an event stream failed: %r", error, exc_info=error)
        return False

    async def _pump(self, send: Send) -> None:
        try:
            async for frame in self.frames:
                async with asyncio.timeout(self.send_timeout):
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.frames.aclose()
