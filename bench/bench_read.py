"""CPU per read of a streamed response: the upstream read path's candidates, side by side.

Run: ``.venv/bin/python bench/bench_read.py [--streams 100] [--rate 50] [--seconds 8]``.

``bench/paced_upstream.py`` (its own process, uvloop when installed) serves ``--streams``
streams of OpenAI-shaped chunks at ``--rate`` events/s each, one event per write. Each
candidate runs in a fresh process that opens all the streams, reads every body to its
end and does nothing with the bytes; its CPU (utime + stime, getrusage) over the run,
divided by the reads it saw, is the cost of one read. Reads = events here (one event per
write, and a client keeps up), which the table checks.

httpx
    ``UpstreamClient`` (the worker's body ``feed`` and error translation) over httpx's
    default transport: httpcore + h11 over anyio (what the worker runs without httptools).
httpx+httptools
    the same over ``worker.upstream.transport.HttptoolsTransport``: llhttp over an asyncio
    Protocol, the read timeout by one sweep (what the worker runs with ``[fast]``).
httpx+aiohttp
    the same over ``httpx_aiohttp.AiohttpTransport`` (aiohttp's C parser), if installed.
aiohttp
    a bare aiohttp session, ``iter_any()`` (no httpx, no relay), if installed.
protocol
    a bare asyncio Protocol counting ``data_received`` calls: the floor for Python.

each on asyncio and, when installed, uvloop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

BODY = {
    "model": "gpt-4o-mini",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
}
CANDIDATES = ("httpx", "httpx+httptools", "httpx+aiohttp", "aiohttp", "protocol")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- the candidates (run in a child process) ------------------------------------------


async def read_upstream_client(url: str, body: dict[str, Any], kind: str) -> int:
    import httpx

    from worker.settings import Settings
    from worker.upstream.client import UpstreamClient, _new_http_client, _timeouts

    transport = "httptools" if kind == "httpx+httptools" else "httpx"
    settings = Settings(
        _env_file=None, upstream_url=url, concurrency=1000, http_transport=transport
    )
    if kind == "httpx+aiohttp":
        from httpx_aiohttp import AiohttpTransport

        limits = httpx.Limits(max_connections=1000)
        http = httpx.AsyncClient(
            transport=AiohttpTransport(limits=limits), timeout=_timeouts(settings)
        )
    else:
        http = _new_http_client(settings, _timeouts(settings))
    upstream = UpstreamClient(settings, http)
    return await _all_streams(lambda: _relay(upstream, body), http.aclose)


async def _relay(upstream: Any, body: dict[str, Any]) -> int:
    """The body fed to a callback, as the worker reads it (over httptools, from the
    connection's data callback; over other transports, iterated)."""
    reads = 0

    def count(data: bytes) -> bool:
        nonlocal reads
        reads += 1
        return False

    async with upstream.stream("default", body) as chunks:
        await chunks.feed(count)
    return reads


async def read_aiohttp(url: str, body: dict[str, Any], kind: str) -> int:
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000))

    async def one() -> int:
        reads = 0
        async with session.post(url + "/chat/completions", json=body) as response:
            async for _ in response.content.iter_any():
                reads += 1
        return reads

    return await _all_streams(one, session.close)


class _Counting(asyncio.Protocol):
    def __init__(self, done: asyncio.Future[int]) -> None:
        self.reads = 0
        self.done = done

    def data_received(self, data: bytes) -> None:
        self.reads += 1
        if data.endswith(b"0\r\n\r\n"):
            self.done.set_result(self.reads)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(self.reads)


async def read_protocol(url: str, body: dict[str, Any], kind: str) -> int:
    loop = asyncio.get_running_loop()
    port = int(url.rsplit(":", 1)[1].split("/", maxsplit=1)[0])
    payload = json.dumps(body).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
        b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload)
    )

    async def one() -> int:
        done: asyncio.Future[int] = loop.create_future()
        transport, _ = await loop.create_connection(lambda: _Counting(done), "127.0.0.1", port)
        transport.write(request)
        reads = await done
        transport.close()
        return reads

    async def nothing() -> None:
        return None

    return await _all_streams(one, nothing)


STREAMS = [100]  # set by child()


async def _all_streams(
    one: Callable[[], Awaitable[int]], close: Callable[[], Awaitable[Any]]
) -> int:
    try:
        counts = await asyncio.gather(*(one() for _ in range(STREAMS[0])))
    finally:
        await close()
    return sum(counts)


def child(kind: str, loop_name: str, url: str, streams: int, tokens: int, rate: float) -> None:
    STREAMS[0] = streams
    body = {**BODY, "mock": {"tokens": tokens, "rate": rate}}
    reader = {"aiohttp": read_aiohttp, "protocol": read_protocol}.get(kind, read_upstream_client)
    for module in (
        "httpx",
        "worker.upstream.client",
        "worker.upstream.transport",
        "aiohttp",
        "httpx_aiohttp",
    ):
        with contextlib.suppress(ImportError):
            __import__(module)  # imports are not reads
    factory = None
    if loop_name == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(asyncio.sleep(0))
        before, began = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        reads = runner.run(reader(url, body, kind))
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - began
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(json.dumps({"reads": reads, "cpu": cpu, "wall": wall}))


# --- the driver ------------------------------------------------------------------------


def available(module: str) -> bool:
    with contextlib.suppress(ImportError):
        __import__(module)
        return True
    return False


def server_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--only", help="comma-separated candidates")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, loop_name, url, streams, tokens, rate = args.child
        child(kind, loop_name, url, int(streams), int(tokens), float(rate))
        return
    loops = ["asyncio", *(["uvloop"] if available("uvloop") else [])]
    wanted = args.only.split(",") if args.only else CANDIDATES
    kinds = [k for k in wanted if "aiohttp" not in k or available("aiohttp")]
    kinds = [k for k in kinds if k != "httpx+aiohttp" or available("httpx_aiohttp")]
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(BENCH / "paced_upstream.py"), str(port)], stdout=subprocess.PIPE
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
        url = f"http://127.0.0.1:{port}/v1"
        tokens = round(args.rate * args.seconds)
        print(
            f"{args.streams} streams x {args.rate:g} events/s x {args.seconds:g}s, one event per"
            " write; CPU per read of the reading process (us)"
        )
        print(f"{'candidate':<16}{'loop':<9}{'us/read':>8}{'reads':>9}{'events':>9}{'server':>8}")
        for kind in kinds:
            for loop_name in loops:
                before = server_cpu(server.pid)
                cmd = [sys.executable, __file__, "--child", kind, loop_name, url]
                out = subprocess.run(
                    [*cmd, str(args.streams), str(tokens), str(args.rate)],
                    capture_output=True, text=True, check=True,
                ).stdout  # fmt: skip
                result = json.loads(out.splitlines()[-1])
                busy = (server_cpu(server.pid) - before) / result["wall"]
                events = args.streams * (tokens + 4)
                per_read = result["cpu"] / result["reads"] * 1e6
                print(
                    f"{kind:<16}{loop_name:<9}{per_read:>8.1f}{result['reads']:>9}{events:>9}"
                    f"{busy:>8.0%}",
                    flush=True,
                )
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
