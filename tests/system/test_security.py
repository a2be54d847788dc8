"""Security through the command: ``chatstream`` with a password in its Redis URL never
prints it (the rest of the security tests are in ``tests/unit/test_security.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from tests.helpers.servers import REDIS_PASSWORD, AuthRedisServer


async def cli(env: dict[str, str], tmp_path: Path, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys; from worker.cli import main; main(sys.argv[1:])",
        *args,
        cwd=tmp_path,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_cli_works_with_a_password_and_never_prints_it(
    password_server: AuthRedisServer, tmp_path: Path
) -> None:
    env = {"CHATSTREAM_REDIS_URL": password_server.url, "CHATSTREAM_PREFIX": "pw-cli"}
    code, out, err = await cli(env, tmp_path, "enqueue", "--model", "m", "--message", "hi")
    assert code == 0, err
    job_id = out.strip()
    code, out, err = await cli(env, tmp_path, "status", job_id, "--json")
    assert code == 0, err
    assert json.loads(out)["status"] == "queued"
    assert REDIS_PASSWORD not in out + err
