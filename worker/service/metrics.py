"""Prometheus metrics of one worker: counters, histograms and gauges in its own registry.

Served on ``/metrics`` by the worker's health server (``worker/service/health.py``). Each
:class:`Worker` has its own ``CollectorRegistry``, so several workers in one process never
clash.

Hot-path cost: observations are per job (at its end), per publish batch, per retry and
per queue read, never per delta (the pipeline only counts deltas in :class:`JobTiming`).
The queue gauges are read by the maintenance loop in one pipelined round trip and served
from memory; in-flight is read from the worker at scrape time.

Metrics (all prefixed ``chatstream_``): ``jobs_total{status}``, ``jobs_in_flight``,
``queue_depth``, ``queue_pending``, ``dead_letters``, ``queue_wait_seconds``,
``time_to_first_token_seconds``, ``deltas_per_second``, ``job_duration_seconds{status}``,
``retries_total{stage}``, ``reclaims_total``, ``upstream_errors_total{upstream,code,status}``,
``tokens_total{upstream,model,kind}``, ``publish_seconds``, ``publish_batch_size``,
``event_loop_lag_seconds``, ``jobs_missing_total``, ``upstream_down{upstream}``,
``upstream_waiting_jobs{upstream}``; plus the standard ``process_*`` metrics.

Label values are bounded: ``upstream`` is a configured name (else ``other``), ``code`` one
of the error codes, ``status`` an HTTP status (``none`` without one), ``model`` one of the
first ``max_models`` model names a worker saw (later ones count as ``other``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from schemas.jobs import TERMINAL
from worker.errors import ChatstreamError, ProtocolError, UpstreamError
from worker.store.activity import Finished, Tally
from worker.store.fleet import FleetReader
from worker.store.keys import Keys
from worker.store.redis_client import RedisClient
from worker.store.scheduler import Scheduler, ShardCounts
from worker.store.stats import QueueCounts, queue_counts

QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
FIRST_TOKEN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 20, 30, 60)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 900)
RATE_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 500, 1000, 5000)
PUBLISH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


@dataclass(slots=True)
class JobTiming:
    """One job's clock (monotonic seconds), filled by the pipeline at no per-delta cost."""

    started: float = field(default_factory=time.monotonic)
    first_delta: float | None = None
    deltas: int = 0
    first_read: float | None = None  # the upstream's first body bytes (after its retries)

    def saw_output(self) -> None:
        """Called once per upstream read: stamps the first read's and the first delta's
        arrival (after the first delta, one comparison per read)."""
        if self.first_delta is None:
            now = time.monotonic()
            if self.first_read is None:
                self.first_read = now
            if self.deltas:
                self.first_delta = now


class QueueGauges:
    """A collector serving the last queue counts the maintenance loop read (fleet-wide:
    every worker serves the same values; aggregate them with ``max``, not ``sum``)."""

    def __init__(self) -> None:
        self.counts: QueueCounts | None = None
        self.scheduled: ShardCounts | None = None

    def describe(self) -> Iterable[Metric]:
        return self._families(QueueCounts(0, 0, 0), ShardCounts())

    def collect(self) -> Iterable[Metric]:
        if self.counts is None:
            return []
        return self._families(self.counts, self.scheduled or ShardCounts())

    @staticmethod
    def _families(counts: QueueCounts, scheduled: ShardCounts) -> list[Metric]:
        families = [
            GaugeMetricFamily(
                "chatstream_queue_depth",
                "Jobs queued or running: the queue streams' entries plus the tenants' queues",
                value=counts.length + counts.scheduled,
            ),
            GaugeMetricFamily(
                "chatstream_jobs_waiting",
                "Jobs waiting to run (for a worker, or for their upstream's limits): the "
                "number to scale workers on",
                value=counts.waiting,
            ),
            GaugeMetricFamily(
                "chatstream_queue_pending",
                "Queue entries delivered to a worker and not acked yet",
                value=counts.pending,
            ),
            GaugeMetricFamily(
                "chatstream_dead_letters", "Entries in the dead-letter stream", value=counts.dead
            ),
        ]
        return families + _labelled_families(scheduled)


