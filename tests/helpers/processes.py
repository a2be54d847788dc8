"""``chatstream`` subprocesses: the command, a clean environment, a worker's environment,
the mock upstream in its own process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import IO, Any

CHATSTREAM = str(Path(sys.executable).with_name("chatstream"))


def spawn_worker(
    env: dict[str, str], cwd: Path, log: IO[bytes], *args: str
) -> subprocess.Popen[bytes]:
    """``chatstream worker`` in the background, its output (logs) into ``log``."""
    return subprocess.Popen(
        [CHATSTREAM, "worker", *args], env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT
    )


def clean_env() -> dict[str, str]:
    """The test's environment without any CHATSTREAM_* or OTEL_* setting of the developer's."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("CHATSTREAM_", "OTEL_"))}


async def stop_worker(process: subprocess.Popen[bytes], timeout: float = 5) -> int:
    """SIGTERM; the exit code, which must come within ``timeout`` seconds."""
    process.send_signal(signal.SIGTERM)
    return await asyncio.to_thread(process.wait, timeout)


@contextmanager
def reaped(process: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """The process, killed at the end of the block if it still runs, and waited for."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


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
    env.update(settings_env(**settings))
    return env


def settings_env(**settings: Any) -> dict[str, str]:
    """``CHATSTREAM_*`` variables from settings: ``lease_seconds=2`` -> CHATSTREAM_LEASE_SECONDS."""
    return {f"CHATSTREAM_{name.upper()}": str(value) for name, value in settings.items()}


@asynccontextmanager
async def mock_process(directory: Path) -> AsyncIterator[str]:
    """``chatstream mock-upstream`` on a free port, in its own process (off our CPU),
    unpaced (``--rate 0``: its default is a reader's pace)."""
    process = await asyncio.create_subprocess_exec(
        CHATSTREAM,
        "mock-upstream",
        "--port",
        "0",
        "--rate",
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


def footprint(pid: int) -> tuple[int, int]:
    """A live process's resident memory (``VmRSS``, KiB) and open file descriptors."""
    with open(f"/proc/{pid}/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))
