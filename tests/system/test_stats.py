"""``chatstream stats`` in a subprocess: the JSON and the table of a busy queue (what
``collect`` finds in it is checked in tests/unit/store/test_stats.py)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from redis.asyncio import Redis

from tests.helpers.harness import busy_queue
from tests.helpers.servers import RedisServer
from worker.settings import Settings


async def test_stats_command_prints_json_and_a_table(
    settings: Settings, redis: Redis, redis_server: RedisServer | None, tmp_path: Path
) -> None:
    if redis_server is None:
        return  # the command runs in a subprocess: it needs a real server
    await busy_queue(settings, redis)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATSTREAM_")}
    env |= {"CHATSTREAM_REDIS_URL": redis_server.url, "CHATSTREAM_PREFIX": settings.prefix}
    outputs = []
    for extra in (["--json"], []):
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "worker.cli",
            "stats",
            *extra,
            env=env,
            cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == 0, err.decode()
        outputs.append(out.decode())
    data = json.loads(outputs[0])
    assert (data["queue_length"], data["waiting"], data["pending"]) == (3, 2, 3)
    assert data["tenants"] == {"default": {"waiting": 2, "running": 3}}
    assert data["pending_by_consumer"] == {"a": 2, "b": 1}
    assert data["dead_letters"] == 2
    assert data["live_workers"] == ["w-live-1", "w-live-2"]
    assert data["oldest_waiting_seconds"] >= 0
    assert "2 waiting, 3 pending (3 stream entries)" in outputs[1]
