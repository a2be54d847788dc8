"""A worker's background upkeep: heartbeats, leases, stranded entries, cancel requests.

Three tasks run beside the consumer for as long as the worker does:

- the heartbeat (every ``heartbeat_seconds``) writes this worker's heartbeat with its report
  (slots in use, jobs waiting for a down upstream, version, start: the dashboard's workers
  panel) and learns which workers stopped (``worker/store/liveness.py``); their queue
  entries are taken over at once, up to the free capacity (the consumer takes over the rest
  first on its next read). Then the jobs that ended since are added to the per-minute
  activity counts (``worker/store/activity.py``): one script call per second at most;
- maintenance (every third of a lease) renews the leases of the entries this worker runs,
  adopts entries delivered to it but never seen, prunes the group's consumers of workers
  long gone, polls cancel flags (a fallback for the pub/sub message), refreshes the queue
  gauges and closes the Redis connections a burst opened and nothing needed since;
- the cancel listener subscribes to the cancel channel and cancels the jobs it names.

None of them may stop on an error: a failed round is logged and tried again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Protocol

from redis.exceptions import RedisError

from worker import logs
from worker.retry import REDIS_WAIT, often_enough, pause
from worker.service.entries import HeldEntry
from worker.service.metrics import Metrics
from worker.settings import Settings
from worker.store.activity import ActivityLog
from worker.store.keys import Keys
from worker.store.liveness import Liveness
from worker.store.queue import Entry, Queue
from worker.store.records import Records, as_text
from worker.store.redis_client import RedisClient, shed_idle_connections
from worker.store.scheduler import config_fields

log = logging.getLogger("chatstream.worker")
PRUNE_EVERY = 300.0  # seconds between sweeps for consumers of dead workers


class Host(Protocol):
    """What upkeep needs of the worker it serves."""

    settings: Settings
    redis: RedisClient
    keys: Keys
    queue: Queue
    records: Records
    liveness: Liveness
    metrics: Metrics
    running: dict[str, HeldEntry]
    stopping: asyncio.Event

    @property
    def serves_metrics(self) -> bool: ...

    def capacity(self) -> int: ...

    def launch(self, entry: Entry) -> None: ...

    def report(self) -> dict[str, Any]: ...


class Upkeep:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.dead: list[str] = []  # workers whose heartbeat stopped, holding entries
        self._pruned_at = time.monotonic()
        self.activity = ActivityLog(host.redis, host.keys)

    @property
    def lease_ms(self) -> int:
        return int(self.host.settings.lease_seconds * 1000)

    def tasks(self) -> list[asyncio.Task[None]]:
        return [
            asyncio.create_task(self._keep_beating(), name="chatstream-heartbeat"),
            asyncio.create_task(self._maintain(), name="chatstream-maintain"),
            asyncio.create_task(self._listen_for_cancels(), name="chatstream-cancels"),
        ]

    # -- heartbeats and taking over ----------------------------------------------------

    async def _keep_beating(self) -> None:
        """Heartbeats; take over the entries of workers whose heartbeat stopped."""
        failures = 0
        while True:
            try:
                await self.beat()
                failures = 0
                await self.flush_activity()
            except RedisError as exc:
                failures += 1
                if often_enough(failures):
                    log.warning("heartbeat failed (%s; failure %d)", exc, failures)
            except Exception:  # a bug must not stop the heartbeat
                log.exception("heartbeat failed unexpectedly")
            await asyncio.sleep(self.host.settings.heartbeat_seconds)

    async def flush_activity(self) -> None:
        """Add the jobs that ended since the last flush to the per-minute counts (kept for
        the next flush when Redis refuses them)."""
        tally = self.host.metrics.activity
        pending = sorted(tally.take().items())
        for index, (minute, counts) in enumerate(pending):
            try:
                await self.activity.add(minute, counts)
            except BaseException:
                tally.give_back(dict(pending[index:]))
                raise

    async def beat(self) -> None:
        host = self.host
        info = json.dumps(host.report(), separators=(",", ":"))
        beat = await host.liveness.beat(info)
        if beat.fresh and any(held.claimed for held in host.running.values()):
            log.warning("this worker had been declared dead; checking its leases")
            await self.renew_leases()
        self.dead = beat.dead
        if self.dead and not host.stopping.is_set():
            for entry in await self.take_over(host.capacity()):
                host.launch(entry)

    async def take_over(self, count: int) -> list[Entry]:
        """Claim up to ``count`` entries of workers whose heartbeat stopped."""
        taken: list[Entry] = []
        for name in list(self.dead):
            if len(taken) >= count:
                break
            entries, emptied = await self.host.queue.take_over(name, count - len(taken))
            if entries:
                log.warning(
                    "took over %d jobs of worker %s (no heartbeat for %gs)",
                    len(entries),
                    name,
                    self.host.settings.heartbeat_timeout,
                )
            taken += entries
            if emptied and name in self.dead:
                self.dead.remove(name)
                await self.host.liveness.forget(name)
        self.host.metrics.reclaimed(len(taken))
        return taken

    # -- maintenance -------------------------------------------------------------------

    async def _maintain(self) -> None:
        interval = self.host.settings.lease_seconds / 3
        while True:
            try:
                await self.maintain_once()
            except RedisError as exc:
                log.warning("lease maintenance failed: %s", exc)
            except Exception:  # a bug must not stop lease renewal
                log.exception("lease maintenance failed unexpectedly")
            await asyncio.sleep(interval)

    async def maintain_once(self) -> None:
        await self.renew_leases()
        if await self.host.queue.scheduler.publish_if_missing(config_fields(self.host.settings)):
            log.warning("the scheduler's configuration was gone from Redis; published again")
        await self.adopt_stranded()
        await self.prune_consumers()
        await self.poll_cancel_flags()
        if self.host.serves_metrics:  # queue gauges, served from memory
            targets = self.host.settings.route_targets()
            await self.host.metrics.refresh_queue(self.host.redis, self.host.keys, targets)
        if closed := await shed_idle_connections(self.host.redis):
            log.debug("closed %d idle Redis connections", closed)

    async def renew_leases(self) -> None:
        running = self.host.running
        lost = await self.host.queue.renew(
            [held.entry for held in running.values() if held.claimed]
        )
        for ref in lost:
            held = running.get(ref)
            if held is not None and not held.settling:  # (else: our own ack got there first)
                attempt = held.job.attempt if held.job is not None else None
                with logs.job_context(held.entry.job_id, attempt):
                    log.warning("job %s: lease lost to another worker; stopping", held.entry.job_id)
                held.lost = True
                if held.job is not None:
                    held.job.release_requested = True
                held.task.cancel()

    async def adopt_stranded(self) -> None:
        """Run entries delivered to us that we never saw (a read's reply lost to a Redis
        restart): ours, yet unrenewed for half a lease. Not while stopping: shutdown hands
        back what it can, and the rest is reclaimed by others."""
        host = self.host
        if host.stopping.is_set():
            return
        for entry in await host.queue.stranded(self.lease_ms // 2):
            if entry.ref not in host.running:
                with logs.job_context(entry.job_id):
                    log.warning(
                        "queue entry %s (job %s) was never seen; running it now",
                        entry.ref,
                        entry.job_id,
                    )
                host.launch(entry)

    async def prune_consumers(self) -> None:
        """Now and then, drop the group's consumers of workers that died long ago."""
        now = time.monotonic()
        if now - self._pruned_at < PRUNE_EVERY:
            return
        self._pruned_at = now
        idle = max(PRUNE_EVERY, 10 * self.host.settings.lease_seconds)
        if removed := await self.host.queue.prune(int(idle * 1000)):
            log.info("removed %d consumers of workers gone for %gs", removed, idle)

    # -- cancellation ------------------------------------------------------------------

    async def poll_cancel_flags(self) -> None:
        started = [held for held in self.host.running.values() if held.job is not None]
        if not started:
            return
        job_ids = [held.entry.job_id or "" for held in started]
        flags = await self.host.records.cancel_requested(job_ids)
        for held, requested in zip(started, flags, strict=True):
            if requested:
                self._cancel(held)

    async def _listen_for_cancels(self) -> None:
        redis, failures = self.host.redis, 0
        while True:
            try:
                async with redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self.host.keys.cancel_channel)
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
        """Cancel the job if this worker runs it; whether it did."""
        for held in self.host.running.values():
            if held.entry.job_id == job_id and held.job is not None:
                self._cancel(held)
                return True
        return False

    def _cancel(self, held: HeldEntry) -> None:
        job = held.job
        if job is not None and not job.cancel_requested:
            with logs.job_context(job.job_id, job.attempt):
                log.info("job %s: cancel requested; closing the upstream", job.job_id)
            job.cancel_requested = True
            held.task.cancel()
