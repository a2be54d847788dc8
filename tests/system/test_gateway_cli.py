"""``chatstream gateway`` and ``chatstream demo --gateway`` as users run them."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.helpers.checks import until_serving
from tests.helpers.fleet import Fleet
from tests.helpers.gateway_env import KEY
from tests.helpers.harness import MOCK, chat
from tests.helpers.processes import CHATSTREAM, clean_env
from tests.helpers.servers import RedisServer, free_port, needs_redis_server
from worker.cli.demo import DEMO_REPLY
from worker.testing.mock_upstream import expected_reply


async def run(*args: str, env: dict[str, str], cwd: Path) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        CHATSTREAM, *args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    async with asyncio.timeout(30):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def spawn(args: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([CHATSTREAM, *args], env=env, cwd=cwd, stderr=out)


async def test_the_gateway_will_not_start_without_api_keys(tmp_path: Path) -> None:
    code, out, err = await run("gateway", env=clean_env(), cwd=tmp_path)
    assert code == 1 and out == ""
    assert err.strip().splitlines() == [
        "chatstream: error: the gateway needs API keys: set CHATSTREAM_GATEWAY_API_KEYS "
        "(comma-separated keys, or sha256:<hex> of a key)"
    ]


async def test_the_gateway_command_serves_until_sigterm(fleet: Fleet, tmp_path: Path) -> None:
    port = free_port()
    fleet.configure(gateway_api_keys=KEY)
    log_path = tmp_path / "gateway.log"
    fleet.spawn()  # the worker behind the gateway
    gateway = spawn(
        ["gateway", "--host", "127.0.0.1", "--port", str(port)], fleet.env, tmp_path, log_path
    )
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"authorization": f"Bearer {KEY}"}
        ) as http:
            await until_serving(http)
            response = await http.post("/v1/chat/completions", json=chat("hi"), timeout=20)
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        assert message["content"] == expected_reply(chat("hi"), MOCK)
        gateway.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(gateway.wait, 10) == 0
    finally:
        if gateway.poll() is None:
            gateway.kill()
        gateway.wait()
    log = log_path.read_text()
    assert f"gateway listening on http://127.0.0.1:{port}" in log
    assert "Traceback" not in log and KEY not in log


async def gateway_demo(
    tmp_path: Path, port: int, **env: str
) -> tuple[asyncio.subprocess.Process, list[str]]:
    """``chatstream demo --gateway`` until it serves the page: the process, its lines."""
    env = {**clean_env(), "CHATSTREAM_GATEWAY_PORT": str(port), **env}
    process = await asyncio.create_subprocess_exec(
        CHATSTREAM, "demo", "--gateway", "--rate", "200", env=env, cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    lines: list[str] = []
    async with asyncio.timeout(30):
        while not (lines and lines[-1].startswith("open ")):
            line = (await process.stdout.readline()).decode()
            assert line, "the demo ended early"
            lines.append(line)
    return process, lines


async def test_the_demo_streams_through_the_gateway_and_serves_the_page(
    tmp_path: Path,
) -> None:
    port = free_port()
    process, lines = await gateway_demo(tmp_path, port)
    assert process.stderr is not None
    page_url = lines[-1].split()[1]
    key = page_url.split("#key=")[1].split("&")[0]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        page = await http.get("/")
        completion = await http.post(
            "/v1/chat/completions",
            json={"model": "mock-demo", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": f"Bearer {key}"},
        )
    process.send_signal(signal.SIGTERM)
    async with asyncio.timeout(15):
        err = (await process.stderr.read()).decode()
        assert await process.wait() == 0, err
    out = "".join(lines)
    cut = out.index("\n[connection dropped after 12 events; resuming]\n")
    resumed = out.index("Last-Event-ID: ")
    first = out[out.index("live:\n\n") + len("live:\n\n") : cut]
    rest = out[out.index("\n\n", resumed) + 2 : out.index("\n[usage")]
    assert first + rest == DEMO_REPLY
    assert "\n[done]\n" in out
    assert page.status_code == 200 and "<title>chatstream</title>" in page.text
    assert completion.status_code == 200
    assert "Traceback" not in err


async def test_ctrl_c_stops_the_gateway_demo_with_the_interrupted_status(
    redis_server: RedisServer | None, tmp_path: Path
) -> None:
    """130, as every interrupted command (docs/operations.md); it was 0. On a real Redis."""
    url = needs_redis_server(redis_server).url
    process, _ = await gateway_demo(tmp_path, free_port(), CHATSTREAM_REDIS_URL=url)
    assert process.stderr is not None
    process.send_signal(signal.SIGINT)
    async with asyncio.timeout(15):
        err = (await process.stderr.read()).decode()
        assert await process.wait() == 130, err
    assert "Traceback" not in err


@pytest.mark.parametrize("args", [["gateway", "--port", "http"]])
async def test_gateway_usage_errors_name_the_problem(args: list[str], tmp_path: Path) -> None:
    code, _, err = await run(*args, env=clean_env(), cwd=tmp_path)
    assert code == 2 and "--port: invalid int value: 'http'" in err
