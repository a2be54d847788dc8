"""Importing ``worker.client`` and using ``Client`` / ``SyncClient`` changes nothing in the
host process: no epoll set, no fork hook, no thread, no event loop policy or loop left
behind (issue 37). Run in a fresh interpreter, against the test session's redis-server."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers.servers import RedisServer, needs_redis_server

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys, threading, traceback

    hooks = []
    real_register = os.register_at_fork

    def register(**kw):  # who asks: the standard library's own (logging, threads) are not ours
        hooks.append(traceback.extract_stack(limit=2)[0].filename)
        real_register(**kw)

    os.register_at_fork = register

    def epolls():
        kinds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
        return sum("eventpoll" in kind for kind in kinds)

    def safe_epolls():
        try:
            return epolls()
        except OSError:
            return -1

    before = {"epolls": safe_epolls(), "threads": threading.active_count(),
              "policy": type(asyncio.get_event_loop_policy()).__module__}
    from worker.client import Client, SyncClient
    from worker.settings import Settings
    url, prefix = sys.argv[1], sys.argv[2]
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    async def use():
        async with Client.from_url(url, prefix=prefix) as client:
            job = await client.enqueue(request)
            await client.get(job)
            await client.cancel(job)
            return job

    job = asyncio.run(use())
    with SyncClient(Settings(_env_file=None, redis_url=url, prefix=prefix)) as client:
        client.enqueue(request)
        client.get(job)
    after = {"epolls": safe_epolls(), "threads": threading.active_count(),
             "policy": type(asyncio.get_event_loop_policy()).__module__}
    print(json.dumps({"before": before, "after": after, "hooks": hooks,
                      "running_loop": asyncio._get_running_loop() is not None}))
    """
)


def test_the_client_leaves_its_host_process_as_it_found_it(
    redis_server: RedisServer | None, prefix: str
) -> None:
    server = needs_redis_server(redis_server)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, server.url, prefix],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    import worker

    ours = str(Path(worker.__file__).parent)
    assert [hook for hook in seen["hooks"] if hook.startswith(ours)] == []  # no fork hook
    assert seen["after"] == seen["before"]  # no epoll set left, no thread, same loop policy
    assert not seen["running_loop"]
