"""Hostile input against a real ``chatstream gateway`` process, with a ``chatstream worker``
behind it: ids Redis would refuse, bodies nested deeper than a worker runs, a client that
stops reading, request heads that trickle in (docs/security.md, docs/failures.md)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from schemas.requests import MAX_NESTING
from tests.helpers.checks import eventually, until_serving
from tests.helpers.fleet import Fleet
from tests.helpers.gateway_env import KEY, chunks_of, content_of, parse_frames
from tests.helpers.harness import MOCK, chat
from tests.helpers.processes import CHATSTREAM
from tests.helpers.servers import free_port
from worker.testing.mock_upstream import expected_reply

AUTH = {"authorization": f"Bearer {KEY}"}


@dataclass
class GatewayProcess:
    url: str
    port: int
    log: Path

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=AUTH, timeout=30)


def spawn_gateway(port: int, env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    args = [CHATSTREAM, "gateway", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        return subprocess.Popen(args, env=env, cwd=cwd, stderr=out)


@contextlib.asynccontextmanager
async def gateway_process(
    fleet: Fleet, tmp_path: Path, **settings: Any
) -> AsyncIterator[GatewayProcess]:
    """A worker and a gateway process on the fleet's Redis; both must end cleanly (exit 0, no
    traceback in either log)."""
    fleet.configure(gateway_api_keys=KEY, **settings)
    await fleet.start(1)
    port = free_port()
    log = tmp_path / "gateway.log"
    process = spawn_gateway(port, fleet.env, tmp_path, log)
    try:
        gateway = GatewayProcess(f"http://127.0.0.1:{port}", port, log)
        async with gateway.http() as http:
            await until_serving(http)
        yield gateway
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 15) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    assert "Traceback" not in text and "Exception in ASGI" not in text, text
    assert "ASGI callable returned" not in text, text
    await fleet.stop()


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code and error["message"], error
    return error


async def finished_job(http: httpx.AsyncClient) -> str:
    response = await http.post("/v1/chat/completions", json=chat("hostile"))
    assert response.status_code == 200, response.text
    job_id: str = response.headers["x-chatstream-job-id"]
    return job_id


# -- ids the gateway parses -------------------------------------------------------------------

HOSTILE_IDS = [
    "99999999999999999999-0",
    "18446744073709551616-0",
    "0-18446744073709551616",
    "18446744073709551615-18446744073709551615",
    "\uff11\uff12\uff13-\uff10",  # full-width digits
    "\u0661\u0662-\u0660",  # Arabic-Indic digits
    "\u00b9-0",  # a superscript one
    "1-2-3",
    "-1",
    "1e9",
]


async def test_hostile_cursors_get_400_and_valid_ones_a_whole_stream(
    fleet: Fleet, tmp_path: Path
) -> None:
    async with gateway_process(fleet, tmp_path) as gateway, gateway.http() as http:
        job_id = await finished_job(http)
        events = f"/v1/jobs/{job_id}/events"
        for bad in HOSTILE_IDS:
            quoted = httpx.QueryParams({"after": bad})
            assert_error(await http.get(f"{events}?{quoted}"), 400, "invalid_cursor")
            response = await http.get(events, headers={b"last-event-id": bad.encode()})
            assert_error(response, 400, "invalid_cursor")
        whole = await http.get(events)
        assert whole.status_code == 200
        frames = parse_frames(whole.text)
        assert content_of(chunks_of(frames)) == expected_reply(chat("hostile"), MOCK)
        assert frames[-1].data == "[DONE]"
        middle = next(e.id for e in frames if e.id)  # resumed after its first entry
        rest = await http.get(events, headers={"last-event-id": f"000{middle}"})
        assert rest.status_code == 200 and parse_frames(rest.text)[-1].data == "[DONE]"


async def test_hostile_starting_after_gets_400(fleet: Fleet, tmp_path: Path) -> None:
    async with gateway_process(fleet, tmp_path) as gateway, gateway.http() as http:
        created = await http.post(
            "/v1/responses", json={"model": "mock-model", "input": "hi", "background": True}
        )
        assert created.status_code == 200, created.text
        path = f"/v1/responses/{created.json()['id']}"
        for bad in ["\uff11", "99999999999999999999", "-1", "1.0", " 1"]:
            response = await http.get(path, params={"stream": "true", "starting_after": bad})
            assert_error(response, 400, "invalid_cursor")


# -- nesting ----------------------------------------------------------------------------------


def nested(levels: int) -> Any:
    value: Any = "deep"
    for _ in range(levels):
        value = [value]
    return value


def chat_nested(levels: int) -> dict[str, Any]:
    """A chat body ``levels`` JSON levels deep in all (the body object is level 1)."""
    return {"model": "mock-model", "messages": [{"role": "user", "content": nested(levels - 3)}]}


def responses_nested(levels: int) -> dict[str, Any]:
    tool = {"type": "function", "name": "f", "parameters": {"a": nested(levels - 5)}}
    return {"model": "mock-model", "input": "hi", "tools": [tool]}


async def test_bodies_nested_deeper_than_a_worker_runs_get_400(
    fleet: Fleet, tmp_path: Path
) -> None:
    async with gateway_process(fleet, tmp_path) as gateway, gateway.http() as http:
        for levels in (MAX_NESTING + 1, 200, 203, 300, 900):
            error = assert_error(
                await http.post("/v1/chat/completions", json=chat_nested(levels)),
                400,
                "invalid_request",
            )
            assert f"more than {MAX_NESTING} levels" in error["message"]
            error = assert_error(
                await http.post("/v1/responses", json=responses_nested(levels)),
                400,
                "invalid_request",
            )
            assert f"more than {MAX_NESTING} levels" in error["message"]
        # far deeper than Python's json parser goes: still the gateway's 400, not a 500
        deepest = b'{"model":"m","messages":[{"role":"user","content":' + b"[" * 100_000
        response = await http.post(
            "/v1/chat/completions", content=deepest, headers={"content-type": "application/json"}
        )
        assert_error(response, 400, "invalid_json")
        assert (await fleet.client.jobs()).jobs == []  # nothing was enqueued
        at_bound = await http.post("/v1/chat/completions", json=chat_nested(MAX_NESTING))
        assert at_bound.status_code == 200, at_bound.text  # the worker ran it
        assert at_bound.json()["choices"][0]["message"]["content"]


# -- request heads that trickle in ------------------------------------------------------------

HEAD = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nUser-Agent: a-slow-one\r\n\r\n"


async def trickle(port: int, *, first: bytes = b"", every: float = 0.2) -> bool:
    """Send ``first`` (whole requests, answered first), then a request head a byte at a time;
    True when the gateway closed the connection before the head was complete."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if first:
            writer.write(first)
            await reader.readuntil(b'"status":"ok"')  # the whole request was answered
        closed = asyncio.create_task(until_closed(reader))
        for byte in HEAD[:-1]:  # never the last byte: this head is never complete
            if closed.done():
                return True
            writer.write(bytes([byte]))
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            await asyncio.sleep(every)
        return closed.done()
    finally:
        writer.close()


