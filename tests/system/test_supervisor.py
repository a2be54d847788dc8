"""``chatstream worker --processes N``: real worker processes under the supervisor."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from tests.helpers.harness import chat
from tests.helpers.servers import RedisServer
from worker.client import Client
from worker.service.supervisor import Supervisor
from worker.settings import Settings
from worker.store.keys import Keys
from worker.testing.mock_upstream import MockUpstream

PY = sys.executable


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def pid_of(worker_name: str) -> int:
    return int(worker_name.rsplit("-", 2)[1])  # hostname-pid-hex


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class Supervised:
    """``chatstream worker --processes N``: the supervisor process, and the Redis its
    children work on."""

    process: asyncio.subprocess.Process
    redis: Redis
    keys: Keys
    client: Client
    log: Path

    async def live_pids(self) -> set[int]:
        names: Any = await self.redis.zrange(self.keys.workers, 0, -1)
        return {pid for pid in map(pid_of, names) if alive(pid)}

    async def wait_for_workers(self, count: int) -> set[int]:
        async def ready() -> bool:
            return len(await self.live_pids()) >= count

        await eventually(ready)
        return await self.live_pids()

    async def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.process.wait(), 30)


@pytest.fixture
async def supervised(
    settings: Settings,
    redis: Redis,
    redis_server: RedisServer | None,
    mock_upstream: tuple[MockUpstream, str],
    tmp_path: Path,
) -> AsyncIterator[Supervised]:
    if redis_server is None:
        pytest.skip("worker processes need a real redis-server")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATSTREAM_")}
    env |= {
        "CHATSTREAM_REDIS_URL": redis_server.url,
        "CHATSTREAM_PREFIX": settings.prefix,
        "CHATSTREAM_UPSTREAM_URL": mock_upstream[1],
        "CHATSTREAM_LEASE_SECONDS": "1",
        "CHATSTREAM_BLOCK_MS": "100",
        "CHATSTREAM_SHUTDOWN_GRACE_SECONDS": "10",
    }
    log = tmp_path / "supervisor.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *(PY, "-m", "worker.cli", "worker", "--processes", "2"),
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=out,
        )
    keys = Keys(settings.prefix)
    supervised = Supervised(process, redis, keys, Client.from_settings(settings, redis), log)
    try:
        yield supervised
    finally:
        pids = await supervised.live_pids()
        if process.returncode is None:
            process.kill()
            await process.wait()
        for pid in pids:  # children of a supervisor that failed the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_a_killed_worker_is_restarted_and_its_jobs_complete(supervised: Supervised) -> None:
    first = await supervised.wait_for_workers(2)
    assert len(first) == 2
    jobs = [await supervised.client.enqueue(chat(f"k{i}", tokens=20, rate=20)) for i in range(6)]

    async def some_job_running() -> bool:
        records = [await supervised.client.get(job) for job in jobs]
        return any(r.status == "running" and r.worker for r in records)

    await eventually(some_job_running)
    running = [
        r for r in [await supervised.client.get(job) for job in jobs] if r.status == "running"
    ]
    victim = pid_of(running[0].worker or "")
    os.kill(victim, signal.SIGKILL)

    async def replaced() -> bool:
        pids = await supervised.live_pids()
        return victim not in pids and len(pids) == 2 and bool(pids - first)

    await eventually(replaced)
    for job in jobs:
        record = await supervised.client.result(job, timeout=30)
        assert record.status == "succeeded", record.error
    survivors = await supervised.live_pids()
    assert await supervised.stop() == 0
    assert not any(alive(pid) for pid in survivors)
    assert "restarting in" in supervised.log.read_text()


async def test_sigterm_stops_every_worker_gracefully(supervised: Supervised) -> None:
    pids = await supervised.wait_for_workers(2)
    jobs = [await supervised.client.enqueue(chat(f"t{i}", tokens=30, rate=20)) for i in range(4)]

    async def all_running() -> bool:
        records = [await supervised.client.get(job) for job in jobs]
        return all(r.status == "running" for r in records)

    await eventually(all_running)
    assert await supervised.stop() == 0
    assert not any(alive(pid) for pid in pids)
    # the running jobs finished within the grace period, nothing was cut short
    for job in jobs:
        assert (await supervised.client.get(job)).status == "succeeded"
    assert await supervised.redis.zcard(supervised.keys.workers) == 0  # each child left the fleet


# -- the supervisor alone, with stand-in children ---------------------------------------


def python(code: str) -> list[str]:
    return [PY, "-c", code]


async def test_crashing_children_are_restarted_with_backoff() -> None:
    supervisor = Supervisor(
        1, python("import sys; sys.exit(3)"), initial_backoff=0.05, max_backoff=0.4
    )
    starts: list[float] = []
    spawn = supervisor._spawn

    async def counting_spawn(slot: int) -> asyncio.subprocess.Process:
        starts.append(time.monotonic())
        return await spawn(slot)

    supervisor._spawn = counting_spawn  # type: ignore[method-assign]
    run = asyncio.create_task(supervisor.run())
    # signalled while it waits to restart the crashed child: nothing to stop, exit 0
    await eventually(lambda: _true(len(starts) >= 4 and not supervisor.children), timeout=20)
    supervisor.signal_children(signal.SIGTERM)
    assert await asyncio.wait_for(run, 10) == 0
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1 and gaps[2] >= 0.2  # doubling


async def _true(value: bool) -> bool:
    return value


async def test_exit_code_is_1_when_a_child_does_not_stop_cleanly(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = (
        "import signal, sys, time, pathlib\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(2))\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(60)\n"
    )
    supervisor = Supervisor(1, python(code))
    run = asyncio.create_task(supervisor.run())
    await eventually(lambda: _true(ready.exists()))
    supervisor.signal_children(signal.SIGTERM)
    assert await asyncio.wait_for(run, 10) == 1


async def test_a_child_ignoring_the_signal_is_killed_after_the_deadline(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = (
        "import signal, time, pathlib\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(60)\n"
    )
    supervisor = Supervisor(2, python(code), kill_after=0.5)
    run = asyncio.create_task(supervisor.run())
    await eventually(lambda: _true(len(supervisor.children) == 2 and ready.exists()))
    began = time.monotonic()
    supervisor.signal_children(signal.SIGTERM)
    assert await asyncio.wait_for(run, 10) == 1
    assert 0.4 < time.monotonic() - began < 5
