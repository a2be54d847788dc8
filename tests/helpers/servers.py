"""Redis servers of the tests' own: a redis-server subprocess on a free loopback port."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as sync_redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """A redis-server subprocess owned by the test session (restartable for outage tests)."""

    def __init__(self, executable: str, directory: Path, *extra: str) -> None:
        self.executable = executable
        self.directory = directory
        self.extra = extra
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        command = [
            self.executable,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(self.directory),
            "--protected-mode",
            "no",
            *self.extra,
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        self.wait_ready()

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        client = sync_redis.Redis.from_url(self.url)
        try:
            while True:
                try:
                    client.ping()
                    return
                except sync_redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def kill(self) -> None:
        """SIGKILL: without persistence, everything it held is gone."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


def redis_executable() -> str | None:
    return shutil.which("redis-server")


def needs_redis_server(server: RedisServer | None) -> RedisServer:
    if server is None:
        pytest.skip("needs a real redis-server")
    return server


REDIS_PASSWORD = "Pa55-" + "q7Zx"


class AuthRedisServer(RedisServer):
    """A redis-server whose URL carries credentials."""

    def __init__(self, executable: str, directory: Path, auth: str, *extra: str) -> None:
        super().__init__(executable, directory, *extra)
        self.auth = auth

    @property
    def url(self) -> str:
        return f"redis://{self.auth}@127.0.0.1:{self.port}/0"

    @property
    def anonymous_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@contextlib.contextmanager
def auth_server(auth: str, *extra: str) -> Iterator[AuthRedisServer]:
    executable = redis_executable()
    if executable is None:
        pytest.skip("needs redis-server")
    with tempfile.TemporaryDirectory(prefix="chatstream-auth-") as directory:
        server = AuthRedisServer(executable, Path(directory), auth, *extra)
        server.start()
        try:
            yield server
        finally:
            server.stop()
