"""Hostile input against a real ``chatstream gateway`` process, with a ``chatstream worker``
behind it: ids Redis would refuse, bodies nested deeper than a worker runs, a client that
stops reading, request heads that trickle in (docs/security.md, docs/failures.md)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from schemas.requests import MAX_NESTING
from tests.helpers.checks import until_serving
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
            response = await http.get(events, headers={"last-event-id": bad.encode()})
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
