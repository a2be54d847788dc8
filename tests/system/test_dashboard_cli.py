"""``chatstream dashboard`` as users run it: beside a worker process, until SIGTERM."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx

from tests.helpers.checks import until_serving
from tests.helpers.fleet import Fleet
from tests.helpers.harness import chat
from tests.helpers.processes import reaped, stop_worker
from tests.helpers.servers import free_port
from tests.system.test_gateway_cli import run, spawn

OPERATOR = "sk-cli-operator"


async def test_the_dashboard_command_serves_the_fleet_until_sigterm(
    fleet: Fleet, tmp_path: Path
) -> None:
    port = free_port()
    fleet.configure(dashboard_keys=f"ops={OPERATOR}")
    fleet.spawn()
    log_path = tmp_path / "dashboard.log"
    dashboard = spawn(["dashboard", "--port", str(port)], fleet.env, tmp_path, log_path)
    with reaped(dashboard):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as http:
            await until_serving(http)
            job_id = await fleet.client.enqueue(chat("hi"))
            await fleet.client.result(job_id, timeout=20)
            page = await http.get("/")
            found = (await http.get("/api/jobs")).json()["jobs"]
            session = (await http.get("/api/session", headers={
                "x-chatstream-dashboard-key": OPERATOR})).json()  # fmt: skip
        assert page.status_code == 200 and "dash.js" in page.text
        assert [job["id"] for job in found] == [job_id] and session["operator"] == "ops"
        assert await stop_worker(dashboard, timeout=10) == 0
    log = log_path.read_text()
    assert f"dashboard listening on http://127.0.0.1:{port} (actions with a key)" in log
    assert "Traceback" not in log and OPERATOR not in log


async def test_a_busy_port_is_one_line_on_stderr(fleet: Fleet, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = await run("dashboard", "--port", str(port), env=fleet.env, cwd=tmp_path)
    assert code == 1 and out == ""
    [line] = err.strip().splitlines()
    assert line.startswith("chatstream: error: ") and "the dashboard" in line and str(port) in line
