"""The worker process: startup -> consume -> graceful shutdown.

Slots: at most ``concurrency`` jobs run at once, each an asyncio task; the consumer only
reads as many queue entries as there are free slots. A maintenance task renews the
leases of running jobs, reclaims entries of dead workers, polls cancel flags (a fallback
for the pub/sub cancel message) and writes the heartbeat. Signals are captured in
:func:`serve` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import time
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError

from worker.keys import Keys
from worker.pipeline import JobRun, Outcome, Services, run_job
from worker.publisher import Publisher
from worker.queue import Entry, Queue
from worker.records import Records, as_text
from worker.settings import Settings
from worker.upstream import UpstreamClient

log = logging.getLogger("chatstream.worker")


@dataclass(slots=True)
class Running:
    entry: Entry
    task: asyncio.Task[None]
    job: JobRun | None = None  # set once the attempt started
    lost: bool = False


def worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Worker:
    def __init__(
        self,
        settings: Settings,
        redis: Redis,
        upstream: UpstreamClient | None = None,
        name: str | None = None,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.name = name or worker_name()
        self.keys = Keys(settings.prefix)
        self.records = Records(redis, self.keys, settings.retention_seconds)
        self.queue = Queue(redis, self.keys, self.name)
        self.publisher = Publisher(redis, self.records, settings.publish_max_batch)
        self.upstream = upstream or UpstreamClient(settings)
        self.services = Services(settings, self.records, self.publisher, self.upstream, self.name)
        self.running: dict[str, Running] = {}
        self.processed = 0
        self.stopping = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []

    # -- lifecycle ---------------------------------------------------------------------

    async def startup(self) -> None:
        await self.queue.ensure_group()
        await self.records.load_scripts()
        self.publisher.start()
        self._background = [
            asyncio.create_task(self._maintain(), name="chatstream-maintain"),
            asyncio.create_task(self._listen_for_cancels(), name="chatstream-cancels"),
        ]
        log.info("worker %s started (concurrency %d)", self.name, self.settings.concurrency)

    async def consume(self) -> None:
        """Read and launch jobs until asked to stop."""
        while not self.stopping.is_set():
            free = await self._free_slots()
            entries = await self._read(free)
            for entry in entries:
                self._launch(entry)

    async def shutdown(self) -> None:
        """Stop intake, let running jobs finish within the grace period, release the rest."""
        self.stopping.set()
        tasks = [run.task for run in self.running.values()]
        if tasks:
            log.info(
                "waiting up to %gs for %d jobs", self.settings.shutdown_grace_seconds, len(tasks)
            )
            await asyncio.wait(tasks, timeout=self.settings.shutdown_grace_seconds)
        await self._release_all()
        await self._requeue_unstarted()
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.publisher.stop()
        await self._leave()
        await self.upstream.aclose()
        log.info("worker %s stopped after %d jobs", self.name, self.processed)

    async def run_burst(self, block_ms: int = 50) -> int:
        """Run everything that is queued (or reclaimable) now, then return; for tests."""
        done_before = self.processed
        while True:
            free = self.settings.concurrency - len(self.running)
            entries = await self._read(free, block_ms=block_ms) if free else []
            for entry in entries:
                self._launch(entry)
            if not self.running:
                if not entries:
                    return self.processed - done_before
                continue
            await asyncio.wait(
                [run.task for run in self.running.values()], return_when=asyncio.FIRST_COMPLETED
            )

    # -- jobs --------------------------------------------------------------------------

    async def _free_slots(self) -> int:
        while (free := self.settings.concurrency - len(self.running)) <= 0:
            self._slot_freed.clear()
            await self._slot_freed.wait()
        return free

    async def _read(self, count: int, block_ms: int | None = None) -> list[Entry]:
        try:
            entries = await self.queue.read(count, block_ms or self.settings.block_ms)
            if len(entries) < count:
                entries += await self.queue.reclaim(count - len(entries), self._lease_ms)
            return entries
        except RedisError as exc:
            log.warning("reading the queue failed (%s); retrying", exc)
            await asyncio.sleep(0.5)
            return []

    @property
    def _lease_ms(self) -> int:
        return int(self.settings.lease_seconds * 1000)

    def _launch(self, entry: Entry) -> None:
        task = asyncio.create_task(self._handle(entry), name=f"job-{entry.job_id}")
        # registered before it runs, so its lease is renewed from the first moment
        self.running[entry.entry_id] = Running(entry, task)

    async def _handle(self, entry: Entry) -> None:
        try:
            await self._run_entry(entry)
        except Exception:
            log.exception("job %s: unexpected failure; the entry will be reclaimed", entry.job_id)
        finally:
            self.running.pop(entry.entry_id, None)
            self.processed += 1
            self._slot_freed.set()

    async def _run_entry(self, entry: Entry) -> None:
        if entry.job_id is None:
            log.error("dropping queue entry %s without a job id: %r", entry.entry_id, entry.raw)
            await self.queue.ack(entry.entry_id)
            return
        started = await self.records.start(entry.job_id, self.name, self.settings.max_attempts)
        if started.state != "started":
            await self._skip(entry, started.state, started.attempt)
            return
        run = self.running[entry.entry_id]
        stream = self.publisher.open(entry.job_id, started.attempt)
        run.job = JobRun(entry.job_id, started.attempt, started.request, started.upstream, stream)
        outcome = await run_job(self.services, run.job)
        await self._settle(run, run.job, outcome)

    async def _skip(self, entry: Entry, state: str, attempt: int) -> None:
        if state == "missing":
            log.error("job %s has no record (expired or never created); dropping", entry.job_id)
        elif state == "exhausted":
            log.error("job %s failed: attempts exhausted after attempt %d", entry.job_id, attempt)
            await self.queue.dead_letter(
                entry.job_id or "", {"code": "attempts_exhausted", "attempts": attempt}
            )
        await self.queue.ack(entry.entry_id)

    async def _settle(self, run: Running, job: JobRun, outcome: Outcome) -> None:
        if outcome is Outcome.FINISHED:
            await self.queue.ack(run.entry.entry_id)
        elif (
            outcome is Outcome.RELEASED
            and not run.lost
            and await self.records.release(job.job_id, job.attempt)
        ):
            await self.queue.requeue(run.entry.entry_id, job.job_id)

    async def _release_all(self) -> None:
        remaining = list(self.running.values())
        for run in remaining:
            if run.job is not None:
                run.job.release_requested = True
            run.task.cancel()
        if remaining:
            log.info("released %d unfinished jobs to the queue", len(remaining))
            await asyncio.gather(*(run.task for run in remaining), return_exceptions=True)

    async def _requeue_unstarted(self) -> None:
        """Entries delivered to us that never got a task (a read cut short by shutdown)."""
        try:
            for entry_id in await self.queue.owned():
                await self.queue.requeue_owned(entry_id)
        except RedisError as exc:
            log.warning("could not hand back pending entries: %s", exc)

    # -- background --------------------------------------------------------------------

    async def _maintain(self) -> None:
        interval = self.settings.lease_seconds / 3
        while True:
            try:
                await self._renew_leases()
                await self._poll_cancel_flags()
                await self.redis.zadd(self.keys.workers, {self.name: time.time()})
            except RedisError as exc:
                log.warning("lease maintenance failed: %s", exc)
            await asyncio.sleep(interval)

    async def _renew_leases(self) -> None:
        lost = await self.queue.renew(list(self.running))
        for entry_id in lost:
            run = self.running.get(entry_id)
            if run is not None:
                log.warning("job %s: lease lost to another worker; stopping", run.entry.job_id)
                run.lost = True
                if run.job is not None:
                    run.job.release_requested = True
                run.task.cancel()

    async def _poll_cancel_flags(self) -> None:
        runs = [run for run in self.running.values() if run.job is not None]
        if not runs:
            return
        pipe = self.redis.pipeline(transaction=False)
        for run in runs:
            pipe.hget(self.keys.job(run.entry.job_id or ""), "cancel_requested")
        for run, flag in zip(runs, await pipe.execute(), strict=True):
            if flag is not None and as_text(flag) == "1":
                self._cancel_run(run)

    async def _listen_for_cancels(self) -> None:
        while True:
            try:
                async with self.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self.keys.cancel_channel)
                    async for message in pubsub.listen():
                        self.cancel_local(as_text(message["data"]))
            except RedisError as exc:
                log.warning("cancel listener lost Redis (%s); resubscribing", exc)
                await asyncio.sleep(0.5)

    def cancel_local(self, job_id: str) -> bool:
        for run in self.running.values():
            if run.entry.job_id == job_id and run.job is not None:
                self._cancel_run(run)
                return True
        return False

    def _cancel_run(self, run: Running) -> None:
        if run.job is not None and not run.job.cancel_requested:
            log.info("job %s: cancel requested; closing the upstream", run.job.job_id)
            run.job.cancel_requested = True
            run.task.cancel()

    async def _leave(self) -> None:
        with contextlib.suppress(RedisError):
            await self.redis.zrem(self.keys.workers, self.name)


async def serve(settings: Settings, redis: Redis) -> None:
    """Run a worker until SIGTERM/SIGINT; a second signal exits at once."""
    worker = Worker(settings, redis)
    loop = asyncio.get_running_loop()
    consume: asyncio.Task[None] | None = None

    def on_signal(signum: int) -> None:
        if worker.stopping.is_set():
            log.warning("second signal: exiting now")
            os._exit(1)
        log.info("signal %s: shutting down gracefully", signal.Signals(signum).name)
        worker.stopping.set()
        if consume is not None:
            consume.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await worker.startup()
    consume = asyncio.create_task(worker.consume())
    try:
        await consume
    except asyncio.CancelledError:
        if not worker.stopping.is_set():
            raise
    finally:
        await worker.shutdown()
