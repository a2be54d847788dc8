"""``chatstream`` subprocesses: the command, a clean environment, a worker's environment,
the mock upstream in its own process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO, Any

from tests.helpers.checks import eventually
from worker.store.keys import Keys
from worker.store.redis_client import RedisClient

CHATSTREAM = str(Path(sys.executable).with_name("chatstream"))


def spawn_worker(
    env: dict[str, str], cwd: Path, log: IO[bytes], *args: str
) -> subprocess.Popen[bytes]:
    """``chatstream worker`` in the background, its output (logs) into ``log``."""
    return subprocess.Popen(
        [CHATSTREAM, "worker", *args], env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT
    )


def clean_env() -> dict[str, str]:
    """The test's environment without any CHATSTREAM_* setting of the developer's."""
    return {k: v for k, v in os.environ.items() if not k.startswith("CHATSTREAM_")}


async def stop_worker(process: subprocess.Popen[bytes], timeout: float = 5) -> int:
    """SIGTERM; the exit code, which must come within ``timeout`` seconds."""
    process.send_signal(signal.SIGTERM)
    return await asyncio.to_thread(process.wait, timeout)


def worker_env(redis_url: str, prefix: str, upstream_url: str, **settings: Any) -> dict[str, str]:
    """The environment of a ``chatstream worker`` subprocess: CHATSTREAM_* from kwargs."""
    env = {
        **clean_env(),
        "CHATSTREAM_REDIS_URL": redis_url,
        "CHATSTREAM_PREFIX": prefix,
        "CHATSTREAM_UPSTREAM_URL": upstream_url,
        "CHATSTREAM_BLOCK_MS": "100",
        "CHATSTREAM_RETRY_INITIAL_BACKOFF": "0.01",
        "CHATSTREAM_RETRY_MAX_BACKOFF": "0.05",
    }
    env.update({f"CHATSTREAM_{name.upper()}": str(value) for name, value in settings.items()})
    return env


class WorkerProcesses:
    """``chatstream worker`` subprocesses sharing one environment; logs in ``directory``."""

    def __init__(self, directory: Path, env: dict[str, str]) -> None:
        self.directory = directory
        self.env = env
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def spawn(self, **settings: Any) -> subprocess.Popen[bytes]:
        log = self.directory / f"worker-{len(self.processes)}.log"
        env = {**self.env, **{f"CHATSTREAM_{k.upper()}": str(v) for k, v in settings.items()}}
        with log.open("wb") as out:
            process = subprocess.Popen(
                [CHATSTREAM, "worker"],
                env=env,
                cwd=self.directory,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.processes.append(process)
        self.logs.append(log)
        return process

    async def ready(
        self, process: subprocess.Popen[bytes], redis: RedisClient, keys: Keys, timeout: float = 20
    ) -> None:
        """Until the process wrote its heartbeat (it consumes from then on)."""
        marker = f"-{process.pid}-"

        async def beating() -> bool:
            assert process.poll() is None, self.output()
            names = await redis.zrange(keys.workers, 0, -1)
            return any(marker in name for name in names)

        await eventually(beating, timeout, every=0.05)

    def output(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()}" for log in self.logs)

    async def stop(self, processes: list[subprocess.Popen[bytes]], timeout: float = 15) -> str:
        """SIGTERM to ``processes``: each must exit 0 within ``timeout`` seconds, with no
        traceback in any log; returns the logs."""
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
    async def session(cls, directory: Path, env: dict[str, str]) -> AsyncIterator[WorkerProcesses]:
        group = cls(directory, env)
        try:
            yield group
        finally:
            group.kill_all()


@asynccontextmanager
async def mock_process(directory: Path) -> AsyncIterator[str]:
    """``chatstream mock-upstream`` on a free port, in its own process (off our CPU)."""
    process = await asyncio.create_subprocess_exec(
        CHATSTREAM,
        "mock-upstream",
        "--port",
        "0",
        env=clean_env(),
        cwd=directory,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 20)
        yield line.decode().rsplit(" ", 1)[-1].strip()
    finally:
        process.kill()
        await process.wait()
