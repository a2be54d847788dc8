"""``chatstream worker --processes N``: N worker processes under one supervisor.

Each child is ``python -m worker.cli worker`` with the supervisor's environment (so the
same settings). A child that exits while the supervisor is not shutting down is started
again after a backoff that doubles with every quick crash (one that lived less than
``min_uptime``) up to ``max_backoff``. SIGTERM / SIGINT are forwarded to every child, which
shuts down as ``runner.serve`` does (running jobs finish or are handed back); a second
signal is forwarded too (a child then exits at once), and children still running
``kill_after`` seconds after the first one are killed. The supervisor returns 0 when every
child exited 0 after the shutdown signal, else 1.

Children run in their own process groups, so a terminal's Ctrl-C reaches each of them
once, through the supervisor; and each watches its parent (:func:`watch_parent`): if the
supervisor dies, the orphaned child shuts down gracefully on its own. With a fixed
``metrics_port``, child ``i`` serves its metrics on ``metrics_port + i``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from worker.settings import SUPERVISOR_PID_VARIABLE, Settings

log = logging.getLogger("chatstream.supervisor")

ENV_SUPERVISOR = SUPERVISOR_PID_VARIABLE
KILL_MARGIN = 30.0  # seconds past the shutdown grace before a child is killed
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Supervisor:
    def __init__(
        self,
        processes: int,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        metrics_port: int | None = None,
        kill_after: float = 60.0,
        min_uptime: float = 10.0,
        initial_backoff: float = 0.5,
        max_backoff: float = 30.0,
    ) -> None:
        if processes < 1:
            raise ValueError("processes must be at least 1")
        self.processes = processes
        self.command = list(command)
        self.env = dict(os.environ if env is None else env)
        self.metrics_port = metrics_port
        self.kill_after = kill_after
        self.min_uptime = min_uptime
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.children: dict[int, asyncio.subprocess.Process] = {}
        self.stopping = asyncio.Event()
        self._killer: asyncio.TimerHandle | None = None

    async def run(self) -> int:
        """Run the children until a signal and they have all exited; the exit code."""
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self.signal_children, sig)
        try:
            codes = await asyncio.gather(*(self._keep(slot) for slot in range(self.processes)))
        finally:
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)
            if self._killer is not None:
                self._killer.cancel()
            self._kill_all()  # only children left by an error in the supervisor itself
        failed = {slot: code for slot, code in enumerate(codes) if code != 0}
        if failed:
            log.warning("workers exited with errors: %s", failed)
        log.info("all %d workers stopped", self.processes)
        return 1 if failed else 0

    def signal_children(self, signum: int) -> None:
        """Shut down: forward the signal to every child; no more restarts."""
        first = not self.stopping.is_set()
        self.stopping.set()
        name = signal.Signals(signum).name
        log.info("%s: stopping %d workers", name, len(self.children))
        for process in list(self.children.values()):
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signum)
        if first:
            loop = asyncio.get_running_loop()
            self._killer = loop.call_later(self.kill_after, self._kill_all)

    def _kill_all(self) -> None:
        for slot, process in list(self.children.items()):
            if process.returncode is None:
                log.warning("worker %d (pid %d) did not stop; killing it", slot, process.pid)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()

    async def _keep(self, slot: int) -> int:
        """Keep one child running until shutdown; its exit code after the signal."""
        crashes = 0
        while True:
            process = await self._spawn(slot)
            began = time.monotonic()
            code = await process.wait()
            del self.children[slot]
            if self.stopping.is_set():
                log.info("worker %d (pid %d) exited with %d", slot, process.pid, code)
                return code
            crashes = crashes + 1 if time.monotonic() - began < self.min_uptime else 1
            delay = min(self.initial_backoff * 2 ** (crashes - 1), self.max_backoff)
            log.warning(
                "worker %d (pid %d) exited with %d; restarting in %.1fs",
                slot,
                process.pid,
                code,
                delay,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)
            if self.stopping.is_set():
                return 0  # it had stopped before the shutdown: nothing left to stop

    async def _spawn(self, slot: int) -> asyncio.subprocess.Process:
        env = {**self.env, ENV_SUPERVISOR: str(os.getpid())}
        if self.metrics_port:
            env["CHATSTREAM_METRICS_PORT"] = str(self.metrics_port + slot)
        process = await asyncio.create_subprocess_exec(
            *self.command, env=env, **_own_process_group()
        )
        self.children[slot] = process
        if self.stopping.is_set():  # a signal arrived while it was starting
            process.send_signal(signal.SIGTERM)
        log.info("worker %d started (pid %d)", slot, process.pid)
        return process


def worker_command(concurrency: int = 0) -> list[str]:
    command = [sys.executable, "-m", "worker.cli", "worker"]
    if concurrency:
        command += ["--concurrency", str(concurrency)]
    return command


async def supervise(settings: Settings, processes: int, *, concurrency: int = 0) -> int:
    supervisor = Supervisor(
        processes,
        worker_command(concurrency),
        metrics_port=settings.metrics_port,
        kill_after=settings.shutdown_grace_seconds + KILL_MARGIN,
    )
    return await supervisor.run()


def _own_process_group() -> dict[str, Any]:
    """Start a child in a process group of its own: ``process_group=0``, or under uvloop
    (whose ``subprocess_exec`` does not take it) the same ``setpgid(0, 0)`` as
    ``preexec_fn``."""
    if type(asyncio.get_running_loop()).__module__.startswith("uvloop"):
        return {"preexec_fn": os.setpgrp}
    return {"process_group": 0}


def watch_parent(interval: float = 1.0) -> asyncio.Task[None] | None:
    """In a supervised child: SIGTERM ourselves (a graceful shutdown) if the supervisor dies."""
    expected = os.environ.get(ENV_SUPERVISOR)
    if not expected or not expected.isdigit():
        return None

    async def watch() -> None:
        while True:
            await asyncio.sleep(interval)
            if os.getppid() != int(expected):
                break
        log.warning("the supervisor (pid %s) is gone; shutting down", expected)
        os.kill(os.getpid(), signal.SIGTERM)

    return asyncio.create_task(watch(), name="chatstream-parent-watch")
