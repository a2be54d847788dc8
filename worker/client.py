"""What backend services import: enqueue jobs, read their events live, wait, cancel.

``Client`` is async and takes the application's own ``redis.asyncio.Redis``;
``SyncClient`` offers the same calls to synchronous code (it runs them on a private event
loop with its own connection); tests/unit/test_client.py checks that no call is missing.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar, cast

from pydantic import ValidationError

from schemas.events import StreamEvent
from schemas.jobs import TERMINAL, JobRecord, JobStatus
from schemas.requests import (
    MAX_NESTING,
    PRIORITY_RANK,
    ChatRequest,
    JobSpec,
    Priority,
    nesting_depth,
)
from worker.aio import cancel_and_wait
from worker.errors import InvalidJobError, JobNotFoundError, NotReplicatedError, QueueFullError
from worker.settings import DEFAULT_UPSTREAM, Settings, load_settings
from worker.store.batch import BatchSender
from worker.store.bulk import BulkEnqueue, Job
from worker.store.cluster_batch import default_sender
from worker.store.jobs import JobIndex, JobPage, Progress, read_progress
from worker.store.keys import Keys
from worker.store.queue import DeadLetter, Queue
from worker.store.records import QUEUED_TO_TENANT, Records, as_text, dumps
from worker.store.redis_client import RedisClient, connect, redis_from_settings
from worker.store.replication import Replication
from worker.store.scheduler import PUSH, Waiting, check_push
from worker.telemetry import context_fields

# below redis-py's default 5 s socket timeout, so an application's own client works as is
READ_BLOCK_MS = 2_000
ROUTES_TTL = 10.0  # seconds a client keeps the route names the workers publish
LIVE_WINDOW = 60  # seconds: a worker that beat within it is counted live by queued_notice
T = TypeVar("T")


class Client:
    def __init__(
        self,
        redis: RedisClient,
        *,
        prefix: str = "chatstream",
        retention_seconds: int = 86_400,
        max_request_bytes: int = 1_048_576,
        upstreams: list[str] | None = None,
        jobs_index_max: int = 1_000_000,
        queue_shards: int = 1,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 2_000,
        max_queued: int | None = None,
    ) -> None:
        self.redis = redis
        self.keys = Keys(prefix, queue_shards)
        self.replication = Replication(redis, wait_replicas, wait_timeout_ms)
        self.records = Records(redis, self.keys, retention_seconds)
        self.queue = Queue(redis, self.keys, "client")
        self.index = JobIndex(redis, self.keys, retention_seconds, jobs_index_max)
        self.max_request_bytes = max_request_bytes
        self.upstreams = upstreams
        self.max_queued = max_queued  # beside the workers' CHATSTREAM_MAX_QUEUED: the stricter
        self._routes: tuple[float, frozenset[str]] | None = None  # (read at, names)

    @classmethod
    def from_settings(cls, settings: Settings, redis: RedisClient | None = None) -> Client:
        return cls(
            redis or redis_from_settings(settings),
            prefix=settings.prefix,
            retention_seconds=settings.retention_seconds,
            max_request_bytes=settings.max_request_bytes,
            upstreams=[*settings.upstream_names(), *settings.routes],
            jobs_index_max=settings.jobs_index_max,
            queue_shards=settings.queue_shards,
            wait_replicas=settings.redis_wait_replicas,
            wait_timeout_ms=settings.redis_wait_timeout_ms,
            max_queued=settings.max_queued,
        )

    @classmethod
    def from_url(cls, url: str, *, prefix: str | None = None) -> Client:
        """A client on a connection of its own to ``url`` (any ``CHATSTREAM_REDIS_URL`` form),
        the other settings from the environment; close it (``async with``, or ``aclose``)."""
        return cls.from_settings(url_settings(url, prefix))

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @classmethod
    async def connect(cls, settings: Settings) -> Client:
        """A client on :func:`worker.store.redis_client.connect` (a plain URL of a Cluster node
        becomes a cluster client)."""
        return cls.from_settings(settings, await connect(settings))

    async def enqueue(
        self,
        request: ChatRequest | dict[str, Any],
        job_id: str | None = None,
        upstream: str = "default",
        metadata: dict[str, Any] | None = None,
        *,
        tenant: str = "default",
        priority: Priority = "normal",
    ) -> str:
        """Validate and queue a job; the same ``job_id`` twice is the same job.

        The job waits in its ``tenant``'s queue: free capacity goes round-robin among the
        tenants with waiting jobs (weighted by ``CHATSTREAM_TENANT_WEIGHTS``), and within a
        tenant ``priority`` high before normal before low, first come first served. Raises
        QueueFullError, writing nothing, when the tenant has ``CHATSTREAM_MAX_QUEUED`` jobs
        waiting already.

        With replicas to wait for (``wait_replicas``), it returns once they have the job's
        record and queue entry, else raises NotReplicatedError: the job is queued on the
        master all the same, and enqueueing it again with the same ``job_id`` waits again.
        """
        await self._check_upstream(upstream)
        metadata = metadata or {}
        _check_nesting("metadata", metadata)
        spec = self._spec(request, job_id or new_job_id(), upstream, metadata, tenant, priority)
        spec = routed(spec, await self._route_names(upstream))
        fields = self._fields(spec, context_fields())
        state = await self.records.create(spec.id, fields)
        if state != "exists":
            await self.index.add(spec.id, float(fields["created_at"]))
            json_length = len(fields["request"])
            waiting = Waiting.of(spec.request, spec.tenant, spec.upstream, json_length)
            await self._queue(spec.id, waiting, spec.priority, discard=state == "created")
        elif self.replication.enabled:
            record = self.keys.job(spec.id)
            check = ("HSET", record, "replica_check", f"{time.time():.6f}")
            await self.replication.write(record, check, f"job {spec.id}")
        return spec.id

    def _fields(self, spec: JobSpec, trace: dict[str, str]) -> dict[str, str]:
        """The record's fields; ``trace``: the caller's trace context (one per call)."""
        request_json = spec.request.model_dump_json()
        if len(request_json.encode()) > self.max_request_bytes:
            raise InvalidJobError(
                f"request is larger than the limit of {self.max_request_bytes} bytes"
            )
        return _record_fields(spec, request_json, trace)

    async def _queue(
        self, job_id: str, waiting: Waiting, priority: str, *, discard: bool = False
    ) -> None:
        """The job into its tenant's queue, then the record marked queued (each replicated,
        if asked). Refused (the tenant's queue is full): the record it just created is
        deleted again (``discard``), so nothing is left half-written."""
        scheduler = self.queue.scheduler
        try:
            if not self.replication.enabled:
                await scheduler.push(job_id, waiting, priority, self.max_queued)
                await self.records.mark_queued(job_id, QUEUED_TO_TENANT)
                return
            await self._queue_replicated(job_id, waiting, priority)
        except QueueFullError:
            if discard:
                await self.records.discard(job_id)
                await self.index.remove(job_id)
            raise

    async def _queue_replicated(self, job_id: str, waiting: Waiting, priority: str) -> None:
        scheduler, shard = self.queue.scheduler, self.keys.shard_of(job_id)
        keys, record = scheduler.shard_keys(shard), self.keys.job(job_id)
        args = scheduler.push_args([(job_id, waiting, priority)], self.max_queued)
        replies, on_queue = await self.replication.send(keys[0], ("EVAL", PUSH, 2, *keys, *args))
        check_push(replies[0], waiting.tenant)
        mark = ("HSET", record, "queue_entry", QUEUED_TO_TENANT)
        _, on_record = await self.replication.send(record, mark)
        if not self.replication.enough(min(on_queue, on_record)):
            shortfall = self.replication.shortfall(f"job {job_id}", min(on_queue, on_record))
            raise NotReplicatedError(shortfall)

    async def enqueue_many(
        self,
        requests: Iterable[ChatRequest | dict[str, Any]],
        upstream: str = "default",
        metadata: dict[str, Any] | None = None,
        *,
        tenant: str = "default",
        priority: Priority = "normal",
        batch: int = 1_000,
    ) -> list[str]:
        """Queue many jobs at once (each as ``enqueue`` would), ``batch`` per round trip;
        their new ids, in order. Every request is validated before anything is written
        (InvalidJobError names the first bad one by its index). When the tenant's queue
        fills up, QueueFullError says so, its ``queued`` listing the ids that were queued
        (they stay queued); the refused jobs leave nothing behind."""
        await self._check_upstream(upstream)
        metadata = metadata or {}
        _check_nesting("metadata", metadata)  # one metadata for all: checked once
        trace = context_fields()  # the caller's span is the same for every job of the call
        routes = await self._route_names(upstream)
        jobs = [
            self._job_at(index, request, upstream, metadata, tenant, priority, trace, routes)
            for index, request in enumerate(requests)
        ]
        sender = default_sender(self.redis)  # a connection of its own for the call
        try:
            return await self._enqueue_batches(sender, jobs, batch)
        finally:
            await sender.aclose()

    async def _enqueue_batches(self, sender: BatchSender, jobs: list[Job], batch: int) -> list[str]:
        bulk = BulkEnqueue(sender, self.records, self.index, self.queue.scheduler, self.max_queued)
        done = await bulk.run([jobs[i : i + batch] for i in range(0, len(jobs), batch)])
        if done.refused:
            job, waiting = done.refused[0]
            tenant = job.waiting.tenant
            raise QueueFullError(
                f"tenant {tenant!r} has {waiting} jobs waiting, the most "
                f"CHATSTREAM_MAX_QUEUED allows: {len(done.queued)} of {len(jobs)} jobs were "
                "queued (QueueFullError.queued lists them); the others were not",
                tenant=tenant,
                waiting=waiting,
                queued=done.queued,
            )
        return done.queued

    def _job_at(
        self,
        index: int,
        request: ChatRequest | dict[str, Any],
        upstream: str,
        metadata: dict[str, Any],
        tenant: str,
        priority: Priority,
        trace: dict[str, str],
        routes: frozenset[str],
    ) -> Job:
        """The ``index``-th request of a bulk enqueue, validated, as it will be written."""
        try:
            spec = self._spec(request, new_job_id(), upstream, metadata, tenant, priority)
            spec = routed(spec, routes)
            return Job.of(spec, self._fields(spec, trace))
        except InvalidJobError as exc:
            raise InvalidJobError(f"requests[{index}]: {exc.message}") from None

    def _spec(
        self,
        request: ChatRequest | dict[str, Any],
        job_id: str,
        upstream: str,
        metadata: dict[str, Any],
        tenant: str = "default",
        priority: Priority = "normal",
    ) -> JobSpec:
        _check_nesting("request", request)  # its metadata: checked by the caller, once
        try:
            return JobSpec.model_validate(
                {
                    "id": job_id,
                    "request": request,
                    "upstream": upstream,
                    "metadata": metadata,
                    "tenant": tenant,
                    "priority": priority,
                }
            )
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
            )
            raise InvalidJobError(f"invalid job: {problems}") from None

    async def _route_names(self, upstream: str) -> frozenset[str]:
        """The routes the workers publish (for a job that names the default upstream: its
        model may name one), read at most every ``ROUTES_TTL`` seconds."""
        if upstream != DEFAULT_UPSTREAM:
            return frozenset()
        now = time.monotonic()
        if self._routes is None or now - self._routes[0] >= ROUTES_TTL:
            self._routes = (now, await self.queue.scheduler.routes())
        return self._routes[1]

    async def _check_upstream(self, upstream: str) -> None:
        """A name this client's settings know, or one the workers publish that they serve
        (``Scheduler.served``): a producer need not copy the workers' upstream URLs."""
        if self.upstreams is None or upstream in self.upstreams:
            return
        served = await self.queue.scheduler.served()
        if served is not None and upstream in served:
            return
        raise InvalidJobError(
            f"unknown upstream {upstream!r}; configured here: {self.upstreams}; served by "
            f"the workers on prefix {self.keys.prefix!r}: {served or 'none published yet'}"
        )

    async def get(self, job_id: str) -> JobRecord:
        """The job's record; InvalidJobError when another producer wrote a malformed one."""
        raw = await self.records.fetch(job_id)
        if not raw:
            raise JobNotFoundError(f"no job {job_id!r} (never enqueued, or expired)")
        raw.setdefault("id", job_id)  # the key names the job; a producer may omit the field
        try:
            return JobRecord.from_hash(_readable(raw))
        except (ValidationError, ValueError, RecursionError) as exc:
            raise InvalidJobError(
                f"job {job_id!r}: malformed record ({_problem(exc)}); see docs/producers.md"
            ) from None

    async def events(
        self, job_id: str, after: str = "0-0", block_ms: int = READ_BLOCK_MS
    ) -> AsyncIterator[StreamEvent]:
        """The job's events from ``after`` on, live, ending after the terminal event.

        Also ends when nothing follows ``after`` and the job already ended (a cursor at or
        past the terminal entry) or its record expired.
        """
        record = await self.get(job_id)
        key = self.keys.events(job_id)
        cursor = after
        block: int | None = None if record.terminal else block_ms
        while True:
            reply: Any = await self.redis.xread({key: cursor}, count=1000, block=block)
            if not reply:
                if block is None:
                    return
                if await self._ended(job_id):
                    block = None  # read once more: the terminal entry may have just come
                continue
            for entry_id, fields in reply[0][1]:
                cursor = as_text(entry_id)
                event = StreamEvent.from_entry(
                    cursor, {as_text(k): as_text(v) for k, v in fields.items()}
                )
                yield event
                if event.terminal:
                    return

    async def _ended(self, job_id: str) -> bool:
        """The record is terminal (its terminal entry is written with it) or gone."""
        status = await self.redis.hget(self.keys.job(job_id), "status")
        return status is None or as_text(status) in {s.value for s in TERMINAL}

    async def result(self, job_id: str, timeout: float | None = None) -> JobRecord:
        """Wait for the terminal state and return the record (TimeoutError after ``timeout``)."""
        return await within(self._result(job_id), timeout)

    async def _result(self, job_id: str) -> JobRecord:
        record = await self.get(job_id)
        if record.terminal:
            return record
        async for event in self.events(job_id):
            if event.terminal:
                break
        return await self.get(job_id)

    async def cancel(self, job_id: str) -> JobStatus | str:
        """Cancel a queued or running job.

        Returns ``cancelled`` (it was queued), ``requested`` (it is running; its stream ends
        with ``cancelled`` shortly) or the status it had already reached.
        """
        state = await self.records.cancel(job_id)
        if state == "missing":
            raise JobNotFoundError(f"no job {job_id!r} (never enqueued, or expired)")
        if state == "requested":
            await self.redis.publish(self.keys.cancel_channel, job_id)
        elif state == "cancelled":  # it waited: out of its tenant's queue (its slot in the
            await self.queue.scheduler.unqueue(job_id)  # tenant's bound with it)
        return state

    async def dead_letters(self, count: int = 1000) -> list[DeadLetter]:
        """The jobs that exhausted their attempts, oldest first."""
        return await self.queue.dead_letters(count)

    async def requeue(self, job_id: str) -> str:
        """Run a failed (dead-lettered) job again, with a fresh attempt budget.

        Returns ``requeued``; raises JobNotFoundError, or InvalidJobError when the job is
        not failed. Its old events stream is deleted (the new run starts with ``reset``).
        Safe to repeat after a crash: a job left queued without a queue entry gets one.
        """
        state = await self.records.requeue(job_id)
        if state == "missing":
            raise JobNotFoundError(f"no job {job_id!r} (never enqueued, or expired)")
        if state not in ("requeued", "unqueued"):
            raise InvalidJobError(f"job {job_id!r} is {state}; only failed jobs are requeued")
        await self.index.add(job_id)  # listed again, as of now
        waiting, priority = await self._as_enqueued(job_id)
        await self._queue(job_id, waiting, priority)
        await self.queue.forget_dead(job_id)
        return "requeued"

    async def _as_enqueued(self, job_id: str) -> tuple[Waiting, str]:
        """The job's place in the queue, from its record: tenant, upstream, estimate,
        priority (a request that does not validate is estimated at 0: it fails at once)."""
        names = ["request", "upstream", "tenant", "priority"]
        values = await self.redis.hmget(self.keys.job(job_id), names)
        request, upstream, tenant, priority = (as_text(v) if v else "" for v in values)
        upstream, tenant = upstream or "default", tenant or "default"
        try:
            waiting = Waiting.of(ChatRequest.model_validate_json(request), tenant, upstream)
        except (ValidationError, ValueError):
            waiting = Waiting(tenant, upstream, 0, None)
        return waiting, priority if priority in PRIORITY_RANK else "normal"

    async def jobs(
        self,
        *,
        status: JobStatus | str | None = None,
        upstream: str | None = None,
        limit: int = 20,
        before: float | None = None,
        tenant: str | None = None,
        since: float | None = None,
    ) -> JobPage:
        """The newest jobs (enqueued before ``before``, and at or after ``since``), optionally
        only those with this status, upstream or tenant; examines at most the newest 10,000
        entries of the index.

        Only jobs enqueued through ``enqueue`` (or a producer following docs/producers.md)
        within the retention period are listed.
        """
        wanted = None if status is None else JobStatus(status).value
        return await self.index.page(
            status=wanted, upstream=upstream, tenant=tenant, limit=limit, before=before, since=since
        )

    async def progress(self, job_id: str) -> Progress | None:
        """How far a running job got (entries, characters, elapsed); None unless running."""
        record = await self.get(job_id)
        if record.status is not JobStatus.RUNNING:
            return None
        return await read_progress(self.redis, self.keys, job_id, record.attempt, record.started_at)

    async def queued_notice(self, job_id: str) -> str | None:
        """One line about a job no worker has started yet (None once one has): what
        ``enqueue --follow`` prints when its stream stays empty for a few seconds."""
        record = await self.get(job_id)
        if record.status is not JobStatus.QUEUED:
            return None
        ahead = await self.queue.scheduler.ahead_of(job_id, record.tenant, record.upstream)
        seconds, _ = await self.redis.time()
        live = int(await self.redis.zcount(self.keys.workers, int(seconds) - LIVE_WINDOW, "+inf"))
        workers = (
            f"{live} live workers"
            if live
            else f"no worker beat in {LIVE_WINDOW} s: start one with chatstream worker"
        )
        if ahead is None:
            return f"queued: next in line, waiting for a free worker ({workers})"
        held = await self.queue.scheduler.holding_back(job_id, record.upstream)
        return (
            f"queued: {ahead} jobs ahead of it in tenant {record.tenant!r}'s queue for "
            f"upstream {record.upstream!r}, waiting for "
            f"{held or 'a free worker or its upstream limits'} ({workers})"
        )

    async def aclose(self) -> None:
        await self.replication.aclose()
        await self.redis.aclose()


def _readable(raw: dict[str, str]) -> dict[str, str]:
    """The hash minus a stored request that is not a JSON object (a job written by other
    means than ``enqueue``, failed as invalid): the rest of its record stays readable."""
    try:
        request = json.loads(raw.get("request") or "{}")
    except (ValueError, RecursionError):  # RecursionError: hostile nesting ("[" * 10**5)
        request = None
    if isinstance(request, dict):
        return raw
    return {name: value for name, value in raw.items() if name != "request"}


async def within(work: Coroutine[Any, Any, T], timeout: float | None) -> T:
    """``await work``, or TimeoutError once ``timeout`` seconds passed.

    Not ``asyncio.timeout``: redis-py can swallow the one cancellation it sends (see
    ``worker.aio.cancel_and_wait``), and a blocking read then runs on past the deadline
    (``enqueue --follow --timeout 1`` streamed a 4 s reply to its end on a loaded
    machine). The work runs as a task that is cancelled until it stops, also when the
    caller is cancelled (Ctrl-C during ``tail``), with or without a timeout.
    """
    task = asyncio.ensure_future(work)  # also without a timeout: a cancel (Ctrl-C) ends it
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    finally:
        if not task.done():
            await cancel_and_wait([cast("asyncio.Task[None]", task)])
    if task not in done:
        raise TimeoutError
    return task.result()


def _problem(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        where = ".".join(str(part) for part in err["loc"]) or "record"
        return f"{where}: {err['msg']}"
    return f"a JSON field does not parse: {str(exc)[:100]}"


def _check_nesting(what: str, value: Any) -> None:
    """InvalidJobError, before anything is written, for a value nested deeper than a worker
    can run (``schemas.requests.MAX_NESTING``)."""
    if nesting_depth(value) > MAX_NESTING:
        raise InvalidJobError(
            f"invalid job: {what} is nested more than {MAX_NESTING} levels deep "
            "(JSON objects and arrays inside each other)"
        )


def new_job_id() -> str:
    """32 random hex digits (as ``uuid4().hex`` reads, at a tenth of its cost)."""
    return os.urandom(16).hex()


_QUEUED = JobStatus.QUEUED.value  # (an enum member's value costs a Python call per job)


def _record_fields(spec: JobSpec, request_json: str, trace: dict[str, str]) -> dict[str, str]:
    return {
        "id": spec.id,
        "status": _QUEUED,
        "request": request_json,
        "upstream": spec.upstream,
        "metadata": dumps(spec.metadata) if spec.metadata else "{}",
        "tenant": spec.tenant,
        "priority": spec.priority,
        "created_at": f"{time.time():.6f}",
        "attempt": "0",
        **trace,  # the caller's trace context, when it runs in a span
    }


def url_settings(url: str, prefix: str | None) -> Settings:
    """The settings of a client made ``from_url``: the environment's, with this Redis URL
    (and prefix); a bad ``CHATSTREAM_*`` variable is a ConfigError naming it."""
    updates: dict[str, Any] = {"redis_url": url}
    if prefix is not None:
        updates["prefix"] = prefix
    return load_settings(**updates)


class SyncClient:
    """The same calls for synchronous code, on a private event loop."""

    def __init__(self, settings: Settings | None = None) -> None:
        self._runner = asyncio.Runner()
        self._settings = settings or Settings()
        self._client = Client.from_settings(self._settings)

    @classmethod
    def from_url(cls, url: str, *, prefix: str | None = None) -> SyncClient:
        """As ``Client.from_url``: a connection of its own to ``url``, the other settings
        from the environment; close it (``with``, or ``close``)."""
        return cls(url_settings(url, prefix))

    def enqueue(
        self,
        request: ChatRequest | dict[str, Any],
        job_id: str | None = None,
        upstream: str = "default",
        metadata: dict[str, Any] | None = None,
        *,
        tenant: str = "default",
        priority: Priority = "normal",
    ) -> str:
        return self._runner.run(
            self._client.enqueue(
                request, job_id, upstream, metadata, tenant=tenant, priority=priority
            )
        )

    def enqueue_many(
        self,
        requests: Iterable[ChatRequest | dict[str, Any]],
        upstream: str = "default",
        metadata: dict[str, Any] | None = None,
        *,
        tenant: str = "default",
        priority: Priority = "normal",
        batch: int = 1_000,
    ) -> list[str]:
        return self._runner.run(
            self._client.enqueue_many(
                requests, upstream, metadata, tenant=tenant, priority=priority, batch=batch
            )
        )

    def get(self, job_id: str) -> JobRecord:
        return self._runner.run(self._client.get(job_id))

    def result(self, job_id: str, timeout: float | None = None) -> JobRecord:
        return self._runner.run(self._client.result(job_id, timeout))

    def cancel(self, job_id: str) -> JobStatus | str:
        return self._runner.run(self._client.cancel(job_id))

    def dead_letters(self, count: int = 1000) -> list[DeadLetter]:
        return self._runner.run(self._client.dead_letters(count))

    def requeue(self, job_id: str) -> str:
        return self._runner.run(self._client.requeue(job_id))

    def jobs(
        self,
        *,
        status: JobStatus | str | None = None,
        upstream: str | None = None,
        limit: int = 20,
        before: float | None = None,
        tenant: str | None = None,
        since: float | None = None,
    ) -> JobPage:
        return self._runner.run(
            self._client.jobs(
                status=status,
                upstream=upstream,
                limit=limit,
                before=before,
                tenant=tenant,
                since=since,
            )
        )

    def progress(self, job_id: str) -> Progress | None:
        return self._runner.run(self._client.progress(job_id))

    def queued_notice(self, job_id: str) -> str | None:
        return self._runner.run(self._client.queued_notice(job_id))

    def events(self, job_id: str, after: str = "0-0") -> Iterator[StreamEvent]:
        stream = self._client.events(job_id, after)
        try:
            while True:
                try:
                    yield self._runner.run(anext(stream))  # type: ignore[arg-type]
                except StopAsyncIteration:
                    return
        finally:
            self._runner.run(stream.aclose())  # type: ignore[attr-defined]

    def close(self) -> None:
        self._runner.run(self._client.aclose())
        self._runner.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]
    ) -> None:
        self.close()


def routed(spec: JobSpec, routes: frozenset[str]) -> JobSpec:
    """A job naming the default upstream whose model is a route's name uses that route
    (docs/routing.md): its upstream becomes the route, so the scheduler chooses its target."""
    model = spec.request.model
    if spec.upstream != DEFAULT_UPSTREAM or model not in routes:
        return spec
    return spec.model_copy(update={"upstream": model})
