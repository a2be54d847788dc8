"""The worker process: startup -> consume -> graceful shutdown.

Slots: at most ``concurrency`` jobs run at once, each an asyncio task holding a slot; a job
waiting for an upstream that is down gives its slot back meanwhile (up to ``max_waiting``
such jobs). The consumer only reads as many queue entries as there are free slots, taking
over the entries of dead workers first. A heartbeat task writes this worker's heartbeat
and finds workers whose heartbeat stopped (``worker/store/liveness.py``); their entries are taken
over at once. A maintenance task renews the leases of running jobs, adopts entries
delivered but never seen, polls cancel flags (a fallback for the pub/sub cancel message)
and refreshes the queue gauges. Signals are captured in :func:`serve` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from schemas.jobs import TERMINAL
from worker import logs
from worker.aio import cancel_and_wait
from worker.retry import REDIS_WAIT, often_enough, pause, retry_redis
from worker.service.metrics import Metrics, MetricsServer
from worker.service.pipeline import JobRun, Outcome, Services, log_failure, run_job
from worker.service.runtime import default_upstream_unset, startup_summary
from worker.settings import Settings
from worker.store.keys import Keys
from worker.store.liveness import Liveness
from worker.store.publisher import Publisher
from worker.store.queue import Entry, Queue
from worker.store.records import Records, Started, as_text
from worker.store.redis_client import RedisClient
from worker.store.replication import Replication
from worker.upstream.client import UpstreamClient

log = logging.getLogger("chatstream.worker")
TERMINAL_STATUSES = frozenset(status.value for status in TERMINAL)
PRUNE_EVERY = 300.0  # seconds between sweeps for consumers of dead workers


@dataclass(slots=True)
class Running:
    entry: Entry
    task: asyncio.Task[None]
    job: JobRun | None = None  # set once the attempt started
    lost: bool = False
    claimed: bool = False  # checked still ours and fresh (claim_for_start): renewed from then
    holds_slot: bool = False
    waiting: bool = False  # for a down upstream, without its slot
    settling: bool = False  # its entry is being acked or handed back (gone on purpose)


def _cancel_swallowed() -> bool:
    """This task was cancelled, yet the await returned normally (see cancel_and_wait)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Worker:
    def __init__(
        self,
        settings: Settings,
        redis: RedisClient,
        upstream: UpstreamClient | None = None,
        name: str | None = None,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.name = name or worker_name()
        self.keys = Keys(settings.prefix, settings.queue_shards)
        self.records = Records(redis, self.keys, settings.retention_seconds)
        self.queue = Queue(redis, self.keys, self.name)
        self.metrics = Metrics(
            upstreams=settings.upstream_names(), max_models=settings.metrics_max_models
        )
        self.metrics.in_flight.set_function(lambda: len(self.running) - self._waiting)
        self.http: MetricsServer | None = None  # /metrics, /healthz, /readyz
        self.replication = Replication(
            redis, settings.redis_wait_replicas, settings.redis_wait_timeout_ms
        )
        self.publisher = Publisher(
            redis,
            self.records,
            settings.publish_max_batch,
            on_batch=self.metrics.on_batch,
            replication=self.replication,
        )
        self.upstream = upstream or UpstreamClient(
            settings, on_retry=self.metrics.on_upstream_retry
        )
        self.metrics.watch_upstreams(self._upstream_health)
        self.liveness = Liveness(redis, self.keys, self.name, settings.heartbeat_timeout)
        self.services = Services(
            settings, self.records, self.publisher, self.upstream, self.name, metrics=self.metrics
        )
        self.running: dict[str, Running] = {}
        self.processed = 0
        self.stopping = asyncio.Event()
        self.slots = asyncio.Semaphore(settings.concurrency)
        self.cannot_consume: str | None = None  # why the last queue read failed (readyz)
        self._waiting = 0  # jobs waiting for a down upstream, without a slot
        self._dead: list[str] = []  # workers whose heartbeat stopped, holding entries
        self._slot_freed = asyncio.Event()
        self._pruned_at = time.monotonic()
        self._background: list[asyncio.Task[None]] = []

    # -- lifecycle ---------------------------------------------------------------------

    async def startup(self) -> None:
        logs.bind(worker=self.name)
        if self.settings.metrics_port is not None:
            self.http = MetricsServer(
                self.metrics, self.redis, self.stopping, lambda: self.cannot_consume
            )
            await self.http.start(self.settings.metrics_host, self.settings.metrics_port)
        if isinstance(self.redis, RedisCluster):
            await self.redis.initialize()  # the slot map, before commands run concurrently
        await self.queue.ensure_group()
        await self.records.load_scripts()
        await self.liveness.load()
        self.publisher.start()
        self._background = [
            asyncio.create_task(self._keep_beating(), name="chatstream-heartbeat"),
            asyncio.create_task(self._maintain(), name="chatstream-maintain"),
            asyncio.create_task(self._listen_for_cancels(), name="chatstream-cancels"),
        ]
        self._log_configuration()

    def _log_configuration(self) -> None:
        """One INFO line: what this worker runs with (no secrets); a WARNING when nobody
        configured the upstream ``default`` (its jobs would go to the built-in URL)."""
        message, fields = startup_summary(self.settings, self.redis, self.name)
        log.info("%s", message, extra={"fields": fields})
        if default_upstream_unset(self.settings):
            log.warning(
                "CHATSTREAM_UPSTREAM_URL is not set: jobs for the upstream 'default' go to "
                "the built-in %s (where `chatstream mock-upstream` listens)",
                self.settings.upstream_url,
            )

    async def consume(self) -> None:
        """Read and launch jobs until asked to stop."""
        while not self.stopping.is_set():
            free = await self._free_slots()
            if self.stopping.is_set():
                break
            entries = await self._read(free)
            if _cancel_swallowed():
                raise asyncio.CancelledError  # the entries are handed back by shutdown()
            if self.stopping.is_set():
                break  # delivered as we stop: shutdown() hands them back
            for entry in entries:
                self._launch(entry)

    async def shutdown(self) -> None:
        """Stop intake, let running jobs finish within the grace period, release the rest."""
        self.stopping.set()
        self._release([run for run in self.running.values() if self._waits_for_upstream(run)])
        tasks = [run.task for run in self.running.values()]
        if tasks:
            log.info(
                "waiting up to %gs for %d jobs", self.settings.shutdown_grace_seconds, len(tasks)
            )
            await asyncio.wait(tasks, timeout=self.settings.shutdown_grace_seconds)
        await self._release_all()
        await self.queue.close()
        await self._requeue_unstarted()
        await cancel_and_wait(self._background)
        await self.publisher.stop()
        await self.replication.aclose()
        await self._leave()
        await self.upstream.aclose()
        if self.http is not None:
            await self.http.stop()
        log.info("worker %s stopped after %d jobs", self.name, self.processed)

    async def run_burst(self, block_ms: int = 50) -> int:
        """Run everything that is queued (or reclaimable) now, then return; for tests."""
        done_before = self.processed
        while True:
            free = self._capacity()
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

    def _capacity(self) -> int:
        """Entries the worker may take now: its free slots (jobs waiting for a down upstream
        hold none), and no more than ``concurrency + max_waiting`` held in all."""
        settings, held = self.settings, len(self.running)
        free = settings.concurrency - (held - self._waiting)
        return max(0, min(free, settings.concurrency + settings.max_waiting - held))

    async def _free_slots(self) -> int:
        while (free := self._capacity()) <= 0:
            self._slot_freed.clear()
            await self._slot_freed.wait()
        return free

    async def _read(self, count: int, block_ms: int | None = None) -> list[Entry]:
        """Entries to run: dead workers' first, then new ones (waiting up to ``block_ms``
        for some), then entries whose lease expired. Retried while Redis fails; meanwhile
        ``cannot_consume`` says why (``/readyz`` answers 503)."""
        entries = await retry_redis(
            "reading the queue",
            lambda: self._read_once(count, block_ms or self.settings.block_ms),
            on_failure=self._consuming_failed,
        )
        if self.cannot_consume is not None:
            log.info("reading the queue works again")
            self.cannot_consume = None
        return entries

    def _consuming_failed(self, exc: BaseException) -> None:
        self.cannot_consume = f"{type(exc).__name__}: {exc}"

    async def _read_once(self, count: int, block_ms: int) -> list[Entry]:
        entries = await self._take_over(count)
        try:
            if len(entries) < count:
                fresh = await self.queue.read(count - len(entries), None if entries else block_ms)
                self.metrics.delivered(entry.entry_id for entry in fresh)
                entries += fresh
            if len(entries) < count:
                reclaimed = await self.queue.reclaim(count - len(entries), self._lease_ms)
                self.metrics.reclaimed(len(reclaimed))
                entries += reclaimed
        except RedisError:
            if not entries:
                raise
            log.warning("reading the queue failed; running the %d entries taken", len(entries))
        return entries

    @property
    def _lease_ms(self) -> int:
        return int(self.settings.lease_seconds * 1000)

    def _launch(self, entry: Entry) -> None:
        if entry.ref in self.running:
            return  # our own entry, reclaimed by us after a stall: its task still runs it
        task = asyncio.create_task(self._handle(entry), name=f"job-{entry.job_id}")
        # registered before it runs, so its lease is renewed from the first moment
        self.running[entry.ref] = Running(entry, task)

    async def _handle(self, entry: Entry) -> None:
        logs.bind(worker=self.name, job=entry.job_id)  # this task's log lines carry the job
        run = self.running[entry.ref]
        try:
            await self._run_entry(run)
        except Exception:
            log.exception("job %s: unexpected failure; the entry will be reclaimed", entry.job_id)
        finally:
            if run.holds_slot:
                self.slots.release()
            self.running.pop(entry.ref, None)
            self.processed += 1
            self._slot_freed.set()

    async def _run_entry(self, run: Running) -> None:
        """One entry: check it is still ours, take a slot, start the attempt, run it, settle
        the entry. The Redis steps are retried through outages (our lease is renewed
        meanwhile); all are idempotent or fenced. Shutdown cancels a step still waiting and
        hands the entry back."""
        entry, job_id = run.entry, run.entry.job_id
        if job_id is None:
            log.error("dropping queue entry %s without a job id: %r", entry.ref, entry.raw)
            await retry_redis("dropping", lambda: self.queue.ack(entry))
            return
        delivery = await retry_redis(
            f"job {job_id}: claiming",
            lambda: self.queue.claim_for_start(entry, self._lease_ms),
        )
        if not delivery:
            log.warning(
                "job %s: queue entry %s is no longer ours, or was delivered more than a lease "
                "ago (a late read); not starting it",
                job_id,
                entry.ref,
            )
            return
        run.claimed = True
        await self.slots.acquire()
        run.holds_slot = True
        started = await self._start(job_id, entry.ref, delivery)
        if started.state != "started":
            run.settling = True
            await retry_redis(f"job {job_id}: skipping", lambda: self._skip(entry, started))
            return
        logs.set_attempt(started.attempt)
        stream = self.publisher.open(job_id, started.attempt)
        job = run.job = JobRun(job_id, started.attempt, started.request, started.upstream, stream)
        job.idle = self._without_slot(run)
        outcome = await run_job(self.services, job)
        run.settling = True
        await retry_redis(f"job {job_id}: settling", lambda: self._settle(run, job, outcome))

    async def _start(self, job_id: str, entry_ref: str, delivery: int) -> Started:
        max_attempts, token = self.settings.max_attempts, secrets.token_hex(8)
        return await retry_redis(
            f"job {job_id}: starting",
            lambda: self.records.start(
                job_id, self.name, max_attempts, entry_ref, token, delivery=delivery
            ),
        )

    def _without_slot(self, run: Running) -> Callable[[], AbstractAsyncContextManager[None]]:
        """The job's ``idle``: its slot is free while it waits for a down upstream, and taken
        back (waiting for one if need be) when its turn comes. Cancelled, it takes none."""

        @asynccontextmanager
        async def without_slot() -> AsyncIterator[None]:
            self.slots.release()
            run.holds_slot, run.waiting = False, True
            self._waiting += 1
            self._slot_freed.set()
            try:
                yield
            finally:
                run.waiting = False
                self._waiting -= 1
            await self.slots.acquire()
            run.holds_slot = True

        return without_slot

    async def _skip(self, entry: Entry, started: Started) -> None:
        job_id = entry.job_id or ""
        if started.state == "superseded":
            log.warning(
                "job %s: entry %s was delivered again since; the newer delivery runs it",
                job_id,
                entry.ref,
            )
            return  # not ours to ack
        if started.state == "missing":
            log.error("job %s has no record (expired or never created); dropping", job_id)
            self.metrics.job_missing()
        elif started.state == "busy":
            log.warning("job %s runs under another queue entry; dropping %s", job_id, entry.ref)
        elif started.state in ("exhausted", "invalid"):  # failed by the start script
            logs.set_attempt(started.attempt)
            log_failure(job_id, started.attempt, started.upstream, json.loads(started.error))
            self.metrics.job_failed_unstarted()
        if started.dead_pending:
            await self._dead_letter(job_id, started.attempt)
        if started.state in ("terminal", "exhausted", "invalid"):
            await self._ack_ended(entry, job_id)
        else:
            await self.queue.ack(entry)

    async def _dead_letter(self, job_id: str, attempt: int) -> None:
        reason = {"code": "attempts_exhausted", "attempts": attempt}
        dead_entry = await self.queue.dead_letter(job_id, reason)
        await self.records.dead_lettered(job_id, dead_entry)

    async def _settle(self, run: Running, job: JobRun, outcome: Outcome) -> None:
        if outcome is Outcome.FINISHED and job.replicated:
            await self.queue.ack(run.entry)
        elif outcome is Outcome.FINISHED:
            self._leave_unreplicated(job.job_id)
        elif outcome is Outcome.RELEASED and not run.lost:
            if await self.records.release(job.job_id, job.attempt):
                await self._requeue(run.entry, job.job_id)
        else:  # STALE or lost: a newer attempt owns the job, it ended, or its record is gone
            await self._close_if_ended(run.entry, job, job.stream.rolled_back)

    async def _close_if_ended(self, entry: Entry, job: JobRun, rolled_back: bool) -> None:
        """Ack the entry of a job that reached a terminal state (a retried terminal write
        finds its own first write); leave it alone while a newer attempt runs. A record
        behind this attempt (Redis lost writes in a failover) is queued again."""
        job_id, attempt = job.job_id, job.attempt
        status, dead_pending, current = await self.records.closing_state(job_id)
        if dead_pending:
            await self._dead_letter(job_id, attempt)
        if status in ("running", "queued") and (rolled_back or current < attempt):
            await self._rerun_after_loss(entry, job_id, attempt)
        elif status == "missing":
            log.error("job %s: its record is gone (expired, or lost by Redis); dropping", job_id)
            self.metrics.job_missing()
            await self.queue.ack(entry)
        elif status in TERMINAL_STATUSES:
            await self._ack_ended(entry, job_id)

    async def _ack_ended(self, entry: Entry, job_id: str) -> None:
        """Ack the entry of a job whose record is terminal; with replicas to wait for, only
        once they have that terminal state (else the entry stays, to be checked again by
        whoever reclaims it after the lease)."""
        if self.replication.enabled and not await self.replication.terminal_replicated(
            self.keys.job(job_id)
        ):
            self._leave_unreplicated(job_id)
            return
        await self.queue.ack(entry)

    def _leave_unreplicated(self, job_id: str) -> None:
        log.warning(
            "job %s: fewer than %d replicas acknowledged its terminal state within %d ms; its "
            "queue entry stays and is checked again after the lease",
            job_id,
            self.replication.replicas,
            self.replication.timeout_ms,
        )

    async def _rerun_after_loss(self, entry: Entry, job_id: str, attempt: int) -> None:
        """The job back to the queue: its record is behind what this attempt wrote."""
        state = await self.records.rolled_back(job_id, attempt)
        if state != "queued":  # a newer attempt started since, or the job ended
            log.info(
                "job %s: Redis lost writes of attempt %d; the job is %s", job_id, attempt, state
            )
            return
        log.warning("job %s: Redis lost writes of attempt %d; requeued", job_id, attempt)
        if await self.queue.requeue(entry, job_id) is None and not await self.queue.job_of(entry):
            entry_id = await self.queue.add(job_id)  # the queue lost our entry too
            await self.records.mark_queued(job_id, entry_id)

    async def _requeue(self, entry: Entry, job_id: str) -> None:
        if await self.queue.requeue(entry, job_id) is None:
            log.info("job %s: entry %s was taken over; not requeued", job_id, entry.ref)

    def _release(self, runs: list[Running]) -> None:
        """Cancel these jobs; those that started give their attempt back to the queue."""
        for run in runs:
            if run.job is not None:
                run.job.release_requested = True
            run.task.cancel()

    async def _release_all(self) -> None:
        remaining = list(self.running.values())
        self._release(remaining)
        if remaining:
            log.info("released %d unfinished jobs to the queue", len(remaining))
            tasks = [run.task for run in remaining]
            await asyncio.wait(tasks, timeout=5)  # a release is a few round trips
            await cancel_and_wait(tasks)  # any that swallowed the cancel: handed back next

    async def _requeue_unstarted(self) -> None:
        """Hand back the entries we hold but no longer run: reads cut short by shutdown,
        starts cancelled midway, tasks that died. Only entries well inside their lease:
        older ones may be being taken over right now, and reclaim does that anyway."""
        try:
            for entry in await self.queue.owned(max_idle_ms=self._lease_ms * 2 // 3):
                job_id = await self.queue.job_of(entry)
                if job_id is None:
                    await self.queue.ack(entry)
                    continue
                await self.records.hand_back(job_id, entry.ref)
                await self._requeue(entry, job_id)
        except RedisError as exc:
            log.warning("could not hand back pending entries: %s", exc)

    # -- background --------------------------------------------------------------------

    async def _maintain(self) -> None:
        interval = self.settings.lease_seconds / 3
        while True:
            try:
                await self._renew_leases()
                await self._adopt_stranded()
                await self._prune_consumers()
                await self._poll_cancel_flags()
                if self.http is not None:  # queue gauges, served from memory
                    await self.metrics.refresh_queue(self.redis, self.keys)
            except RedisError as exc:
                log.warning("lease maintenance failed: %s", exc)
            except Exception:  # a bug must not stop lease renewal
                log.exception("lease maintenance failed unexpectedly")
            await asyncio.sleep(interval)

    async def _keep_beating(self) -> None:
        """Heartbeats; take over the entries of workers whose heartbeat stopped."""
        failures = 0
        while True:
            try:
                await self._beat()
                failures = 0
            except RedisError as exc:
                failures += 1
                if often_enough(failures):
                    log.warning("heartbeat failed (%s; failure %d)", exc, failures)
            except Exception:  # a bug must not stop the heartbeat
                log.exception("heartbeat failed unexpectedly")
            await asyncio.sleep(self.settings.heartbeat_seconds)

    async def _beat(self) -> None:
        beat = await self.liveness.beat()
        if beat.fresh and any(run.claimed for run in self.running.values()):
            log.warning("this worker had been declared dead; checking its leases")
            await self._renew_leases()
        self._dead = beat.dead
        if self._dead and not self.stopping.is_set():
            for entry in await self._take_over(self._capacity()):
                self._launch(entry)

    async def _take_over(self, count: int) -> list[Entry]:
        """Claim up to ``count`` entries of workers whose heartbeat stopped."""
        taken: list[Entry] = []
        for name in list(self._dead):
            if len(taken) >= count:
                break
            entries, emptied = await self.queue.take_over(name, count - len(taken))
            if entries:
                log.warning(
                    "took over %d jobs of worker %s (no heartbeat for %gs)",
                    len(entries),
                    name,
                    self.settings.heartbeat_timeout,
                )
            taken += entries
            if emptied and name in self._dead:
                self._dead.remove(name)
                await self.liveness.forget(name)
        self.metrics.reclaimed(len(taken))
        return taken

    async def _renew_leases(self) -> None:
        claimed = [run.entry for run in self.running.values() if run.claimed]
        lost = await self.queue.renew(claimed)
        for ref in lost:
            run = self.running.get(ref)
            if run is not None and not run.settling:  # (else: our own ack got there first)
                attempt = run.job.attempt if run.job is not None else None
                with logs.job_context(run.entry.job_id, attempt):
                    log.warning("job %s: lease lost to another worker; stopping", run.entry.job_id)
                run.lost = True
                if run.job is not None:
                    run.job.release_requested = True
                run.task.cancel()

    async def _adopt_stranded(self) -> None:
        """Run entries delivered to us that we never saw (a read's reply lost to a Redis
        restart): ours, yet unrenewed for half a lease. Not while stopping: shutdown hands
        back what it can, and the rest is reclaimed by others."""
        if self.stopping.is_set():
            return
        for entry in await self.queue.stranded(self._lease_ms // 2):
            if entry.ref not in self.running:
                with logs.job_context(entry.job_id):
                    log.warning(
                        "queue entry %s (job %s) was never seen; running it now",
                        entry.ref,
                        entry.job_id,
                    )
                self._launch(entry)

    async def _prune_consumers(self) -> None:
        """Now and then, drop the group's consumers of workers that died long ago."""
        now = time.monotonic()
        if now - self._pruned_at < PRUNE_EVERY:
            return
        self._pruned_at = now
        idle = max(PRUNE_EVERY, 10 * self.settings.lease_seconds)
        if removed := await self.queue.prune(int(idle * 1000)):
            log.info("removed %d consumers of workers gone for %gs", removed, idle)

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
        failures = 0
        while True:
            try:
                async with self.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self.keys.cancel_channel)
                    failures = 0
                    async for message in pubsub.listen():
                        self.cancel_local(as_text(message["data"]))
            except (RedisError, OSError) as exc:
                if often_enough(failures + 1):
                    log.warning("cancel listener lost Redis (%s); resubscribing", exc)
            except Exception:  # a bug must not stop cancellation (flags are polled too)
                log.exception("cancel listener failed unexpectedly; resubscribing")
            failures += 1
            await asyncio.sleep(pause(REDIS_WAIT, failures))

    def cancel_local(self, job_id: str) -> bool:
        for run in self.running.values():
            if run.entry.job_id == job_id and run.job is not None:
                self._cancel_run(run)
                return True
        return False

    def _cancel_run(self, run: Running) -> None:
        if run.job is not None and not run.job.cancel_requested:
            with logs.job_context(run.job.job_id, run.job.attempt):
                log.info("job %s: cancel requested; closing the upstream", run.job.job_id)
            run.job.cancel_requested = True
            run.task.cancel()

    def _waits_for_upstream(self, run: Running) -> bool:
        """The job waits for (or probes) an upstream that is down: it has no output yet."""
        job = run.job
        if run.waiting or job is None or job.opened:
            return run.waiting
        gate = self.upstream.gates.get(job.upstream)
        return gate is not None and gate.down

    def _upstream_health(self) -> list[tuple[str, bool, int]]:
        gates = self.upstream.gates.values()
        return [(gate.name, gate.down, gate.waiting) for gate in gates]

    async def _leave(self) -> None:
        with contextlib.suppress(RedisError):
            await self.liveness.leave()
            await self.queue.leave()  # only when we hold no entries


async def serve(settings: Settings, redis: RedisClient) -> None:
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
    # Objects alive after start-up (modules, settings, pools) live as long as the process:
    # moving them out of the collector's sight keeps full collections short, which keeps
    # every stream's delivery-latency tail short (see docs/decisions.md).
    gc.collect()
    gc.freeze()
    consume = asyncio.create_task(worker.consume())
    try:
        await consume
    except asyncio.CancelledError:
        if not worker.stopping.is_set():
            raise
    finally:
        await worker.shutdown()
