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
        self._sending_since: float | None = None

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
        stall = asyncio.create_task(self._stalled())
        try:
            await asyncio.wait((pump, watch, stall), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watch, stall):
                task.cancel()
            await asyncio.gather(pump, watch, stall, return_exceptions=True)
        if any(task.done() and not task.cancelled() for task in (watch, stall)):
            return True
        error = None if pump.cancelled() else pump.exception()
        if isinstance(error, OSError):  # gone while we wrote
            return True
        if error is not None:
            log.error("gateway: an event stream failed: %r", error, exc_info=error)
        return False

    async def _pump(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for frame in self.frames:
                self._sending_since = loop.time()
                await send({"type": "http.response.body", "body": frame, "more_body": True})
                self._sending_since = None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.frames.aclose()

    async def _stalled(self) -> None:
        """Returns once one write has waited longer than ``send_timeout`` (checked a few
        times per period: one timer per stream instead of one per write)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.send_timeout / 4)
            since = self._sending_since
            if since is not None and loop.time() - since > self.send_timeout:
                return
