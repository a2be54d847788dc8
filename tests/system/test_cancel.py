"""``chatstream cancel`` in a subprocess, against an in-process worker running the job: a
running job is cancelled (its partial output kept), a queued one at once, an unknown one
is one line."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from tests.helpers.harness import (
    Harness,
    assert_cancelled_with_partial_output,
    chat,
    start_slow_job,
)


async def cli(h: Harness, tmp_path: Path, *args: str) -> tuple[int, str, str]:
    """Run ``chatstream ARGS`` in a subprocess against the test's Redis and prefix."""
    env = {
        **os.environ,
        "CHATSTREAM_REDIS_URL": h.settings.redis_url,
        "CHATSTREAM_PREFIX": h.settings.prefix,
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys; from worker.cli import main; main(sys.argv[1:])",
        *args,
        cwd=tmp_path,  # no stray .env
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_cli_cancels_a_running_job(harness: Harness, tmp_path: Path) -> None:
    job_id, burst = await start_slow_job(harness)
    code, out, err = await cli(harness, tmp_path, "cancel", job_id)
    assert (code, out.strip(), err) == (0, "requested", "")
    await burst
    await assert_cancelled_with_partial_output(harness, job_id)


async def test_cli_cancel_of_a_queued_job_and_an_unknown_job(
    harness: Harness, tmp_path: Path
) -> None:
    job_id = await harness.client.enqueue(chat("queued"))
    code, out, _ = await cli(harness, tmp_path, "cancel", job_id)
    assert (code, out.strip()) == (0, "cancelled")
    code, out, err = await cli(harness, tmp_path, "cancel", "nope")
    assert code == 1
    assert out == ""
    assert err.strip() == "chatstream: error: no job 'nope' (never enqueued, or expired)"