def _labelled_families(scheduled: ShardCounts) -> list[Metric]:
    tenants = GaugeMetricFamily(
        "chatstream_tenant_jobs_waiting",
        "Jobs waiting in each tenant's queues (the most waiting tenants; the rest: other)",
        labels=["tenant"],
    )
    for name, count in _bounded(scheduled.tenants).items():
        tenants.add_metric([name], count)
    queued = GaugeMetricFamily(
        "chatstream_upstream_jobs_queued",
        "Jobs waiting in the tenants' queues for each upstream",
        labels=["upstream"],
    )
    for name, count in scheduled.upstreams.items():
        queued.add_metric([name], count)
    permits = GaugeMetricFamily(
        "chatstream_upstream_permits_in_use",
        "Streams out of the queue for each upstream with limits (its max_concurrent counts these)",
        labels=["upstream"],
    )
    for name, count in scheduled.permits.items():
        permits.add_metric([name], count)
    return [tenants, queued, permits]


def _bounded(counts: dict[str, int]) -> dict[str, int]:
    """The ``MAX_TENANT_LABELS`` largest counts by name, the rest summed as ``other``."""
    ranked = sorted(counts.items(), key=lambda item: -item[1])
    kept = dict(ranked[:MAX_TENANT_LABELS])
    rest = sum(count for _, count in ranked[MAX_TENANT_LABELS:])
    if rest:
        kept[OTHER] = kept.get(OTHER, 0) + rest
    return kept


class TenantGauges:
    """A collector reading, at scrape time, this worker's running jobs per tenant."""

    def __init__(self, running: Callable[[], dict[str, int]]) -> None:
        self.running = running

    def describe(self) -> Iterable[Metric]:
        return [self._family({})]

    def collect(self) -> Iterable[Metric]:
        running = {"default": 0, **self.running()}  # the family is served from the start
        return [self._family(_bounded(running))]

    @staticmethod
    def _family(counts: dict[str, int]) -> Metric:
        family = GaugeMetricFamily(
            "chatstream_tenant_jobs_running",
            "Jobs this worker runs for each tenant (sum over workers)",
            labels=["tenant"],
        )
        for name, count in counts.items():
            family.add_metric([name], count)
        return family


MAX_TENANT_LABELS = 100
OTHER = "other"  # the label value of whatever lies beyond a label's bound
MAX_MODEL_LABEL = 100  # characters of a model name kept as a label value


class RouteGauges:
    """A collector serving which routes' targets the fleet holds down (the breaker, read by
    the maintenance loop: every worker serves the same values)."""

    def __init__(self) -> None:
        self.down: list[tuple[str, str, str, bool]] = []  # (route, upstream, model, skipped)

    def describe(self) -> Iterable[Metric]:
        return [self._family([])]

    def collect(self) -> Iterable[Metric]:
        return [self._family(self.down)] if self.down else []

    @staticmethod
    def _family(rows: list[tuple[str, str, str, bool]]) -> Metric:
        family = GaugeMetricFamily(
            "chatstream_route_target_down",
            "1 while every worker skips the route's target (it failed; one job probes it "
            "after its cooldown), else 0",
            labels=["route", "upstream", "model"],
        )
        for route, upstream, model, down in rows:
            family.add_metric([route, upstream, model[:MAX_MODEL_LABEL]], int(down))
        return family


UpstreamHealth = Callable[[], Iterable[tuple[str, bool, int]]]  # (name, down, jobs waiting)


class UpstreamGauges:
    """A collector reading, at scrape time, which upstreams are down and who waits on them."""

    def __init__(self, health: UpstreamHealth) -> None:
        self.health = health

    def describe(self) -> Iterable[Metric]:
        return self._families([])

    def collect(self) -> Iterable[Metric]:
        return self._families(list(self.health()))

    @staticmethod
    def _families(rows: list[tuple[str, bool, int]]) -> list[Metric]:
        down = GaugeMetricFamily(
            "chatstream_upstream_down",
            "1 while this worker finds the upstream, or a model of it, down (retryable "
            "failures before the first byte; one job probes it, the others wait)",
            labels=["upstream"],
        )
        waiting = GaugeMetricFamily(
            "chatstream_upstream_waiting_jobs",
            "Jobs of this worker waiting for the upstream to come back (without a slot)",
            labels=["upstream"],
        )
        for name, is_down, count in rows:
            down.add_metric([name], 1 if is_down else 0)
            waiting.add_metric([name], count)
        return [down, waiting]


