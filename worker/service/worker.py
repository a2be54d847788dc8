"""The worker process: startup -> consume -> graceful shutdown.

Slots: at most ``concurrency`` jobs run at once, each an asyncio task holding a slot; a job
waiting for an upstream that is down gives its slot back meanwhile (up to ``max_waiting``
such jobs). The consumer only reads as many queue entries as there are free slots, taking
over the entries of dead workers first. What becomes of an entry once its attempt is over
is ``EntryFate``'s (``entries.py``); heartbeats, lease renewal, stranded entries and cancel
requests are ``Upkeep``'s (``upkeep.py``). Signals are captured in :func:`serve` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import signal
import socket
import time
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from worker import internals, logs, package_version, telemetry
from worker.aio import URGENT, cancel_and_wait
from worker.retry import retry_redis
from worker.service.entries import EntryFate, HeldEntry
from worker.service.health import MetricsServer
from worker.service.limits import FleetLimits
from worker.service.metrics import Metrics
from worker.service.notices import Outage, RouteOutage, WaitingNotices
from worker.service.pipeline import Attempt, Services, run_job
from worker.service.routing import Routing
from worker.service.runtime import default_upstream_unset, startup_summary
from worker.service.slots import Slots
from worker.service.ticks import WakeCoalescer, tick_seconds
from worker.service.tracing import NoTracing, tracing_for_process
from worker.service.upkeep import Upkeep
from worker.settings import Settings
from worker.store.keys import Keys
from worker.store.liveness import Liveness
from worker.store.publisher import Publisher
from worker.store.queue import Entry, Queue
from worker.store.records import Records, Started
from worker.store.redis_client import RedisClient, watch_connected
from worker.store.replication import Replication
from worker.store.scheduler import config_fields
from worker.upstream.client import UpstreamClient

log = logging.getLogger("chatstream.worker")
STRAY_MIN_IDLE_MS = 1000  # an entry of ours this long unread is a stray (not a read in flight)


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
        tracing: NoTracing | None = None,
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
        self.slots = Slots(settings.concurrency, settings.max_waiting)
        self.metrics.in_flight.set_function(lambda: len(self.running) - self.slots.waiting)
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
        self.tracing = tracing or tracing_for_process(settings, self.metrics)
        self.upstream = upstream or UpstreamClient(settings, on_retry=self._upstream_retried)
        self.metrics.watch_upstreams(self._upstream_health)
        self.metrics.watch_tenants(self._running_by_tenant)
        self.liveness = Liveness(redis, self.keys, self.name, settings.heartbeat_timeout)
        self.limits = FleetLimits(settings, self.queue.scheduler)
        routing = Routing(settings, self.queue.scheduler) if settings.routes else None
        self.services = Services(
            settings,
            self.records,
            self.publisher,
            self.upstream,
            self.name,
            metrics=self.metrics,
            tracing=self.tracing,
            routing=routing,
            fleet_limits=self.limits,
        )
        self.fate = EntryFate(self.queue, self.records, self.replication, self.keys, self.metrics)
        self.upkeep = Upkeep(self)
        self.ticks = WakeCoalescer(tick_seconds(settings), lambda: bool(self.running))
        self.running: dict[str, HeldEntry] = {}
        self.processed = 0
        self.started_at = time.time()
        self._redact = logs.RedactFilter(logs.secrets_of(settings)).redact
        self.stopping = asyncio.Event()
        self.cannot_consume: str | None = None  # why the last queue read failed (readyz)
        self._read_failed = False  # since then, Redis may serve reads we gave up on
        self._strays_until = 0.0  # monotonic: until then, look for our own unseen entries
        self._background: list[asyncio.Task[None]] = []

    # -- lifecycle ---------------------------------------------------------------------

    async def startup(self) -> None:
        logs.bind(worker=self.name)
        internals.check_all()  # one line per internal a release moved: what is done instead
        if self.ticks.on:
            URGENT.start()  # the sockets whose news ends a tick's sleep (only now: issue 37)
            watch_connected()
        if self.settings.metrics_port is not None:
            self.http = MetricsServer(
                self.metrics, self.redis, self.stopping, lambda: self.cannot_consume
            )
            await self.http.start(self.settings.metrics_host, self.settings.metrics_port)
        if isinstance(self.redis, RedisCluster):
            await self.redis.initialize()  # the slot map, before commands run concurrently
        await self.queue.ensure_group()
        await self._publish_configuration()
        await self.records.load_scripts()
        await self.liveness.load()
        self.publisher.start()
        self._background = self.upkeep.tasks()
        self._log_configuration()

    async def _publish_configuration(self) -> None:
        """The limits, weights and upstream names this worker runs with, for the scheduler
        scripts every producer and worker runs (they must agree across the fleet)."""
        before = await self.queue.scheduler.publish(config_fields(self.settings))
        if before:
            log.info("the fleet's scheduler configuration in Redis changed (was %s)", before)

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
            free = await self.slots.wait_for_capacity(lambda: len(self.running))
            if self.stopping.is_set():
                break
            entries = await self._read(free)
            if _cancel_swallowed():
                raise asyncio.CancelledError  # the entries are handed back by shutdown()
            if self.stopping.is_set():
                break  # delivered as we stop: shutdown() hands them back
            for entry in entries:
                self.launch(entry)

    async def shutdown(self) -> None:
        """Stop intake, let running jobs finish within the grace period, release the rest."""
        self.stopping.set()
        self._release([held for held in self.running.values() if self._waits_for_upstream(held)])
        tasks = [held.task for held in self.running.values()]
        if tasks:
            log.info(
                "waiting up to %gs for %d jobs", self.settings.shutdown_grace_seconds, len(tasks)
            )
            await asyncio.wait(tasks, timeout=self.settings.shutdown_grace_seconds)
        await self._release_all()
        await self.queue.close()
        await self.fate.hand_back_unstarted(max_idle_ms=self._lease_ms * 2 // 3)
        await cancel_and_wait(self._background)
        self.ticks.stop()
        if self.ticks.on:
            URGENT.stop()
        await self.publisher.stop()
        await self.replication.aclose()
        with contextlib.suppress(RedisError):
            await self.upkeep.flush_activity()  # the last jobs' ends
        await self._leave()
        await self.upstream.aclose()
        if self.http is not None:
            await self.http.stop()
        self.tracing.flush()  # the spans of the last runs end now, before the last export
        log.info("worker %s stopped after %d jobs", self.name, self.processed)

    async def run_burst(self, block_ms: int = 50) -> int:
        """Run everything that is queued (or reclaimable) now, then return; for tests."""
        done_before = self.processed
        while True:
            free = self.capacity()
            entries = await self._read(free, block_ms=block_ms) if free else []
            for entry in entries:
                self.launch(entry)
            if not self.running:
                if not entries:
                    return self.processed - done_before
                continue
            await asyncio.wait(
                [held.task for held in self.running.values()], return_when=asyncio.FIRST_COMPLETED
            )

    @property
    def serves_metrics(self) -> bool:
        return self.http is not None

    # -- reading ---------------------------------------------------------------------

    def capacity(self) -> int:
        """Entries the worker may take now (see ``Slots.capacity``)."""
        return self.slots.capacity(len(self.running))

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
        began = time.monotonic()
        entries = await self.upkeep.take_over(count)
        try:
            entries += await self._strays(count - len(entries))
            await self._read_into(entries, count, block_ms)
        except RedisError:
            self._read_failed = True
            if not entries:
                raise
            log.warning("reading the queue failed; running the %d entries taken", len(entries))
        if time.monotonic() - began > (block_ms + STRAY_MIN_IDLE_MS) / 1000:
            self._read_failed = True  # it hung, and redis-py may have retried it: a lost reply
        return entries

    async def _read_into(self, entries: list[Entry], count: int, block_ms: int) -> None:
        """New entries (waiting up to ``block_ms``), then those whose lease expired."""
        if self._looking_for_strays():
            block_ms = min(block_ms, STRAY_MIN_IDLE_MS)  # and look again soon
        if len(entries) < count:
            fresh = await self.queue.read(count - len(entries), None if entries else block_ms)
            self.metrics.delivered(entry.entry_id for entry in fresh)
            entries += fresh
        if len(entries) < count:
            reclaimed = await self.queue.reclaim(count - len(entries), self._lease_ms)
            self.metrics.reclaimed(len(reclaimed))
            entries += reclaimed

    async def _strays(self, count: int) -> list[Entry]:
        """After a queue read failed or timed out: our own entries no read of ours returned.
        Redis may still serve a read we gave up on (its command reaches Redis when a
        partition heals, or it was blocked there) and its reply is lost; such entries are
        looked for at once when Redis answers again, and then before every read for as long
        as such a read may wait there (twice the block time plus two seconds), instead of
        half a lease later (``Upkeep.adopt_stranded``). Entries it runs are skipped, and so
        are those delivered less than ``STRAY_MIN_IDLE_MS`` ago (just taken over by another
        worker, say: XCLAIM's min-idle leaves them alone)."""
        if count <= 0 or not self._looking_for_strays():
            return []
        strays = await self.queue.stranded(STRAY_MIN_IDLE_MS, count, skip=self.running)
        if self._read_failed:
            self._read_failed = False
            window = (2 * self.settings.block_ms + 2 * STRAY_MIN_IDLE_MS) / 1000
            self._strays_until = time.monotonic() + window
        for entry in strays:
            with logs.job_context(entry.job_id):
                log.warning(
                    "queue entry %s (job %s) was delivered to a read given up on; running it",
                    entry.ref,
                    entry.job_id,
                )
        return strays

    def _looking_for_strays(self) -> bool:
        return self._read_failed or time.monotonic() < self._strays_until

    @property
    def _lease_ms(self) -> int:
        return int(self.settings.lease_seconds * 1000)

    # -- running an entry --------------------------------------------------------------

    def launch(self, entry: Entry) -> None:
        if entry.ref in self.running:
            return  # our own entry, reclaimed by us after a stall: its task still runs it
        task = asyncio.create_task(self._handle(entry), name=f"job-{entry.job_id}")
        self.ticks.resume()
        # registered before it runs, so its lease is renewed from the first moment
        self.running[entry.ref] = HeldEntry(entry, task)

    async def _handle(self, entry: Entry) -> None:
        logs.bind(worker=self.name, job=entry.job_id)  # this task's log lines carry the job
        held = self.running[entry.ref]
        try:
            await self._run_entry(held)
        except Exception:
            log.exception("job %s: unexpected failure; the entry will be reclaimed", entry.job_id)
        finally:
            self.slots.give_back(held)
            self.running.pop(entry.ref, None)
            self.processed += 1
            self.slots.freed()

    async def _run_entry(self, held: HeldEntry) -> None:
        """One entry: check it is still ours, take a slot, start the attempt, run it, settle
        the entry. The Redis steps are retried through outages (our lease is renewed
        meanwhile); all are idempotent or fenced. Shutdown cancels a step still waiting and
        hands the entry back."""
        entry, job_id = held.entry, held.entry.job_id
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
        held.claimed = True
        await self.slots.take(held)
        started = await self._start(entry, job_id, delivery)
        if started.state != "started":
            held.settling = True
            await retry_redis(f"job {job_id}: skipping", lambda: self.fate.skip(entry, started))
            return
        logs.set_attempt(started.attempt)
        stream = self.publisher.open(job_id, started.attempt)
        job = held.job = Attempt(
            job_id,
            started.attempt,
            started.request,
            started.upstream,
            stream,
            entry=entry,
            delivery=delivery,
        )
        job.tenant = entry.tenant
        notices = WaitingNotices(
            self.records,
            job_id,
            lambda: self._outage_of(job),
            lambda: job.attempt,
            lambda: job.upstream,
        )
        job.idle = notices.around(self.slots.without_slot(held))
        job.limits = self.limits.for_entry(entry, job.upstream, job.idle)
        outcome = await self.tracing.run(job, started, lambda: run_job(self.services, job))
        held.settling = True
        await retry_redis(f"job {job_id}: settling", lambda: self.fate.settle(held, job, outcome))

    async def _start(self, entry: Entry, job_id: str, delivery: int) -> Started:
        max_attempts, token = self.settings.max_attempts, secrets.token_hex(8)
        return await retry_redis(
            f"job {job_id}: starting",
            lambda: self.records.start(
                job_id,
                self.name,
                max_attempts,
                entry.ref,
                token,
                delivery=delivery,
                dispatched_at=entry.dispatched_at,
            ),
        )

    # -- stopping ----------------------------------------------------------------------

    def cancel_local(self, job_id: str) -> bool:
        """Cancel the job if this worker runs it (what the cancel listener does)."""
        return self.upkeep.cancel_local(job_id)

    def _release(self, held_entries: list[HeldEntry]) -> None:
        """Cancel these jobs; those that started give their attempt back to the queue."""
        for held in held_entries:
            if held.job is not None:
                held.job.release_requested = True
            held.task.cancel()

    async def _release_all(self) -> None:
        remaining = list(self.running.values())
        self._release(remaining)
        if remaining:
            log.info("released %d unfinished jobs to the queue", len(remaining))
            tasks = [held.task for held in remaining]
            await asyncio.wait(tasks, timeout=5)  # a release is a few round trips
            await cancel_and_wait(tasks)  # any that swallowed the cancel: handed back next

    def _waits_for_upstream(self, held: HeldEntry) -> bool:
        """The job waits for (or probes) an upstream that is down: it has no output yet."""
        job = held.job
        if held.waiting or job is None or job.opened:
            return held.waiting
        return self._outage_of(job) is not None

    def _outage_of(self, job: Attempt) -> Outage | None:
        """What the job waits for, while it waits: a target of its route, or its upstream
        (or target) that is down (None: it waits for nothing of that kind)."""
        if job.route is not None and job.route.waiting_since is not None:
            return RouteOutage(job.route)
        return self.upstream.down_gate(job.upstream, job.model)

    def report(self) -> dict[str, Any]:
        """What this worker says about itself beside each heartbeat (the dashboard's workers
        panel): its slots and how many are busy, the jobs it holds that wait for a down
        upstream, which upstreams it finds down (for how long, the last error: secrets
        masked), its version, host, pid and start (Unix seconds, its own clock)."""
        down = {
            gate.name: {
                "for": round(time.monotonic() - gate.down_since, 1),
                "error": self._redact(gate.last_error)[:300],
                "waiting": gate.waiting,
            }
            for gate in self.upstream.gates.values()
            if gate.down_since is not None
        }
        return {
            "version": package_version(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": round(self.started_at, 3),
            "slots": self.settings.concurrency,
            "busy": len(self.running) - self.slots.waiting,
            "waiting": self.slots.waiting,
            "processed": self.processed,
            "stopping": self.stopping.is_set(),
            "down": down,
        }

    def _running_by_tenant(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for held in self.running.values():
            counts[held.entry.tenant] = counts.get(held.entry.tenant, 0) + 1
        return counts

    def _upstream_retried(self, exc: BaseException, wait: float) -> None:
        """A try before the upstream's first byte failed and is retried after ``wait``."""
        self.metrics.on_upstream_retry(exc, wait)
        self.tracing.retried("upstream", exc, wait)

    def _upstream_health(self) -> list[tuple[str, bool, int]]:
        """Per upstream: down when it, or a model of it, is (its gate or a target's), and the
        jobs waiting on any of them."""
        rows: dict[str, tuple[bool, int]] = {}
        for gate in list(self.upstream.gates.values()):
            down, waiting = rows.get(gate.name, (False, 0))
            rows[gate.name] = (down or gate.down, waiting + gate.waiting)
        return [(name, down, waiting) for name, (down, waiting) in rows.items()]

    async def _leave(self) -> None:
        with contextlib.suppress(RedisError):
            await self.liveness.leave()
            await self.queue.leave()  # only when we hold no entries


async def serve(settings: Settings, redis: RedisClient) -> None:
    """Run a worker until SIGTERM/SIGINT; a second signal exits at once. Exports traces
    and metrics over OTLP when the OTEL_* variables ask for it (``worker.telemetry``)."""
    exporting = telemetry.setup("chatstream-worker")
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
        if exporting is not None:
            await asyncio.to_thread(exporting.shutdown)  # the last spans and metrics
