"""The gateway's uvicorn protocol: a request head that does not complete is closed, with
either HTTP implementation; a complete one is served, a dropped stream aborts its own
connection."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from worker.embedded_server import EmbeddedServer, bind, served
from worker.gateway.connections import Connections, protocol_class

IMPLEMENTATIONS = ["h11", "httptools"]


async def hello(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/abort":
        assert CONNECTIONS.abort(scope)
        return
    body = b"hello"
    headers = [(b"content-length", b"5")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


CONNECTIONS = Connections()


@contextlib.asynccontextmanager
async def server(implementation: str, head_timeout: float) -> AsyncIterator[int]:
    http = protocol_class(head_timeout, CONNECTIONS, implementation=implementation)
    config = uvicorn.Config(hello, http=http, lifespan="off", log_config=None)
    async with served(EmbeddedServer(config), bind("127.0.0.1", 0)) as port:
        yield port


async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sent until it closed the connection."""
    data = b""
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(4096):
            data += chunk
    return data


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
async def test_a_head_that_never_completes_is_closed(implementation: str) -> None:
    async with server(implementation, head_timeout=0.3) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        assert await closed_by_server(reader) == b""
        writer.close()
        silent_reader, silent = await asyncio.open_connection("127.0.0.1", port)
        assert await closed_by_server(silent_reader) == b""  # nothing sent at all
        silent.close()
        assert CONNECTIONS.heads_timed_out >= 2


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
async def test_the_next_head_on_a_kept_alive_connection_is_bounded_too(
    implementation: str,
) -> None:
    async with server(implementation, head_timeout=0.3) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readuntil(b"hello")).startswith(b"HTTP/1.1 200")
        writer.write(b"GET / HTT")  # the next request's head, cut
        assert await closed_by_server(reader) == b""
        writer.close()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
async def test_complete_heads_are_served_however_long_the_connection_lives(
    implementation: str,
) -> None:
    async with server(implementation, head_timeout=5.0) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(3):
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")
            await asyncio.sleep(0.05)
            writer.write(b"\r\n")
            assert (await reader.readuntil(b"hello")).startswith(b"HTTP/1.1 200")
        writer.close()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
async def test_a_response_can_abort_its_own_connection(implementation: str) -> None:
    async with server(implementation, head_timeout=5.0) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /abort HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await closed_by_server(reader) == b""
        writer.close()