class Metrics:
    """The worker's metrics, in a registry of its own.

    ``upstreams``: the configured upstream names (any other name is labelled ``other``;
    None: no bound, for tests). ``max_models``: distinct ``model`` label values kept.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        upstreams: Iterable[str] | None = None,
        max_models: int = 50,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._upstreams = frozenset(upstreams) if upstreams is not None else None
        self._models: set[str] = set()
        self._max_models = max_models
        r = self.registry
        self.jobs = Counter(
            "chatstream_jobs", "Jobs that reached a final status", ["status"], registry=r
        )
        for status in sorted(TERMINAL):
            self.jobs.labels(status.value)
        self.in_flight = Gauge("chatstream_jobs_in_flight", "Jobs this worker runs", registry=r)
        self.queue_wait = Histogram(
            "chatstream_queue_wait_seconds",
            "From the queue entry's creation to its delivery to a worker",
            buckets=QUEUE_WAIT_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            "chatstream_time_to_first_token_seconds",
            "From the attempt's start to its first delta",
            buckets=FIRST_TOKEN_BUCKETS,
            registry=r,
        )
        self.delta_rate = Histogram(
            "chatstream_deltas_per_second",
            "Per job: deltas (tokens) per second after the first one",
            buckets=RATE_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "chatstream_job_duration_seconds",
            "From the attempt's start to its terminal write, by final status",
            ["status"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self._init_counters(r)
        self.activity = Tally()  # the per-minute counts in Redis (the dashboard's charts)
        self.queue = QueueGauges()
        r.register(self.queue)
        ProcessCollector(registry=r)

    def _init_counters(self, r: CollectorRegistry) -> None:
        self.retries = Counter(
            "chatstream_retries",
            "Upstream retries: before the first byte (upstream) or of the whole stream",
            ["stage"],
            registry=r,
        )
        for stage in ("upstream", "pipeline"):
            self.retries.labels(stage)
        self.reclaims = Counter(
            "chatstream_reclaims", "Queue entries taken over from dead workers", registry=r
        )
        self.upstream_errors = Counter(
            "chatstream_upstream_errors",
            "Upstream failures, by upstream, error code and HTTP status (none without one)",
            ["upstream", "code", "status"],
            registry=r,
        )
        self.tokens = Counter(
            "chatstream_tokens",
            "Tokens in the usage the upstreams reported, by upstream, model and kind "
            "(prompt or completion)",
            ["upstream", "model", "kind"],
            registry=r,
        )
        self.publish_seconds = Histogram(
            "chatstream_publish_seconds",
            "Round trip of one pipelined publish batch",
            buckets=PUBLISH_BUCKETS,
            registry=r,
        )
        self.publish_batch = Histogram(
            "chatstream_publish_batch_size",
            "Writes (delta entries and terminal writes) in one publish batch",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.loop_lag = Gauge(
            "chatstream_event_loop_lag_seconds",
            "How late the event loop woke up in the last sample",
            registry=r,
        )
        self.missing = Counter(
            "chatstream_jobs_missing",
            "Queue entries and running jobs whose record was gone (expired, or Redis lost it)",
            registry=r,
        )
        self.route_fallbacks = Counter(
            "chatstream_route_fallbacks",
            "Jobs that left a route's target for the next one (it failed them, or their "
            "prompt was too long for it), by route and target",
            ["route", "upstream", "model"],
            registry=r,
        )
        self.route_jobs = Counter(
            "chatstream_route_jobs",
            "Routed jobs that reached a final status, by route, the target that served (or "
            "failed) them, and status",
            ["route", "upstream", "model", "status"],
            registry=r,
        )
        self.routes = RouteGauges()
        r.register(self.routes)

    def watch_upstreams(self, health: UpstreamHealth) -> None:
        """Serve ``upstream_down`` and ``upstream_waiting_jobs`` from ``health()``."""
        self.registry.register(UpstreamGauges(health))

    def watch_tenants(self, running: Callable[[], dict[str, int]]) -> None:
        """Serve ``tenant_jobs_running`` from ``running()``."""
        self.registry.register(TenantGauges(running))

    # -- observations ------------------------------------------------------------------

    def job_finished(self, status: str, timing: JobTiming) -> None:
        now = time.monotonic()
        self.jobs.labels(status).inc()
        self.duration.labels(status).observe(now - timing.started)
        first = timing.first_delta
        if first is not None:
            self.first_token.observe(first - timing.started)
            if timing.deltas > 1 and now > first:
                self.delta_rate.observe((timing.deltas - 1) / (now - first))

    def job_ended(
        self,
        status: str,
        timing: JobTiming,
        *,
        tenant: str,
        upstream: str,
        usage: Any = None,
        code: str | None = None,
        route: str | None = None,
        fallbacks: int = 0,
    ) -> None:
        """A job's end in the per-minute activity counts (``code``: a failed job's;
        ``route`` and its ``fallbacks``: a routed job's)."""
        completion = _token_count(usage, "completion_tokens")
        first = timing.first_delta
        self.activity.finished(
            Finished(
                status,
                tenant,
                self.upstream_label(upstream),
                completion if completion is not None else timing.deltas,
                _token_count(usage, "prompt_tokens") or 0,
                None if first is None else first - timing.started,
                code,
                route,
                fallbacks,
            )
        )

    def job_missing(self) -> None:
        self.missing.inc()

    def job_failed_unstarted(self, tenant: str, upstream: str, code: str) -> None:
        """A job the runner failed without running it (attempts exhausted)."""
        self.jobs.labels("failed").inc()
        self.activity.finished(Finished("failed", tenant, self.upstream_label(upstream), code=code))

    def delivered(self, entry_ids: Iterable[str]) -> None:
        """Queue wait of freshly read entries (their stream ids are Redis milliseconds)."""
        now = time.time()
        for entry_id in entry_ids:
            millis = entry_id.partition("-")[0]
            if millis.isdigit():
                self.queue_wait.observe(max(now - int(millis) / 1000, 0.0))

    def reclaimed(self, count: int) -> None:
        if count:
            self.reclaims.inc(count)

    def upstream_error(self, exc: BaseException, upstream: str | None = None) -> None:
        """A failure that ended a try of the stream (after the upstream client's retries)."""
        if isinstance(exc, UpstreamError | ProtocolError):
            self.upstream_error_code(exc.code, upstream or _upstream_of(exc), _status_of(exc))

    def upstream_error_code(
        self, code: str, upstream: str | None, status: int | None = None
    ) -> None:
        labels = (self.upstream_label(upstream), code, "none" if status is None else str(status))
        self.upstream_errors.labels(*labels).inc()

    def on_upstream_retry(self, exc: BaseException, wait: float) -> None:
        """``UpstreamClient(on_retry=...)``: a retry before the first byte."""
        self.retries.labels("upstream").inc()
        code = exc.code if isinstance(exc, ChatstreamError) else type(exc).__name__
        self.upstream_error_code(code, _upstream_of(exc), _status_of(exc))

    def job_usage(self, upstream: str, model: str | None, usage: Any) -> None:
        """The tokens of a finished job's usage (prompt and completion), for cost."""
        if not isinstance(usage, dict):
            return
        labels = (self.upstream_label(upstream), self.model_label(model))
        for kind in ("prompt", "completion"):
            count = usage.get(f"{kind}_tokens")
            if isinstance(count, int) and not isinstance(count, bool) and count > 0:
                self.tokens.labels(*labels, kind).inc(count)

    def upstream_label(self, name: str | None) -> str:
        if not name:
            return OTHER
        return name if self._upstreams is None or name in self._upstreams else OTHER

    def model_label(self, model: str | None) -> str:
        """The model's name while fewer than ``max_models`` were seen, else ``other``."""
        name = (model or "unknown")[:MAX_MODEL_LABEL]
        if name not in self._models:
            if len(self._models) >= self._max_models:
                return OTHER
            self._models.add(name)
        return name

    def pipeline_retry(self) -> None:
        self.retries.labels("pipeline").inc()

    def on_batch(self, size: int, seconds: float) -> None:
        """``Publisher(on_batch=...)``: one pipelined round trip."""
        self.publish_batch.observe(size)
        self.publish_seconds.observe(seconds)

    def route_fallback(self, route: str, upstream: str, model: str) -> None:
        self.route_fallbacks.labels(
            route, self.upstream_label(upstream), model[:MAX_MODEL_LABEL]
        ).inc()

    def route_job(self, route: str, served: dict[str, str], status: str) -> None:
        """A job of ``route`` ended (``served``: where its last try went)."""
        upstream, model = self.upstream_label(served["upstream"]), served.get("model", "")
        self.route_jobs.labels(route, upstream, model[:MAX_MODEL_LABEL], status).inc()

    async def refresh_queue(
        self, redis: RedisClient, keys: Keys, targets: list[tuple[str, str, str]] | None = None
    ) -> None:
        self.queue.counts = await queue_counts(redis, keys)
        self.queue.scheduled = await Scheduler(redis, keys).counts()
        if targets:
            self.routes.down = await FleetReader(redis, keys).targets_down(targets)


# -- the HTTP server ----------------------------------------------------------------------


def _token_count(usage: Any, name: str) -> int | None:
    count = usage.get(name) if isinstance(usage, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else None


def _upstream_of(exc: BaseException) -> str | None:
    return exc.upstream if isinstance(exc, UpstreamError) else None


def _status_of(exc: BaseException) -> int | None:
    return exc.status if isinstance(exc, UpstreamError) else None