async def until_closed(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(ConnectionError):
        while await reader.read(4096):
            pass


async def test_request_heads_that_trickle_in_are_closed_and_others_are_served(
    fleet: Fleet, tmp_path: Path
) -> None:
    # 70 bytes a byte per 0.2 s: a head would take 14 s; the bound is 1 s
    async with gateway_process(fleet, tmp_path, gateway_head_timeout=1.0) as gateway:
        keep_alive = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n"
        slow = [asyncio.create_task(trickle(gateway.port)) for _ in range(50)]
        slow.append(asyncio.create_task(trickle(gateway.port, first=keep_alive)))
        async with gateway.http() as http:
            job_id = await finished_job(http)  # served while they trickle
            answers = await asyncio.gather(*(http.get(f"/v1/jobs/{job_id}") for _ in range(20)))
            assert [a.status_code for a in answers] == [200] * 20
            assert await asyncio.gather(*slow) == [True] * 51
            health = (await http.get("/healthz")).json()
        assert health["heads_timed_out"] >= 51


# -- a client that stops reading --------------------------------------------------------------

# an 8 MB reply, paced (4,000 tokens/s): entries of a few tokens, each far below the bound
# 8 MB over about 8 s: the job is still live when the client stops reading (a reply that
# ended before it connected is a replay, which a non-reader holds until the send timeout)
BIG = {"tokens": 4_000, "words": "x" * 2_000, "rate": 500.0}


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def open_events(port: int, path: str, last_id: str | None = None) -> Stream:
    """A raw connection with a small receive buffer, the request sent, the head read."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    # (a StreamReader reads ahead into its buffer until twice its limit: keep that small)
    reader, writer = await asyncio.open_connection(sock=sock, limit=16_384)
    resume = f"Last-Event-ID: {last_id}\r\n" if last_id else ""
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {KEY}\r\n{resume}\r\n"
        .encode()
    )  # fmt: skip
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return reader, writer


def sse_text(chunked: bytes) -> str:
    """The body of a chunked response, what arrived of it (a cut chunk included)."""
    out, rest = bytearray(), chunked
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep or not size_line:
            break
        size = int(size_line, 16)
        out += rest[:size]
        rest = rest[size + 2 :]
    return out.decode(errors="replace")


async def read_until_closed(stream: Stream) -> bytes:
    reader, writer = stream
    data = bytearray()
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(1 << 16):
            data += chunk
    writer.close()
    return bytes(data)


async def test_a_client_that_stops_reading_is_dropped_and_resumes(
    fleet: Fleet, tmp_path: Path
) -> None:
    async with (
        gateway_process(fleet, tmp_path, gateway_client_buffer_bytes=65_536) as gateway,
        gateway.http() as http,
    ):
        accepted = await http.post(
            "/v1/chat/completions", json=chat("big", **BIG), headers={"prefer": "respond-async"}
        )
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["id"]
        stream = await open_events(gateway.port, f"/v1/jobs/{job_id}/events")
        # it reads nothing more while the reply is written: the gateway lets it go
        await eventually(lambda: dropped(gateway.log), 60, every=0.2)
        before = parse_frames(complete_events(sse_text(await read_until_closed(stream))))
        assert before[-1].data != "[DONE]"  # it was dropped before the end
        last_id = [e.id for e in before if e.id][-1]
        resumed = await read_until_closed(
            await open_events(gateway.port, f"/v1/jobs/{job_id}/events", last_id)
        )
        after = parse_frames(sse_text(resumed))
        assert after[-1].data == "[DONE]"
        content = content_of(chunks_of(before)) + content_of(chunks_of(after))
        assert content == expected_reply(chat("big", **BIG), MOCK)


async def dropped(log: Path) -> bool:
    return "dropped a client that fell behind" in await asyncio.to_thread(log.read_text)


def complete_events(text: str) -> str:
    """The events that arrived whole, up to the last one with an id (a resume point)."""
    return text[: text.rfind("\n\n") + 2]
