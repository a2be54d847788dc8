"""A cheap OpenAI-shaped streaming upstream for the benchmarks: one event per write.

Real providers write each SSE event as the model produces it, so a client's read holds one
event. ``worker/testing/mock_upstream.py`` (an ASGI app under uvicorn, with every fault the tests
need) costs a task wake-up, an ASGI ``send`` and a timer per event: at hundreds of streams
x 50 events/s it would eat a core of this 2-core machine and become what the benchmark
measures. This server is an asyncio ``Protocol`` (run under uvloop when installed) with
one scheduler for all streams: a heap of due times served by one timer, each due event
formatted from pre-built bytes and written with one ``transport.write``. The request is
parsed with h11; the response head and the chunked framing are written directly.

Chunks look like OpenAI's with ``stream_options.include_usage``: ``service_tier``,
``system_fingerprint``, ``logprobs: null``, ``"usage": null`` on every chunk, and an
``obfuscation`` string of varying length; then a finish chunk, the usage chunk and
``[DONE]``. The request's ``"mock"`` object takes ``tokens``, ``rate`` (tokens/s, 0 =
unpaced: 16 events per write, as fast as the socket takes them), ``tick`` (seconds: a
paced stream writes at most that often, coalescing the tokens due meanwhile: the old
benchmark's cheaper mode) and ``timestamps`` (each token is its send time
``f"{time.time():.6f} "``).

Run: ``python bench/paced_upstream.py PORT [--tls CERT KEY]`` prints ``ready`` when it
listens on 127.0.0.1:PORT and serves until SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import signal
import ssl
import sys
import time
from typing import Any

import h11

HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)
MODEL = "gpt-4o-mini-2024-07-18"
UNPACED_BATCH = 16
SLACK = 0.0005  # events due this close together go out in one pass of the scheduler
# OpenAI pads chunks with a random-looking string so token lengths do not show
OBFUSCATION = [
    s.encode() for s in ("k3J", "Zq9a0", "x", "P0vQ2mY", "aa", "Tt7Rk1LzQ", "c9", "mB3xQ", "Q")
]


def chunk(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk holding one SSE event."""
    event = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


class Stream:
    """One response: pre-built envelope bytes; ``next_chunk`` formats the due token."""

    def __init__(self, transport: asyncio.Transport, options: dict[str, Any], serial: int):
        self.transport = transport
        self.tokens = int(options.get("tokens", 16))
        self.rate = float(options.get("rate", 0.0))
        self.tick = float(options.get("tick", 0.0))
        self.timestamps = bool(options.get("timestamps", False))
        self.usage = bool(options.get("include_usage", True))
        created = int(time.time())
        envelope = (
            f'{{"id":"chatcmpl-bench{serial}","object":"chat.completion.chunk","created":{created},'
            f'"model":"{MODEL}","service_tier":"default","system_fingerprint":"fp_bench0001",'
            f'"choices":[{{"index":0,"delta":'
        ).encode()
        self.envelope = envelope
        self.tail = b',"logprobs":null,"finish_reason":null}]' + (
            b',"usage":null,"obfuscation":"' if self.usage else b',"obfuscation":"'
        )
        self.sent = 0
        self.start = asyncio.get_running_loop().time()
        self.closed = False

    def token_chunk(self) -> bytes:
        i = self.sent
        self.sent += 1
        text = f"{time.time():.6f} " if self.timestamps else ("tok0" if i == 0 else f" tok{i}")
        delta = b'{"content":"' + text.encode() + b'"}'
        obfuscation = OBFUSCATION[i % len(OBFUSCATION)]
        return chunk(self.envelope + delta + self.tail + obfuscation + b'"}')

    def opening(self) -> bytes:
        """OpenAI's first chunk: the role, an empty content, no token."""
        role = b'{"role":"assistant","content":"","refusal":null}'
        return chunk(self.envelope + role + self.tail + b'k"}')

    def ending(self) -> bytes:
        finish = self.envelope + b'{},"logprobs":null,"finish_reason":"stop"}]'
        finish += b',"usage":null,"obfuscation":"q"}' if self.usage else b',"obfuscation":"q"}'
        parts = [chunk(finish)]
        if self.usage:
            head = self.envelope.split(b'"choices":[', 1)[0]
            usage = (
                b'"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":%d,'
                b'"total_tokens":%d,"prompt_tokens_details":{"cached_tokens":0,'
                b'"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,'
                b'"audio_tokens":0,"accepted_prediction_tokens":0,'
                b'"rejected_prediction_tokens":0}},"obfuscation":"Zq"}'
            ) % (self.tokens, self.tokens + 12)
            parts.append(chunk(head + usage))
        parts.append(chunk(b"[DONE]"))
        parts.append(b"0\r\n\r\n")
        return b"".join(parts)

    def due(self) -> float:
        """When the next token is due (loop time)."""
        return self.start + self.sent / self.rate


