"""The gateway's long-lived responses: an SSE stream, and waiting on a client's presence.

``EventStream`` writes frames as its source yields them and watches the connection at the
same time: it stops (and closes the source, which stops following the job) as soon as the
client goes away, or when the client takes no bytes for ``send_timeout`` seconds, so a
stalled client cannot hold a connection slot forever. A source that raises ClientTooSlow
(its client fell more than its byte bound behind) ends it too. Both times the connection
is aborted, so what it had not sent is freed at once (a closed one would keep it until the
client reads). ``on_close(client_gone)`` runs last, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable

from starlette.types import Receive, Scope, Send

from worker.gateway.hub import Behind, ClientTooSlow

log = logging.getLogger("chatstream.gateway")


# A frame is written in pieces of at most this many bytes: uvicorn waits before each write
# until the connection's buffer is below its low-water mark, so a client that stops reading
# leaves at most its high-water mark (64 KiB) and one piece in the transport.
PIECE_BYTES = 65_536

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
        abort: Callable[[Scope], bool] | None = None,
        behind: Behind | None = None,
    ) -> None:
        self.frames = frames
        self.headers = {**SSE_HEADERS, **headers}
        self.send_timeout = send_timeout
        self.on_close = on_close
        self.abort = abort
        self.behind = behind
        self._sending_since: float | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = False  # a server shutdown cancels this call: not the client's doing
        try:
            raw = [(k.encode(), v.encode()) for k, v in self.headers.items()]
            await send({"type": "http.response.start", "status": 200, "headers": raw})
            gone, drop = await self._stream(receive, send)
            if drop:
                await self._drop(scope, receive)
        finally:
            await self.on_close(gone)

    async def _stream(self, receive: Receive, send: Send) -> tuple[bool, bool]:
        """Writes the frames; (the client went away or stalled first, drop the connection)."""
        pump = asyncio.create_task(self._pump(send))
        watch = asyncio.create_task(client_gone(receive))
        stall = asyncio.create_task(self._stalled())
        behind = asyncio.create_task(self._fell_behind())
        tasks = (pump, watch, stall, behind)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if watch.done() and not watch.cancelled():
            return True, False
        if behind.done() and not behind.cancelled() and self.behind is not None:
            return self._dropped(self.behind.error())
        if stall.done() and not stall.cancelled():
            log.info("gateway: dropped an event stream whose client took no bytes for %gs",
                     self.send_timeout)  # fmt: skip
            return True, True
        error = None if pump.cancelled() else pump.exception()
        if isinstance(error, OSError):  # gone while we wrote
            return True, False
        if isinstance(error, ClientTooSlow):
            return self._dropped(error)
        if error is not None:
            log.error("gateway: an event stream failed: %r", error, exc_info=error)
        return False, False

    def _dropped(self, error: ClientTooSlow) -> tuple[bool, bool]:
        log.info("gateway: dropped a client that fell behind: %s (it resumes from its last "
                 "event id)", error)  # fmt: skip
        return False, True

    async def _fell_behind(self) -> None:
        if self.behind is None:
            await asyncio.Event().wait()  # never
        else:
            await self.behind.event.wait()

    async def _drop(self, scope: Scope, receive: Receive) -> None:
        """Abort the connection (its unsent bytes are freed) and wait until the server
        noticed, so the response does not end as one left incomplete."""
        if self.abort is None or not self.abort(scope):
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await client_gone(receive)

    async def _pump(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for frame in self.frames:
                for start in range(0, len(frame), PIECE_BYTES):
                    piece = (
                        frame if len(frame) <= PIECE_BYTES else frame[start : start + PIECE_BYTES]
                    )
                    self._sending_since = loop.time()
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
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
