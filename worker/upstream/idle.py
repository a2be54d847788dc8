"""The idle timeout of a streaming upstream, counted in progress, not in bytes.

``CHATSTREAM_IDLE_TIMEOUT`` bounds the time between two complete SSE blocks, events or
comments (providers' keep-alives during long reasoning count): an upstream that drips the
bytes of an event that never ends holds a slot only that long, whatever the transport,
where the read timeout alone restarted with every byte (docs/decisions.md, 49).

No timer per read: the deadline looks at the decoder's ``progress`` counter every tenth of
the timeout and notes when it last grew. So it fails a stream between 1.0 and 1.1 times the
timeout after its last complete block, never earlier. The transport's read timeout stays
as well: it still ends a silent stream and bounds the wait for the response headers.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from worker.errors import UpstreamTimeoutError
from worker.protocol.sse import SSEDecoder

CHECKS_PER_TIMEOUT = 10
MIN_CHECK = 0.01  # seconds between two looks at the decoder, at least


class ProgressDeadline:
    """``async with ProgressDeadline(name, timeout, decoder):`` around the reads of one
    stream after its first byte. Raises ``UpstreamTimeoutError`` (retryable, like any idle
    timeout) when ``decoder`` completed no event or comment for ``timeout`` seconds; its
    message says how many bytes of an unfinished event the upstream sent meanwhile."""

    def __init__(self, upstream: str, timeout: float, decoder: SSEDecoder) -> None:
        self.upstream = upstream
        self.timeout = timeout
        self._decoder = decoder
        self._every = max(MIN_CHECK, timeout / CHECKS_PER_TIMEOUT)
        self._cancel_scope = asyncio.timeout(None)
        self._timer: asyncio.TimerHandle | None = None
        self._seen = decoder.progress
        self._since = 0.0  # loop time when progress was last seen to grow

    async def __aenter__(self) -> ProgressDeadline:
        loop = asyncio.get_running_loop()
        await self._cancel_scope.__aenter__()
        self._seen, self._since = self._decoder.progress, loop.time()
        self._timer = loop.call_later(self._every, self._check, loop)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
        try:
            await self._cancel_scope.__aexit__(kind, exc, traceback)
        except TimeoutError as expired:
            raise self.error() from expired

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        if self._decoder.progress != self._seen:
            self._seen, self._since = self._decoder.progress, now
        left = self._since + self.timeout - now
        if left <= 0:
            self._timer = None
            self._cancel_scope.reschedule(now)  # cancels the reading task: TimeoutError
            return
        self._timer = loop.call_later(min(self._every, left), self._check, loop)

    def error(self) -> UpstreamTimeoutError:
        """What the attempt ends with: a silence, or an event begun and never ended."""
        unfinished = self._decoder.unfinished
        if not unfinished:
            reason = f"no data for {self.timeout:g}s"
        else:
            reason = (
                f"stalled mid-event: sent {unfinished} bytes of an event but no complete "
                f"SSE event or comment for {self.timeout:g}s"
            )
        return UpstreamTimeoutError(f"upstream {self.upstream!r}: {reason}", upstream=self.upstream)
