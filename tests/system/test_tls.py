"""Redis over TLS (``rediss://``): the CLI in a subprocess, against the TLS-only
redis-server of ``tests/helpers/tls.py`` (the worker and client in process are in
``tests/unit/test_tls.py``).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from tests.helpers.tls import PASSWORD, TLSSetup


async def cli(
    tls: TLSSetup, tmp_path: Path, redis_url: str, *args: str, timeout: float = 15
) -> tuple[int, str, str]:
    env = {
        **os.environ,
        "CHATSTREAM_REDIS_URL": redis_url,
        "CHATSTREAM_PREFIX": tls.settings.prefix,
        "CHATSTREAM_UPSTREAM_URL": tls.settings.upstream_url,
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys; from worker.cli import main; main(sys.argv[1:])",
        *args,
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(timeout):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_cli_enqueues_and_waits_over_tls(tls: TLSSetup, tmp_path: Path) -> None:
    consume = asyncio.create_task(tls.worker.consume())
    try:
        code, out, err = await cli(
            tls, tmp_path, tls.server.url, "enqueue", "--model", "m", "--message", "hi", "--wait"
        )
        assert code == 0, err
        job_id = out.splitlines()[0]
        assert "status    succeeded" in out
        code, out, err = await cli(tls, tmp_path, tls.server.url, "status", job_id, "--json")
        assert code == 0, err
        assert '"status":"succeeded"' in out
    finally:
        tls.worker.stopping.set()
        consume.cancel()
        await asyncio.gather(consume, return_exceptions=True)


async def test_cli_reports_a_tls_failure_without_the_password(
    tls: TLSSetup, tmp_path: Path
) -> None:
    url = tls.server.url_with(tls.server.certs.other_ca)
    code, out, err = await cli(tls, tmp_path, url, "status", "x")
    assert code == 1
    assert out == ""
    assert err.startswith("chatstream: error: cannot reach Redis at rediss://:***@127.0.0.1:")
    assert "CERTIFICATE_VERIFY_FAILED" in err
    assert PASSWORD not in err
