"""The workers of a process-level test: ``chatstream worker`` subprocesses on one Redis, one
key prefix and one upstream, with the keys and a client to watch them.

The ``fleet`` fixture (tests/conftest.py) is one on the session's redis-server and the
in-process mock upstream; a test with another Redis or upstream opens ``Fleet.session``.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from tests.helpers.checks import eventually
from tests.helpers.processes import settings_env, spawn_worker, worker_env
from worker.client import Client
from worker.store.keys import Keys
from worker.store.redis_client import RedisClient
from worker.testing.mock_upstream import MockUpstream

Process = subprocess.Popen[bytes]


class Fleet:
    """``chatstream worker`` subprocesses sharing one environment (:func:`worker_env` with
    ``settings``), their logs in ``directory``. ``spawn`` starts one (more settings on top),
    ``ready`` waits until it beats, ``start`` does both for ``n``; ``stop`` sends SIGTERM and
    checks a clean exit. Whatever still runs when ``Fleet.session`` (or the fixture) ends is
    killed."""

    def __init__(
        self,
        directory: Path,
        redis: RedisClient,
        redis_url: str,
        prefix: str,
        upstream_url: str,
        *,
        shards: int = 1,
        mock: MockUpstream | None = None,
        **settings: Any,
    ) -> None:
        self.directory = directory
        self.redis = redis
        self.keys = Keys(prefix, shards)
        self.client = Client(redis, prefix=prefix, queue_shards=shards)
        self.upstream_url = upstream_url
        self._mock = mock
        if shards != 1:
            settings = {"queue_shards": shards, **settings}
        self.env = worker_env(redis_url, prefix, upstream_url, **settings)
        self.processes: list[Process] = []
        self.logs: list[Path] = []

    @property
    def mock(self) -> MockUpstream:
        """The in-process mock upstream the workers call (the fixture's)."""
        assert self._mock is not None, "this fleet's upstream is not an in-process mock"
        return self._mock

    def configure(self, **settings: Any) -> None:
        """Settings of every worker spawned from now on."""
        self.env.update(settings_env(**settings))

    def spawn(self, *args: str, **settings: Any) -> Process:
        """``chatstream worker ARGS`` with ``settings`` on top of the fleet's; not waited for."""
        log = self.directory / f"worker-{len(self.processes)}.log"
        with log.open("wb") as out:
            process = spawn_worker(
                {**self.env, **settings_env(**settings)}, self.directory, out, *args
            )
        self.processes.append(process)
        self.logs.append(log)
        return process

    async def ready(self, process: Process, timeout: float = 20) -> None:
        """Until the process wrote its heartbeat (it consumes from then on)."""
        marker = f"-{process.pid}-"

        async def beating() -> bool:
            assert process.poll() is None, self.output()
            names = await self.redis.zrange(self.keys.workers, 0, -1)
            return any(marker in name for name in names)

        await eventually(beating, timeout, every=0.05)

    async def start(self, n: int = 1, *args: str, **settings: Any) -> list[Process]:
        """``n`` workers spawned, then each waited for until it beats."""
        processes = [self.spawn(*args, **settings) for _ in range(n)]
        for process in processes:
            await self.ready(process)
        return processes

    def output(self) -> str:
        """Every worker's log so far, each under its file name."""
        return "\n".join(f"--- {log.name}\n{log.read_text()}" for log in self.logs)

    async def stop(self, processes: list[Process] | None = None, timeout: float = 15) -> str:
        """SIGTERM to ``processes`` (default: every one still running): each must exit 0
        within ``timeout`` seconds, with no traceback in any log; returns the logs."""
        if processes is None:
            processes = [process for process in self.processes if process.poll() is None]
        for process in processes:
            process.send_signal(signal.SIGTERM)
        codes = [await asyncio.to_thread(process.wait, timeout) for process in processes]
        output = self.output()
        assert codes == [0] * len(processes), output
        assert "Traceback" not in output, output
        return output

    def kill_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()

    @classmethod
    @asynccontextmanager
    async def session(
        cls,
        directory: Path,
        redis: RedisClient,
        redis_url: str,
        prefix: str,
        upstream_url: str,
        **options: Any,
    ) -> AsyncIterator[Fleet]:
        """A fleet whose workers are killed when the block ends (``options``: see ``Fleet``)."""
        fleet = cls(directory, redis, redis_url, prefix, upstream_url, **options)
        try:
            yield fleet
        finally:
            fleet.kill_all()