class Scheduler:
    """All paced streams of the process: one heap of due times, one timer."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.heap: list[tuple[float, int, Stream, Connection]] = []
        self.order = itertools.count()
        self.timer: asyncio.TimerHandle | None = None
        self.armed_at = float("inf")

    def add(self, stream: Stream, connection: Connection, at: float) -> None:
        heapq.heappush(self.heap, (at, next(self.order), stream, connection))
        if at < self.armed_at:
            if self.timer is not None:
                self.timer.cancel()
            self.armed_at = at
            self.timer = self.loop.call_at(at, self.run)

    def run(self) -> None:
        self.timer, self.armed_at = None, float("inf")
        heap, now = self.heap, self.loop.time()
        while heap and heap[0][0] <= now + SLACK:
            _, _, stream, connection = heapq.heappop(heap)
            if stream.closed:
                continue
            if stream.tick > 0:  # coalescing: everything due by now in one write
                parts = [stream.token_chunk()]
                while stream.sent < stream.tokens and stream.due() <= now:
                    parts.append(stream.token_chunk())
                data = b"".join(parts)
            else:
                data = stream.token_chunk()
            if stream.sent >= stream.tokens:
                connection.finish(stream, data)
                continue
            stream.transport.write(data)
            nxt = stream.due()
            if stream.tick > 0:
                nxt = max(nxt, now + stream.tick)
            heapq.heappush(heap, (nxt, next(self.order), stream, connection))
        if heap:
            self.armed_at = heap[0][0]
            self.timer = self.loop.call_at(self.armed_at, self.run)


class Connection(asyncio.Protocol):
    """One client connection: h11 reads requests; responses are written as raw bytes."""

    def __init__(self, scheduler: Scheduler, serials: itertools.count[int]) -> None:
        self.scheduler = scheduler
        self.serials = serials
        self.transport: asyncio.Transport | None = None
        self.h11 = h11.Connection(h11.SERVER)
        self.body: list[bytes] = []
        self.stream: Stream | None = None
        self.writable = asyncio.Event()
        self.writable.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stream is not None:
            self.stream.closed = True
        self.writable.set()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def data_received(self, data: bytes) -> None:
        if self.stream is not None:
            return  # a client sends nothing more while its response streams
        self.h11.receive_data(data)
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError:
                self.reply(400, b'{"error":{"message":"bad request"}}')
                return
            if event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                return
            if isinstance(event, h11.Data):
                self.body.append(bytes(event.data))
            elif isinstance(event, h11.Request):
                self.target = bytes(event.target)
            elif isinstance(event, h11.EndOfMessage):
                self.respond(b"".join(self.body))
                return

    def respond(self, body: bytes) -> None:
        try:
            request = json.loads(body) if self.target.endswith(b"/chat/completions") else None
        except ValueError:
            request = None
        if not isinstance(request, dict) or not request.get("stream"):
            self.reply(404 if request is None else 400, b'{"error":{"message":"unsupported"}}')
            return
        assert self.transport is not None
        options = dict(request.get("mock") or {})
        stream_options = request.get("stream_options") or {}
        options["include_usage"] = bool(stream_options.get("include_usage"))
        stream = self.stream = Stream(self.transport, options, next(self.serials))
        self.transport.write(HEAD + stream.opening())
        if stream.rate > 0:
            self.scheduler.add(stream, self, stream.start)
        else:
            asyncio.get_running_loop().create_task(self.unpaced(stream))

    async def unpaced(self, stream: Stream) -> None:
        assert self.transport is not None
        while stream.sent < stream.tokens and not stream.closed:
            count = min(UNPACED_BATCH, stream.tokens - stream.sent)
            data = b"".join(stream.token_chunk() for _ in range(count))
            if stream.sent >= stream.tokens:
                self.finish(stream, data)
                return
            self.transport.write(data)
            await self.writable.wait()
            await asyncio.sleep(0)  # the other streams' turn
        if not stream.closed:
            self.finish(stream, b"")

    def finish(self, stream: Stream, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data + stream.ending())
        self.stream = None
        self.h11 = h11.Connection(h11.SERVER)  # keep-alive: the next request
        self.body = []

    def reply(self, status: int, body: bytes) -> None:
        assert self.transport is not None
        reason = {400: b"Bad Request", 404: b"Not Found"}[status]
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (status, reason, len(body), body)
        )
        self.h11 = h11.Connection(h11.SERVER)
        self.body = []


async def serve(port: int, tls: tuple[str, str] | None) -> None:
    loop = asyncio.get_running_loop()
    context = None
    if tls is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(*tls)
    scheduler, serials = Scheduler(), itertools.count()
    server = await loop.create_server(
        lambda: Connection(scheduler, serials), "127.0.0.1", port, backlog=4096, ssl=context
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str]) -> None:
    port = int(argv[0])
    tls = (argv[2], argv[3]) if argv[1:2] == ["--tls"] else None
    factory = None
    with contextlib.suppress(ImportError):
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(port, tls))


if __name__ == "__main__":
    main(sys.argv[1:])
