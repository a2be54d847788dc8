"""Prometheus metrics and the health endpoints, scraped over HTTP from a running worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from tests.helpers.checks import eventually, is_ready, readiness
from tests.helpers.fakes import silent_server
from tests.helpers.harness import chat
from tests.helpers.servers import free_port
from worker.client import Client
from worker.service.health import MetricsServer
from worker.service.metrics import JobTiming, Metrics
from worker.service.worker import Worker
from worker.settings import Route, RouteTarget, Settings, Upstream
from worker.store.keys import Keys
from worker.store.queue import Queue
from worker.store.scheduler import TargetFailure
from worker.testing.mock_upstream import MockUpstream

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


@dataclass
class Served:
    worker: Worker
    client: Client
    http: httpx.AsyncClient
    mock: MockUpstream

    async def scrape(self) -> Samples:
        response = await self.http.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        return parse(response.text)

    async def value(self, name: str, **labels: str) -> float | None:
        return (await self.scrape()).get((name, tuple(sorted(labels.items()))))

    async def until(self, name: str, expected: float, timeout: float = 10, **labels: str) -> None:
        """Scrape until the sample has the expected value."""
        deadline = time.monotonic() + timeout
        while (value := await self.value(name, **labels)) != expected:
            assert time.monotonic() < deadline, f"{name}{labels} = {value}, not {expected}"
            await asyncio.sleep(0.05)


def metric_settings(settings: Settings, url: str, **update: object) -> Settings:
    fields: dict[str, object] = {
        "upstream_url": url,
        "metrics_port": 0,
        "metrics_host": "127.0.0.1",
        "lease_seconds": 1.5,  # the maintenance loop (queue gauges) ticks every 0.5 s
    }
    return settings.model_copy(update={**fields, **update})


@pytest.fixture
async def served(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> AsyncIterator[Served]:
    app, url = mock_upstream
    settings = metric_settings(settings, url)
    worker = Worker(settings, redis)
    await worker.startup()
    assert worker.http is not None and worker.http.port > 0
    consume = asyncio.create_task(worker.consume())
    base = f"http://127.0.0.1:{worker.http.port}"
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        yield Served(worker, Client.from_settings(settings, redis), http, app)
    worker.stopping.set()  # as runner.serve does: consume() ends even if a read eats the cancel
    consume.cancel()
    await asyncio.gather(consume, return_exceptions=True)
    await worker.shutdown()


async def test_job_metrics_move_as_jobs_finish(served: Served) -> None:
    before = await served.scrape()
    assert before[("chatstream_jobs_total", (("status", "succeeded"),))] == 0
    assert before[("chatstream_jobs_in_flight", ())] == 0
    jobs = [await served.client.enqueue(chat(f"m{i}", tokens=12)) for i in range(5)]
    for job_id in jobs:
        assert (await served.client.result(job_id, timeout=10)).status == "succeeded"
    # the worker counts a job just after its terminal write and frees the slot after the ack
    await served.until("chatstream_jobs_total", 5, status="succeeded")
    await served.until("chatstream_jobs_in_flight", 0)
    after = await served.scrape()
    succeeded = (("status", "succeeded"),)
    assert after[("chatstream_jobs_total", succeeded)] == 5
    assert after[("chatstream_jobs_total", (("status", "failed"),))] == 0
    assert after[("chatstream_job_duration_seconds_count", succeeded)] == 5
    assert after[("chatstream_time_to_first_token_seconds_count", ())] == 5
    assert after[("chatstream_deltas_per_second_count", ())] == 5
    assert after[("chatstream_deltas_per_second_sum", ())] > 0
    assert after[("chatstream_queue_wait_seconds_count", ())] == 5
    # every job wrote at least one delta entry and its terminal entry
    assert after[("chatstream_publish_batch_size_sum", ())] >= 10
    assert after[("chatstream_publish_seconds_count", ())] >= 1
    assert after[("chatstream_jobs_in_flight", ())] == 0
    assert after[("chatstream_retries_total", (("stage", "upstream"),))] == 0
    assert ("process_resident_memory_bytes", ()) in after


async def test_in_flight_rises_during_slow_jobs_and_falls_back_to_zero(served: Served) -> None:
    jobs = [await served.client.enqueue(chat(f"s{i}", tokens=20, rate=20)) for i in range(3)]
    await served.until("chatstream_jobs_in_flight", 3)
    for job_id in jobs:
        assert (await served.client.result(job_id, timeout=10)).status == "succeeded"
    await served.until("chatstream_jobs_in_flight", 0)
    first = await served.scrape()
    ttft = first[("chatstream_time_to_first_token_seconds_sum", ())]
    assert 0 < ttft < 3
    rate_sum = first[("chatstream_deltas_per_second_sum", ())]
    assert 3 * 5 < rate_sum < 3 * 200  # about 20 deltas per second each


async def test_queue_gauges_follow_the_queue(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> None:
    settings = metric_settings(settings, mock_upstream[1])
    worker = Worker(settings, redis)
    await worker.startup()  # maintenance runs; nothing consumes
    assert worker.http is not None
    client = Client.from_settings(settings, redis)
    base = f"http://127.0.0.1:{worker.http.port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=5) as http:
            served = Served(worker, client, http, mock_upstream[0])
            await served.until("chatstream_queue_depth", 0)
            for i in range(4):
                await client.enqueue(chat(f"q{i}"))
            await served.until("chatstream_queue_depth", 4)
            assert await served.value("chatstream_queue_pending") == 0
            # another consumer takes one entry and sits on it
            await Queue(redis, worker.keys, "elsewhere").read(1, 10)
            await served.until("chatstream_queue_pending", 1)
            await redis.xadd(worker.keys.dead, {"job": "x", "reason": "{}"})
            await served.until("chatstream_dead_letters", 1)
            assert await worker.run_burst() == 3
            await served.until("chatstream_queue_depth", 1)  # the one held elsewhere
    finally:
        await worker.shutdown()


async def test_failures_retries_and_error_codes_are_counted(
    served: Served, settings: Settings
) -> None:
    client = served.client
    flaky = chat("r", fault="http_500", fail_times=1, key="m1", retry_after=0)
    retried = await client.enqueue(flaky)
    bad = await client.enqueue(chat("b", fault="http_400"))
    midstream = await client.enqueue(chat("e", tokens=6, fault="midstream_error", fault_after=2))
    statuses = [(await client.result(j, timeout=10)).status for j in (retried, bad, midstream)]
    assert statuses == ["succeeded", "failed", "failed"]
    await served.until("chatstream_jobs_in_flight", 0)
    samples = await served.scrape()

    def get(name: str, **labels: str) -> float | None:
        return samples.get((name, tuple(sorted(labels.items()))))

    assert get("chatstream_jobs_total", status="succeeded") == 1
    assert get("chatstream_jobs_total", status="failed") == 2
    assert get("chatstream_retries_total", stage="upstream") == 1
    assert get("chatstream_retries_total", stage="pipeline") == 0
    errors = {
        labels: value
        for (name, labels), value in samples.items()
        if name == "chatstream_upstream_errors_total"
    }
    up = ("upstream", "default")
    assert errors == {
        (("code", "upstream_retryable"), ("status", "500"), up): 1,
        (("code", "upstream_terminal"), ("status", "400"), up): 1,
        (("code", "upstream_stream_error"), ("status", "502"), up): 1,
    }


async def test_stream_retries_after_the_first_byte_are_counted(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> None:
    settings = settings.model_copy(
        update={"upstream_url": mock_upstream[1], "retry_after_output": True}
    )
    client = Client.from_settings(settings, redis)
    job_id = await client.enqueue(
        chat("t", tokens=10, fault="truncate", fault_after=4, fail_times=1, key="cut")
    )
    worker = Worker(settings, redis)
    await worker.startup()
    try:
        assert await worker.run_burst() == 1
    finally:
        await worker.shutdown()
    assert (await client.get(job_id)).status == "succeeded"
    registry = worker.metrics.registry
    assert registry.get_sample_value("chatstream_retries_total", {"stage": "pipeline"}) == 1
    labels = {"upstream": "default", "code": "truncated", "status": "none"}
    assert registry.get_sample_value("chatstream_upstream_errors_total", labels) == 1


async def test_reclaims_are_counted(settings: Settings, redis: Redis) -> None:
    settings = settings.model_copy(update={"lease_seconds": 0.3})
    client = Client.from_settings(settings, redis)
    dead = Worker(settings, redis, name="dead")
    await dead.queue.ensure_group()
    await client.enqueue(chat("orphan", fault="http_400"))
    assert len(await dead.queue.read(1, 10)) == 1  # delivered, then its worker "dies"
    await asyncio.sleep(0.4)
    worker = Worker(settings, redis)
    await worker.startup()
    try:
        assert await worker.run_burst() == 1
    finally:
        await worker.shutdown()
    assert worker.metrics.registry.get_sample_value("chatstream_reclaims_total") == 1
    # a reclaimed entry's wait is not a queue wait
    assert worker.metrics.registry.get_sample_value("chatstream_queue_wait_seconds_count") == 0


async def test_health_and_readiness(served: Served) -> None:
    health = await served.http.get("/healthz")
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    ready = await served.http.get("/readyz")
    assert (ready.status_code, ready.json()) == (200, {"ready": True})
    assert (await served.http.get("/nope")).status_code == 404
    served.worker.stopping.set()
    ready = await served.http.get("/readyz")
    assert (ready.status_code, ready.json()) == (503, {"ready": False, "reason": "shutting down"})


async def test_not_ready_without_redis() -> None:
    port = free_port()
    unreachable = Redis.from_url(f"redis://127.0.0.1:{port}/0", decode_responses=True)
    server = MetricsServer(Metrics(), unreachable, asyncio.Event())
    await server.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            ready = await http.get(f"http://127.0.0.1:{server.port}/readyz")
            health = await http.get(f"http://127.0.0.1:{server.port}/healthz")
    finally:
        await server.stop()
        await unreachable.aclose()
    assert ready.status_code == 503
    reason = ready.json()["reason"]
    assert reason.startswith(f"redis at 127.0.0.1:{port}/0 unreachable: ConnectionError: "), reason
    assert "Connect call failed" in reason  # the reason, not an empty string
    assert health.status_code == 200  # alive: only readiness depends on Redis


async def test_not_ready_while_redis_does_not_answer() -> None:
    """Something that accepts connections and never answers: a reason, not ``TimeoutError: ``."""
    async with silent_server() as port:
        silent = Redis.from_url(f"redis://127.0.0.1:{port}/3", decode_responses=True)
        server = MetricsServer(Metrics(), silent, asyncio.Event())
        try:
            reason = await server.not_ready()
        finally:
            await silent.aclose()
    assert reason == f"redis at 127.0.0.1:{port}/3 did not answer PING within 1s"


@pytest.mark.xdist_group("worker-processes")  # as in tests/system/test_redis_faults.py
async def test_readyz_is_503_while_the_worker_cannot_read_its_queue(
    settings: Settings, redis: Redis, mock_upstream: tuple[Any, str]
) -> None:
    """Redis answers PING, but the queue cannot be read (here: its key clobbered with a
    string): not ready, saying why. Once the key is gone the worker recreates its group and
    runs jobs again."""
    _, url = mock_upstream
    settings = settings.model_copy(update={"upstream_url": url, "metrics_port": 0})
    keys, client = Keys(settings.prefix), Client.from_settings(settings, redis)
    worker = Worker(settings, redis)
    await worker.startup()
    consuming = asyncio.create_task(worker.consume())
    try:
        assert worker.http is not None
        port = worker.http.port
        await eventually(lambda: is_ready(port))
        await redis.delete(keys.queue)
        await redis.set(keys.queue, "not a stream")
        # a read blocked when the key went is answered UNBLOCKED; the next ones, WRONGTYPE
        await eventually(lambda: _not_ready(port, because=WRONGTYPE))
        status, body = await readiness(port)
        assert status == 503
        assert body["reason"].startswith(WRONGTYPE)
        await redis.delete(keys.queue)
        job_id = await client.enqueue(chat("after"))
        record = await client.result(job_id, timeout=10)
        assert record.status == "succeeded"
        await eventually(lambda: is_ready(port))
    finally:
        consuming.cancel()
        await asyncio.gather(consuming, return_exceptions=True)
        await worker.shutdown()


WRONGTYPE = "cannot read the queue: ResponseError: WRONGTYPE"


async def _not_ready(port: int, because: str) -> bool:
    status, body = await readiness(port)
    return status == 503 and str(body.get("reason", "")).startswith(because)


async def test_no_server_without_a_port_and_registries_are_per_worker(
    settings: Settings, redis: Redis
) -> None:
    assert settings.metrics_port is None
    first, second = Worker(settings, redis), Worker(settings, redis)
    await first.startup()
    try:
        assert first.http is None
    finally:
        await first.shutdown()
    await second.upstream.aclose()
    first.metrics.job_failed_unstarted("acme", "default", "attempts_exhausted")
    assert first.metrics.registry.get_sample_value("chatstream_jobs_total", {"status": "failed"})
    assert (
        second.metrics.registry.get_sample_value("chatstream_jobs_total", {"status": "failed"}) == 0
    )


def test_job_timing_counts_per_job_not_per_delta() -> None:
    metrics = Metrics()
    timing = JobTiming(started=time.monotonic() - 2)
    timing.saw_output()
    assert timing.first_delta is None
    timing.deltas = 11
    timing.saw_output()
    first = timing.first_delta
    assert first is not None
    timing.saw_output()
    assert timing.first_delta == first
    metrics.job_finished("succeeded", timing)
    registry = metrics.registry
    assert registry.get_sample_value("chatstream_jobs_total", {"status": "succeeded"}) == 1
    ttft = registry.get_sample_value("chatstream_time_to_first_token_seconds_sum")
    assert ttft is not None and 1.9 < ttft < 3


async def test_tokens_are_counted_by_upstream_and_model(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> None:
    """The usage of finished jobs by upstream and model; a job without usage adds none."""
    _, url = mock_upstream
    settings = settings.model_copy(
        update={"upstream_url": url, "upstreams": {"second": Upstream(url=url)}}
    )
    client = Client.from_settings(settings, redis)
    requests = [
        (chat("one", tokens=7), "default"),
        (chat("two two", tokens=11), "default"),
        (chat("three", tokens=5), "second"),
        (chat("cut", tokens=9, fault="midstream_error", fault_after=2), "second"),
    ]
    jobs = [await client.enqueue(request, upstream=name) for request, name in requests]
    worker = Worker(settings, redis)
    await worker.startup()
    try:
        assert await worker.run_burst() == 4
    finally:
        await worker.shutdown()
    expected: dict[tuple[str, str, str], float] = {}
    for job_id, (_, name) in zip(jobs, requests, strict=True):
        record = await client.get(job_id)
        if record.status == "failed":  # the mock's mid-stream error chunk carries no usage
            assert record.usage is None
            continue
        assert record.usage is not None and record.model, record
        for kind in ("prompt", "completion"):
            key = (name, record.model, kind)
            expected[key] = expected.get(key, 0) + record.usage[f"{kind}_tokens"]
    registry = worker.metrics.registry
    for (name, model, kind), count in expected.items():
        labels = {"upstream": name, "model": model, "kind": kind}
        assert registry.get_sample_value("chatstream_tokens_total", labels) == count, labels
    assert len({key[0] for key in expected}) == 2 and len(expected) == 4
    counted = sum(
        s.value
        for family in registry.collect()
        if family.name == "chatstream_tokens"
        for s in family.samples
        if s.name == "chatstream_tokens_total"
    )
    assert counted == sum(expected.values())


def test_label_values_are_bounded() -> None:
    metrics = Metrics(upstreams=["default", "b"], max_models=2)
    usage = {"prompt_tokens": 3, "completion_tokens": 4}
    for model in ("m1", "m2", "m3", "m4", "m1"):
        metrics.job_usage("default", model, usage)
    metrics.job_usage("not-configured", "m2", usage)
    metrics.upstream_error_code("upstream_terminal", "also-not", 418)
    registry = metrics.registry
    tokens = {
        (s.labels["upstream"], s.labels["model"], s.labels["kind"]): s.value
        for family in registry.collect()
        if family.name == "chatstream_tokens"
        for s in family.samples
        if s.name == "chatstream_tokens_total"
    }
    assert tokens == {
        ("default", "m1", "prompt"): 6, ("default", "m1", "completion"): 8,
        ("default", "m2", "prompt"): 3, ("default", "m2", "completion"): 4,
        ("default", "other", "prompt"): 6, ("default", "other", "completion"): 8,
        ("other", "m2", "prompt"): 3, ("other", "m2", "completion"): 4,
    }  # fmt: skip
    labels = {"upstream": "other", "code": "upstream_terminal", "status": "418"}
    assert registry.get_sample_value("chatstream_upstream_errors_total", labels) == 1
    assert metrics.model_label("x" * 500) == "other"  # the cap holds for odd names too


async def test_route_target_down_follows_the_fleets_breaker(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> None:
    """``chatstream_route_target_down`` per (route, upstream, model): 1 while the fleet's
    breaker skips the target, its own or its upstream's (unreachable), 0 once it answered."""
    url = mock_upstream[1]
    routes = {
        "fast": Route(
            targets=[RouteTarget(upstream="default", model="a"), RouteTarget(upstream="b")]
        )
    }
    settings = metric_settings(
        settings, url, routes=routes, upstreams={"b": Upstream(url=url)}, breaker_cooldown=60.0,
        breaker_max_cooldown=60.0,
    )  # fmt: skip
    worker = Worker(settings, redis)
    await worker.startup()  # publishes the routes; maintenance refreshes the gauges
    assert worker.http is not None
    scheduler = worker.queue.scheduler
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{worker.http.port}") as http:
            served = Served(worker, Client.from_settings(settings, redis), http, mock_upstream[0])
            gauge = "chatstream_route_target_down"
            first = {"route": "fast", "upstream": "default", "model": "a"}
            second = {"route": "fast", "upstream": "b", "model": "fast"}

            async def until(expected: int, labels: dict[str, str]) -> None:
                await served.until(gauge, expected, 10, **labels)

            await until(0, first)
            await scheduler.trip(TargetFailure("default", "a", 60.0, 60.0, None, "HTTP 503", "j"))
            await until(1, first)
            assert await served.value(gauge, **second) == 0
            await scheduler.trip(TargetFailure("b", "", 60.0, 60.0, None, "refused", "j"))
            await until(1, second)  # its upstream could not be reached
            await scheduler.heal("default", "a", 30_000)
            await until(0, first)
    finally:
        await worker.shutdown()
