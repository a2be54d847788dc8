"""Finding jobs (the jobs index) and a running job's progress; SyncClient has every call."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from tests.helpers.harness import Harness, chat, custom_harness, inject
from worker.client import Client, SyncClient
from worker.settings import Upstream


async def run_all(h: Harness, *jobs: tuple[dict[str, Any], str]) -> list[str]:
    ids = [await h.client.enqueue(request, upstream=name) for request, name in jobs]
    await h.worker.run_burst()
    return ids


async def test_jobs_are_listed_newest_first_and_filtered(harness: Harness) -> None:
    upstreams = {"other": Upstream(url=harness.settings.upstream_url)}
    async with custom_harness(harness, upstreams=upstreams) as h:
        ids = await run_all(
            h,
            (chat("a"), "default"),
            (chat("b", fault="http_400"), "default"),
            (chat("c"), "other"),
            (chat("d", fault="http_404"), "other"),
        )
        queued = await h.client.enqueue(chat("e"))  # nobody runs it
        everything = await h.client.jobs()
        assert [job.id for job in everything.jobs] == [queued, *reversed(ids)]
        assert everything.next_before is None  # the index holds no more
        assert [j.status for j in everything.jobs] == [
            "queued", "failed", "succeeded", "failed", "succeeded"
        ]  # fmt: skip
        failed = await h.client.jobs(status="failed")
        assert [job.id for job in failed.jobs] == [ids[3], ids[1]]
        assert failed.jobs[0].error is not None and failed.jobs[0].error["status"] == 404
        other_failed = await h.client.jobs(status="failed", upstream="other")
        assert [job.id for job in other_failed.jobs] == [ids[3]]
        record = await h.client.get(ids[2])
        [summary] = [job for job in everything.jobs if job.id == ids[2]]
        assert (summary.upstream, summary.attempt, summary.model) == ("other", 1, record.model)
        assert (summary.created_at, summary.finished_at) == (record.created_at, record.finished_at)


async def test_pages_follow_next_before(harness: Harness) -> None:
    ids = [await harness.client.enqueue(chat(str(i))) for i in range(7)]
    seen: list[str] = []
    before = None
    for _ in range(4):
        page = await harness.client.jobs(limit=3, before=before)
        seen += [job.id for job in page.jobs]
        if page.next_before is None:
            break
        before = page.next_before
    assert seen == list(reversed(ids))


async def test_a_job_whose_record_is_gone_is_not_listed(harness: Harness) -> None:
    kept = await harness.client.enqueue(chat("kept"))
    deleted = await harness.client.enqueue(chat("deleted"))
    await harness.redis.delete(harness.client.keys.job(deleted))
    assert [job.id for job in (await harness.client.jobs()).jobs] == [kept]


async def test_a_listing_examines_a_bounded_part_of_the_index(harness: Harness) -> None:
    """Matches beyond the first ``scan`` entries are not read; next_before says where to
    go on."""
    ids = [await harness.client.enqueue(chat(str(i))) for i in range(5)]
    page = await harness.client.index.page(status="failed", scan=3)
    assert page.jobs == []
    score = await harness.redis.zscore(harness.client.keys.jobs, ids[2])
    assert page.next_before == score  # the oldest entry examined


async def test_the_index_is_bounded_by_size_and_by_retention(harness: Harness) -> None:
    client = Client(harness.redis, prefix=harness.settings.prefix, retention_seconds=100,
                    jobs_index_max=4)  # fmt: skip
    key = client.keys.jobs
    old = await client.enqueue(chat("old"))
    await client.index.add(old, time.time() - 101)  # as if enqueued past the retention
    ids = [await client.enqueue(chat(str(i))) for i in range(6)]
    members = await harness.redis.zrange(key, 0, -1)
    assert members == ids[-4:]  # the newest 4; the old one went by age, two by size
    assert 95 <= await harness.redis.ttl(key) <= 100  # the index expires with the retention
    off = Client(harness.redis, prefix="no-index-" + harness.settings.prefix, jobs_index_max=0)
    await off.enqueue(chat("unlisted"))
    assert not await harness.redis.exists(off.keys.jobs)
    assert (await off.jobs()).jobs == []


async def test_a_requeued_job_is_listed_again_as_new(harness: Harness) -> None:
    job_id = await inject(harness, {"request": '{"model": "m", "messages": []}'})
    await harness.worker.run_burst()  # invalid request: failed
    later = await harness.client.enqueue(chat("later"))
    # inject() writes no index entry, like a producer that skips it: not listed
    assert [j.id for j in (await harness.client.jobs()).jobs] == [later]
    assert await harness.client.requeue(job_id) == "requeued"
    assert [j.id for j in (await harness.client.jobs()).jobs] == [job_id, later]


async def test_progress_of_a_running_job(harness: Harness) -> None:
    job_id = await harness.client.enqueue(chat("slow", tokens=2000, rate=40))  # cancelled
    assert await harness.client.progress(job_id) is None  # queued
    burst = asyncio.create_task(harness.worker.run_burst())
    key = harness.client.keys.events(job_id)
    assert await harness.redis.xread({key: "0-0"}, count=1, block=10_000)
    await asyncio.sleep(0.3)
    progress = await harness.client.progress(job_id)
    entries = [e async for e in _deltas_so_far(harness, job_id)]
    assert await harness.client.cancel(job_id) == "requested"
    await asyncio.wait_for(burst, 15)
    assert progress is not None
    assert progress.attempt == 1
    assert 1 <= progress.deltas <= len(entries)
    published = "".join(data.get("content", "") for data in entries[: progress.deltas])
    assert progress.characters == len(published) > 0
    assert progress.elapsed is not None and 0.3 <= progress.elapsed < 10
    assert progress.last_delta_age is not None and progress.last_delta_age < 5
    assert await harness.client.progress(job_id) is None  # ended (cancelled)


async def _deltas_so_far(h: Harness, job_id: str) -> AsyncIterator[dict[str, Any]]:
    rows: Any = await h.redis.xrange(h.client.keys.events(job_id))
    for _, fields in rows:
        if fields["type"] == "delta":
            yield json.loads(fields["data"])


# -- SyncClient ---------------------------------------------------------------------------


def public_calls(cls: type) -> dict[str, list[str]]:
    return {
        name: list(inspect.signature(member).parameters)
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def test_sync_client_offers_every_client_call() -> None:
    """The README promises SyncClient "the same calls": same names, same parameters."""
    async_calls = public_calls(Client)
    sync_calls = public_calls(SyncClient)
    del async_calls["aclose"]  # SyncClient.close()
    missing = {name for name in async_calls if name not in sync_calls}
    assert not missing, missing
    for name, parameters in async_calls.items():
        if name != "events":  # the sync iterator has no block_ms
            assert sync_calls[name] == parameters, name
    assert sync_calls["events"] == async_calls["events"][:-1]
    # and made alike from a URL (README): SyncClient.from_url as Client.from_url
    made = [inspect.signature(cls.from_url).parameters for cls in (Client, SyncClient)]
    assert list(made[0]) == list(made[1]) == ["url", "prefix"]


def _sync_finding(harness: Harness, failed_id: str) -> Any:
    with SyncClient(harness.settings) as client:
        page = client.jobs(status="failed")
        letters = client.dead_letters()
        requeued = client.requeue(failed_id)
        return page, letters, requeued, client.progress(failed_id)


async def test_sync_client_finds_dead_letters_and_requeues(harness: Harness) -> None:
    failed_id = await inject(harness, {"request": '{"model": "m", "messages": [{}]}'})
    await harness.redis.hset(harness.client.keys.job(failed_id), "attempt", "3")
    await harness.client.index.add(failed_id)
    await harness.worker.run_burst()  # attempts exhausted: failed and dead-lettered
    page, letters, requeued, progress = await asyncio.to_thread(_sync_finding, harness, failed_id)
    assert [job.id for job in page.jobs] == [failed_id]
    assert [letter.job_id for letter in letters] == [failed_id]
    assert requeued == "requeued" and progress is None
    assert (await harness.client.get(failed_id)).status == "queued"
    assert await harness.client.dead_letters() == []
