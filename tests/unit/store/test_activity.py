"""The per-minute activity counts (worker/store/activity.py): the tally, its bounded hashes in
Redis, and the series and percentiles the dashboard draws from them."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio import Redis

from worker.settings import Settings
from worker.store.activity import (
    MAX_FIELDS,
    TTFT_BOUNDS_MS,
    TTL_SECONDS,
    ActivityLog,
    Finished,
    Tally,
    code_field,
    per_name,
    quantile,
    series,
    ttft_bucket,
)
from worker.store.keys import Keys

MINUTE = 29_000_000  # a Unix minute (2025)


def test_a_tally_counts_a_jobs_end_by_status_upstream_tenant_and_code() -> None:
    tally = Tally()
    now = MINUTE * 60 + 5
    tally.finished(Finished("succeeded", "acme", "default", 120, 30, 0.4), now)
    tally.finished(Finished("failed", "acme", "default", 7, 0, None, "upstream_timeout"), now)
    tally.finished(Finished("failed", "bad:name", "other", code="no-such-code"), now + 60)
    pending = tally.take()
    assert tally.take() == {}
    assert pending[MINUTE] == {
        "n:succeeded": 1, "n:failed": 1, "tok": 127, "ptok": 30,
        "u:default:n": 2, "u:default:f": 1, "u:default:tok": 127,
        "t:acme:n": 2, "t:acme:f": 1, "t:acme:tok": 127,
        "ttft:4": 1, "f:upstream_timeout": 1,
    }  # fmt: skip
    later = pending[MINUTE + 1]
    assert later["t:~other:f"] == 1 and later["f:other"] == 1  # names that cannot be fields


def test_a_tally_given_back_adds_to_what_came_since() -> None:
    tally = Tally()
    tally.finished(Finished("succeeded", "a", "u", 5), MINUTE * 60)
    pending = tally.take()
    tally.finished(Finished("succeeded", "a", "u", 5), MINUTE * 60)
    tally.give_back(pending)
    assert tally.take()[MINUTE]["tok"] == 10


def test_codes_are_the_error_trees() -> None:
    assert code_field("upstream_stream_error") == "upstream_stream_error"
    assert code_field("attempts_exhausted") == "attempts_exhausted"
    assert code_field("anything else") == "other"


def test_ttft_buckets_have_inclusive_upper_bounds() -> None:
    assert [ttft_bucket(s) for s in (0.0, 0.05, 0.0501, 60.0, 61.0)] == [0, 0, 1, 13, 14]


@given(st.lists(st.floats(0, 70_000), min_size=1, max_size=300), st.sampled_from([0.5, 0.95]))
def test_quantiles_fall_in_the_bucket_of_the_exact_one(samples: list[float], q: float) -> None:
    """The interpolated quantile lies within the bucket that holds the exact one."""
    histogram = [0] * (len(TTFT_BOUNDS_MS) + 1)
    for ms in samples:
        histogram[ttft_bucket(ms / 1000)] += 1
    exact = sorted(samples)[max(0, -(-int(q * len(samples) * 1000) // 1000) - 1)]
    bucket = ttft_bucket(exact / 1000)
    low = 0 if bucket == 0 else TTFT_BOUNDS_MS[bucket - 1]
    high = TTFT_BOUNDS_MS[min(bucket, len(TTFT_BOUNDS_MS) - 1)]
    found = quantile(histogram, q)
    assert found is not None and low <= found <= high, (found, exact, low, high)


def test_no_samples_no_quantile() -> None:
    assert quantile([0] * (len(TTFT_BOUNDS_MS) + 1), 0.5) is None


def test_series_merge_minutes_into_points_and_list_every_failure_code() -> None:
    counts = {
        MINUTE: {"n:succeeded": 2, "tok": 100, "ttft:2": 2},
        MINUTE + 1: {"n:failed": 1, "f:upstream": 1, "ttft:4": 1},
        MINUTE + 3: {"n:cancelled": 1},
    }
    out = series(counts, MINUTE, points=2, step=2)
    assert out.finished == [3, 1] and out.failed == [1, 0] and out.tokens == [100, 0]
    assert out.failures == {"upstream": [1, 0]}
    assert out.ttft_p50_ms[0] is not None and 100 < out.ttft_p50_ms[0] <= 200
    assert out.ttft_p95_ms[1] is None
    upstreams = per_name({"u:a:n": 3, "u:a:tok": 9, "t:x:f": 1}, "u")
    assert upstreams == {"a": {"n": 3, "f": 0, "tok": 9}}


async def test_the_log_adds_counts_with_an_expiry_and_a_bounded_size(
    settings: Settings, redis: Redis
) -> None:
    keys = Keys(settings.prefix)
    log = ActivityLog(redis, keys)
    await log.add(MINUTE, {"n:succeeded": 2, "tok": 40})
    await log.add(MINUTE, {"n:succeeded": 1, "t:a:n": 1})
    assert await log.read([MINUTE, MINUTE + 1]) == {
        MINUTE: {"n:succeeded": 3, "tok": 40, "t:a:n": 1},
        MINUTE + 1: {},
    }
    assert TTL_SECONDS - 5 < await redis.ttl(keys.activity(MINUTE)) <= TTL_SECONDS
    tenants = [f"t{i}" for i in range(MAX_FIELDS)]
    random.shuffle(tenants)
    for start in range(0, len(tenants), 50):
        await log.add(MINUTE, {f"t:{name}:n": 1 for name in tenants[start : start + 50]})
    await log.add(MINUTE, {"t:a:n": 1, "n:failed": 1})  # a known tenant, a fixed field
    stored = (await log.read([MINUTE]))[MINUTE]
    assert len(stored) == MAX_FIELDS + 2  # the fixed fields beyond the bound, and ~other
    assert stored["t:a:n"] == 2 and stored["n:failed"] == 1
    named = sum(v for k, v in stored.items() if k.startswith("t:") and k != "t:~other:n")
    assert named + stored["t:~other:n"] == MAX_FIELDS + 2  # every job counted somewhere
