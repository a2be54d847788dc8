"""The overview the pages show, built from what the read loop read (pure: no I/O).

Every figure is as Redis had it at ``now`` (Redis's clock): queue shards, tenants, upstream
rows and workers, and the activity of the last hour. Upstream rows are a list of rows of one
shape (``kind``, ``name``, ``target`` and the figures), so that rows of another kind (a
route, an upstream and model target) can join them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from worker.store.activity import STATUSES, merge, per_name, quantile, series, ttft_histogram
from worker.store.fleet import Fleet, Shard, TargetHealth, Use, Waiting, route_targets

TOP_TENANTS = 100  # tenant rows in the live overview (all of them: /api/tenants)
HOUR = 60  # minutes
RATE_MINUTES = 5  # the headline rates: the last five whole minutes and the current one
LATE = 60.0  # seconds: a worker silent this long is listed as gone, not late


@dataclass(slots=True)
class Slow:
    """What the read loop refreshes now and then: the waiting jobs by tenant and priority
    (and when each shard's pass over them began, Redis time), the dead letters' tenants,
    the activity minutes."""

    waiting: dict[int, dict[str, Waiting]] = field(default_factory=dict)  # per shard
    waiting_at: dict[int, float] = field(default_factory=dict)  # when each pass began
    dead_tenants: dict[str, int] = field(default_factory=dict)  # among the newest dead letters
    dead_seen: int = 0  # dead letters looked at
    minutes: dict[int, dict[str, int]] = field(default_factory=dict)


def build(
    fleet: Fleet,
    use: Mapping[tuple[int, str], Use],
    slow: Slow,
    timeout: float,
    targets: Mapping[tuple[str, str], TargetHealth] | None = None,
) -> dict[str, Any]:
    """The overview as JSON-ready values (``timeout``: the workers' heartbeat timeout;
    ``targets``: the breaker's state of the routes' targets)."""
    minute = int(fleet.now // 60)
    hour = last_hour(slow, minute)
    tenants = tenant_rows(fleet, slow)
    workers = worker_rows(fleet, timeout)
    return {
        "now": fleet.now,
        "totals": _totals(fleet, slow, minute, len(tenants), workers),
        "shards": [_shard_row(shard, slow, fleet.now) for shard in fleet.shards],
        "tenants": tenants[:TOP_TENANTS],
        "upstreams": [
            *upstream_rows(fleet, use, per_name(hour, "u")),
            *route_rows(fleet, targets or {}, per_name(hour, "r")),
        ],
        "workers": workers,
        "activity": series(slow.minutes, minute - HOUR + 1, HOUR, 1).to_json(),
        "waiting_at": min(slow.waiting_at.values(), default=None),
        "dead_seen": slow.dead_seen,
    }


def last_hour(slow: Slow, minute: int) -> dict[str, int]:
    return merge(slow.minutes.get(m, {}) for m in range(minute - HOUR + 1, minute + 1))


def _totals(
    fleet: Fleet, slow: Slow, minute: int, tenants: int, workers: list[dict[str, Any]]
) -> dict[str, Any]:
    hour = last_hour(slow, minute)
    recent = merge(slow.minutes.get(m, {}) for m in range(minute - RATE_MINUTES, minute + 1))
    seconds = RATE_MINUTES * 60 + (fleet.now - minute * 60)  # and the current minute so far
    ended = sum(recent.get(f"n:{status}", 0) for status in STATUSES)
    ttft = ttft_histogram(hour)
    ages = [_oldest_age(shard, slow, fleet.now) for shard in fleet.shards]
    return {
        "waiting": sum(shard.waiting + shard.undelivered for shard in fleet.shards),
        "running": sum(shard.pending for shard in fleet.shards),
        "dead": fleet.dead,
        "tenants": tenants,
        "workers": len(workers),
        "workers_alive": sum(1 for row in workers if row["state"] == "alive"),
        "oldest_waiting_seconds": max((a for a in ages if a is not None), default=None),
        "finished_per_second": round(ended / seconds, 3),
        "tokens_per_second": round(recent.get("tok", 0) / seconds, 1),
        "ttft_p50_ms": quantile(ttft, 0.5),
        "ttft_p95_ms": quantile(ttft, 0.95),
        "finished_last_hour": sum(hour.get(f"n:{status}", 0) for status in STATUSES),
        "failed_last_hour": hour.get("n:failed", 0),
        "failures_last_hour": {k[2:]: v for k, v in sorted(hour.items()) if k.startswith("f:")},
    }


def _priorities(waiting: Iterable[Waiting]) -> dict[str, int]:
    found = {"high": 0, "normal": 0, "low": 0}
    for row in waiting:
        found["high"] += row.high
        found["normal"] += row.normal
        found["low"] += row.low
    return found


def _oldest_age(shard: Shard, slow: Slow, now: float) -> float | None:
    """Seconds the shard's oldest waiting job has waited (tenants' queues or the stream)."""
    times = [w.oldest_ms for w in slow.waiting.get(shard.index, {}).values() if w.oldest_ms]
    if shard.oldest_undelivered_ms is not None:
        times.append(shard.oldest_undelivered_ms)
    return max(now - min(times) / 1000, 0.0) if times else None


def _shard_row(shard: Shard, slow: Slow, now: float) -> dict[str, Any]:
    return {
        "shard": shard.index,
        "key": shard.key,
        "waiting": shard.waiting + shard.undelivered,
        "by_priority": _priorities(slow.waiting.get(shard.index, {}).values()),
        "in_stream": shard.undelivered,
        "running": shard.pending,
        "tenants_waiting": len(shard.tenants),
        "oldest_waiting_seconds": _oldest_age(shard, slow, now),
    }


def tenant_rows(fleet: Fleet, slow: Slow) -> list[dict[str, Any]]:
    """Every tenant with jobs waiting, running or dead (or that ended jobs in the last
    hour), the busiest first."""
    hour = per_name(last_hour(slow, int(fleet.now // 60)), "t")
    names = {*slow.dead_tenants, *hour}
    for shard in fleet.shards:
        names.update(shard.tenants, shard.running, shard.dispatched)
    rows = [_tenant_row(name, fleet, slow, hour.get(name)) for name in names]
    rows.sort(key=lambda row: (-(row["waiting"] + row["running"]), -row["dead"], row["name"]))
    return rows


def _tenant_row(name: str, fleet: Fleet, slow: Slow, hour: dict[str, int] | None) -> dict[str, Any]:
    parts = [slow.waiting.get(shard.index, {}).get(name) for shard in fleet.shards]
    oldest = [part.oldest_ms for part in parts if part is not None and part.oldest_ms]
    return {
        "name": name,
        "waiting": sum(s.tenants.get(name, 0) + s.dispatched.get(name, 0) for s in fleet.shards),
        "by_priority": _priorities(part for part in parts if part is not None),
        "running": sum(shard.running.get(name, 0) for shard in fleet.shards),
        "dead": slow.dead_tenants.get(name, 0),
        "oldest_waiting_seconds": max(fleet.now - min(oldest) / 1000, 0.0) if oldest else None,
        "last_hour": hour or {"n": 0, "f": 0, "tok": 0},
    }


def upstream_rows(
    fleet: Fleet, use: Mapping[tuple[int, str], Use], hour: Mapping[str, dict[str, int]]
) -> list[dict[str, Any]]:
    """One row per upstream the workers serve, limit, queue or run jobs for, or find down."""
    names = {*hour}
    for shard in fleet.shards:
        names.update(shard.served(), shard.limits(), shard.upstreams, shard.running_upstreams)
        names.update(shard.paused)
    for report in fleet.reports.values():
        down = report.get("down")
        names.update(down if isinstance(down, dict) else ())
    served = {name for shard in fleet.shards for name in shard.served()}
    return [
        _upstream_row(name, name in served, fleet, use, hour.get(name)) for name in sorted(names)
    ]


def _upstream_row(
    name: str,
    served: bool,
    fleet: Fleet,
    use: Mapping[tuple[int, str], Use],
    hour: dict[str, int] | None,
) -> dict[str, Any]:
    shards = fleet.shards
    paused = [shard.paused[name] for shard in shards if name in shard.paused]
    return {
        "kind": "upstream",
        "name": name,
        "target": name,
        "served": served,
        "limits": _fleet_limits(name, shards),
        "use": _fleet_use(name, shards, use),
        "waiting": sum(shard.upstreams.get(name, 0) for shard in shards),
        "running": sum(shard.running_upstreams.get(name, 0) for shard in shards),
        "paused_since": min(paused) if paused else None,
        "paused_shards": len(paused),
        "cooling_ms": max((u.cooling_ms for u in _uses(name, shards, use)), default=0),
        "down": _down(name, fleet),
        "last_hour": hour or {"n": 0, "f": 0, "tok": 0},
    }


def route_rows(
    fleet: Fleet,
    targets: Mapping[tuple[str, str], TargetHealth],
    hour: Mapping[str, dict[str, int]],
) -> list[dict[str, Any]]:
    """A row per route the workers publish, then one per target of it: the breaker's state
    (down since when and why, a probe trying it), the jobs waiting for the route and
    running on it, what ended and how many fallbacks were taken in the last hour."""
    shards = fleet.shards
    rows = []
    routes = shards[0].routes() if shards else {}
    for name, route in sorted(routes.items()):
        paused = [shard.paused[name] for shard in shards if name in shard.paused]
        listed = route_targets(route)
        states = [_target_row(name, t, targets, fleet.now, i) for i, t in enumerate(listed)]
        down = [row for row in states if row["down"] is not None]
        rows.append(
            {
                "kind": "route",
                "name": name,
                "target": route.get("s", "fallback"),
                "served": True,
                "limits": dict.fromkeys(LIMIT_NAMES),
                "use": {"permits": 0, "requests_last_minute": 0, "tokens_last_minute": 0},
                "waiting": sum(shard.upstreams.get(name, 0) for shard in shards),
                "running": sum(shard.running_routes.get(name, 0) for shard in shards),
                "paused_since": min(paused) if paused else None,
                "paused_shards": len(paused),
                "cooling_ms": 0,
                "down": None,
                "targets_down": len(down),
                "targets": len(states),
                "last_hour": hour.get(name) or {"n": 0, "f": 0, "tok": 0, "fb": 0},
            }
        )
        rows += states
    return rows


def _target_row(
    route: str,
    target: list[Any],
    targets: Mapping[tuple[str, str], TargetHealth],
    now: float,
    index: int,
) -> dict[str, Any]:
    upstream, model = str(target[0]), str(target[1])
    health = targets.get((upstream, model), TargetHealth())
    down = None
    if health.skipped(now * 1000):
        since = (health.since or int(now * 1000)) / 1000
        down = {
            "since": since,
            "until": (health.down_until or 0) / 1000,
            "error": health.why,
            "probing": health.probing,
            "whole_upstream": health.whole_upstream,
            "workers": 0,
            "waiting": 0,
        }
    return {
        "kind": "target",
        "name": f"{route} → {upstream} / {model}",
        "route": route,
        "upstream": upstream,
        "model": model,
        "weight": target[2] if len(target) > 2 else 1,
        "index": index,
        "target": upstream,
        "served": True,
        "answered": health.answered,
        "down": down,
        "limits": dict.fromkeys(LIMIT_NAMES),
        "use": {"permits": 0, "requests_last_minute": 0, "tokens_last_minute": 0},
        "waiting": 0,
        "running": 0,
        "paused_since": None,
        "paused_shards": 0,
        "cooling_ms": 0,
        "last_hour": {"n": 0, "f": 0, "tok": 0},
    }


def _uses(name: str, shards: list[Shard], use: Mapping[tuple[int, str], Use]) -> list[Use]:
    return [use[(shard.index, name)] for shard in shards if (shard.index, name) in use]


LIMIT_NAMES = ("max_concurrent", "requests_per_minute", "tokens_per_minute")


def _fleet_limits(name: str, shards: list[Shard]) -> dict[str, int | None]:
    """The fleet's limits: the sum of the shards' shares (what the scheduler lets through;
    None: unlimited)."""
    shares = [shard.limits()[name] for shard in shards if name in shard.limits()]
    found: dict[str, int | None] = {}
    for index, limit in enumerate(LIMIT_NAMES):
        values = [share[index] for share in shares]
        found[limit] = None if not values or None in values else sum(v or 0 for v in values)
    return found


def _fleet_use(
    name: str, shards: list[Shard], use: Mapping[tuple[int, str], Use]
) -> dict[str, int]:
    uses = _uses(name, shards, use)
    return {
        "permits": sum(u.permits for u in uses),
        "requests_last_minute": sum(u.requests for u in uses),
        "tokens_last_minute": sum(u.tokens for u in uses),
    }


def _down(name: str, fleet: Fleet) -> dict[str, Any] | None:
    """What the workers that find ``name`` down report: how many, since when (the earliest,
    Redis time), the latest error, the jobs waiting for it."""
    reports = []
    for worker, report in fleet.reports.items():
        down = (report.get("down") or {}).get(name)
        beat = fleet.heartbeats.get(worker)
        if isinstance(down, dict) and beat is not None and fleet.now - beat <= LATE:
            reports.append((beat - float(down.get("for") or 0), down, beat))
    if not reports:
        return None
    latest = max(reports, key=lambda report: report[2])[1]
    return {
        "workers": len(reports),
        "since": min(report[0] for report in reports),
        "error": str(latest.get("error") or ""),
        "waiting": sum(int(report[1].get("waiting") or 0) for report in reports),
    }


def worker_rows(fleet: Fleet, timeout: float) -> list[dict[str, Any]]:
    """Every worker in the heartbeat set: alive (beat within ``timeout``), late, or gone
    (its entries are taken over by the others), with what it last reported."""
    pending: dict[str, int] = {}
    for shard in fleet.shards:
        for name, count in shard.consumers.items():
            pending[name] = pending.get(name, 0) + count
    rows = []
    for name, beat in sorted(fleet.heartbeats.items()):
        age = max(fleet.now - beat, 0.0)
        report = fleet.reports.get(name, {})
        state = "alive" if age <= timeout else "late" if age <= LATE else "gone"
        rows.append({"name": name, "state": state, "beat_age": round(age, 1),
                     "pending": pending.get(name, 0), **_reported(report)})  # fmt: skip
    return rows


def _reported(report: dict[str, Any]) -> dict[str, Any]:
    """The report's fields the page shows (None: a worker of a version that reports none)."""
    names = ("version", "host", "pid", "started", "slots", "busy", "waiting", "processed")
    found: dict[str, Any] = {name: report.get(name) for name in names}
    found["stopping"] = bool(report.get("stopping"))
    down = report.get("down")
    found["down"] = sorted(down) if isinstance(down, dict) else []
    return found
