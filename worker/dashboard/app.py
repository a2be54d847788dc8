"""The dashboard's endpoints and ``create_app()``: a Starlette app that ``chatstream dashboard``
serves and that an application mounts in its own (docs/dashboard.md).

Reads need no key. Actions (POST) and job content need one of ``CHATSTREAM_DASHBOARD_KEYS``
in the ``X-Chatstream-Dashboard-Key`` header: a header, not a cookie, so another site's page
cannot make a browser act (no CSRF), and CORS is not offered.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from schemas.jobs import TERMINAL, JobStatus
from schemas.requests import JOB_ID_PATTERN
from worker import package_version
from worker.dashboard import jobs
from worker.dashboard.core import KEY_HEADER, Dashboard
from worker.dashboard.page import page_routes
from worker.errors import InvalidJobError, JobNotFoundError
from worker.gateway.auth import ApiKey
from worker.gateway.core import native_frames
from worker.gateway.cursors import BadCursor, resume_after
from worker.gateway.hub import JobFeed
from worker.gateway.streaming import EventStream
from worker.settings import Settings
from worker.store.activity import series
from worker.store.records import as_text
from worker.store.redis_client import RedisClient
from worker.urls import redacted_url

log = logging.getLogger("chatstream.dashboard")

_JOB_ID = re.compile(JOB_ID_PATTERN)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a tenant's
_UPSTREAM = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")  # an upstream's name, or a route's
STATUSES = frozenset(status.value for status in JobStatus)
TERMINAL_VALUES = frozenset(status.value for status in TERMINAL)
SEND_TIMEOUT = 60.0  # seconds a page may take no bytes before its stream is dropped


class DashboardError(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def dashboard_of(request: Request) -> Dashboard:
    dashboard: Dashboard = request.app.state.dashboard
    return dashboard


NO_STORE = {"cache-control": "no-store", "x-content-type-options": "nosniff"}


def json_response(request: Request, value: Any, status: int = 200) -> Response:
    body = dashboard_of(request).encode(value)
    return Response(body, status_code=status, media_type="application/json", headers=NO_STORE)


def operator_of(request: Request) -> ApiKey:
    """The operator's key, or 401 (none sent) / 403 (a wrong one, or none configured)."""
    dashboard = dashboard_of(request)
    if not request.headers.get(KEY_HEADER):
        raise DashboardError(401, f"this needs an operator key in {KEY_HEADER}", "missing_key")
    key = dashboard.operator(request)
    if key is None:
        raise DashboardError(403, "not an operator key", "invalid_key")
    return key


def job_id_of(request: Request) -> str:
    job_id: str = request.path_params["job_id"]
    if not _JOB_ID.match(job_id):
        raise DashboardError(404, f"no job {job_id!r}", "job_not_found")
    return job_id


def entry_id_of(text: str) -> str:
    try:
        return resume_after(text)
    except BadCursor as exc:
        raise DashboardError(400, str(exc), "invalid_cursor") from None


def _float(request: Request, name: str) -> float | None:
    value = request.query_params.get(name)
    if value in (None, ""):
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        raise DashboardError(400, f"{name} must be Unix seconds", "invalid_parameter")
    return seconds


def _int(request: Request, name: str, default: int, low: int, high: int) -> int:
    value = request.query_params.get(name) or str(default)
    if not (value.isascii() and value.isdigit()) or not low <= int(value) <= high:
        raise DashboardError(400, f"{name} must be from {low} to {high}", "invalid_parameter")
    return int(value)


def _filter(request: Request, name: str, allowed: frozenset[str] | None = None) -> str | None:
    value = request.query_params.get(name) or None
    pattern = _UPSTREAM if name == "upstream" else _NAME
    if value is not None and not (value in allowed if allowed else pattern.fullmatch(value)):
        raise DashboardError(400, f"no such {name}: {value!r}", "invalid_parameter")
    return value


# -- reads ------------------------------------------------------------------------------------


async def session(request: Request) -> Response:
    """Who is asking (an operator's name, or nobody: read-only) and what the page reads."""
    dashboard = dashboard_of(request)
    key = dashboard.operator(request)
    settings = dashboard.settings
    return json_response(request, {
        "operator": None if key is None else key.tenant_name,
        "key_sent": bool(request.headers.get(KEY_HEADER)),
        "keys_configured": bool(dashboard.operators.keys),
        "prefix": settings.prefix,
        "shards": settings.queue_shards,
        "redis": redacted_url(settings.redis_url),
        "version": package_version(),
    })  # fmt: skip


async def overview(request: Request) -> Response:
    body = await dashboard_of(request).live.current()
    return Response(body, media_type="application/json", headers=NO_STORE)


async def live(request: Request) -> EventStream:
    """The overview as Server-Sent Events, one per read of the loop (every page shares it)."""
    dashboard = dashboard_of(request)

    async def frames() -> Any:
        async with dashboard.live.listening() as listener:
            yield b"retry: 2000\n\n"
            while True:
                payload = await listener.take()
                yield b"event: overview\ndata: " + payload + b"\n\n"

    return EventStream(frames(), headers=NO_STORE, send_timeout=SEND_TIMEOUT, on_close=_closed)


async def _closed(client_gone: bool) -> None:
    """A page's stream ended: nothing to release (a page holds no slot, cancels nothing)."""


async def tenants(request: Request) -> Response:
    query = (request.query_params.get("q") or "").lower()
    rows = [row for row in await dashboard_of(request).tenants() if query in row["name"].lower()]
    return json_response(request, {"tenants": rows[:1000], "matched": len(rows)})


async def activity(request: Request) -> Response:
    """The charts' series over the last ``minutes`` (60 to a day), in 60 points."""
    dashboard = dashboard_of(request)
    minutes = _int(request, "minutes", 60, 60, 1440)
    step = -(-minutes // 60)
    counts = await dashboard.minutes(step * 60)
    now_minute = max(counts, default=0)
    start = now_minute - step * 60 + 1
    return json_response(request, series(counts, start, 60, step).to_json())


async def list_jobs(request: Request) -> Response:
    dashboard = dashboard_of(request)
    page = await dashboard.client.index.page(
        status=_filter(request, "status", STATUSES),
        tenant=_filter(request, "tenant"),
        upstream=_filter(request, "upstream"),
        since=_float(request, "since"),
        before=_float(request, "before"),
        limit=_int(request, "limit", 50, 1, 500),
    )
    return json_response(request, jobs.list_jobs(page, dashboard.operator(request) is not None))


async def get_job(request: Request) -> Response:
    dashboard = dashboard_of(request)
    job_id = job_id_of(request)
    raw = await dashboard.client.records.fetch(job_id)
    if not raw:
        raise DashboardError(
            404, f"no job {job_id!r} (never enqueued, or expired)", "job_not_found"
        )
    with_content = dashboard.operator(request) is not None
    found = await jobs.attempts(dashboard.redis, dashboard.keys, job_id)
    view = {"id": job_id, "record": jobs.record_view(raw, with_content), **found}
    return json_response(request, view | {"content_shown": with_content})


async def job_events(request: Request) -> EventStream:
    """The job's events (chatstream's own format) from ``after``: replayed, then live until
    its end. Job content, so only with a key; the page reads it with ``fetch``."""
    dashboard = dashboard_of(request)
    operator_of(request)
    job_id = job_id_of(request)
    after = entry_id_of(request.query_params.get("after") or "0-0")
    status = await dashboard.redis.hget(dashboard.keys.job(job_id), "status")
    if status is None:
        raise DashboardError(404, f"no job {job_id!r}", "job_not_found")
    feed = JobFeed(dashboard.hub, dashboard.keys, job_id, after=after,
                   ended=as_text(status) in TERMINAL_VALUES, idle_seconds=15.0)  # fmt: skip

    return EventStream(
        native_frames(feed.batches()),
        headers=NO_STORE | {"x-chatstream-job-id": job_id},
        send_timeout=SEND_TIMEOUT,
        on_close=_closed,
        behind=feed.behind,
    )


async def list_dead(request: Request) -> Response:
    dashboard = dashboard_of(request)
    before = request.query_params.get("before") or None
    if before is not None:
        before = entry_id_of(before)
    limit = _int(request, "limit", 50, 1, 500)
    with_content = dashboard.operator(request) is not None
    found = await jobs.dead_letters(dashboard.redis, dashboard.keys, before, limit, with_content)
    return json_response(request, found)


# -- actions (an operator's key) -------------------------------------------------------------


async def cancel_job(request: Request) -> Response:
    key = operator_of(request)
    job_id = job_id_of(request)
    state = await dashboard_of(request).client.cancel(job_id)
    log.warning("dashboard: %s cancelled job %s (%s)", key.tenant_name, job_id, state)
    return json_response(request, {"id": job_id, "status": str(state)})


async def requeue_job(request: Request) -> Response:
    key = operator_of(request)
    job_id = job_id_of(request)
    dashboard = dashboard_of(request)
    try:
        state = await dashboard.client.requeue(job_id)
    except InvalidJobError as exc:
        raise DashboardError(409, exc.message, "not_failed") from None
    dashboard.dead_changed()
    log.warning("dashboard: %s requeued job %s", key.tenant_name, job_id)
    return json_response(request, {"id": job_id, "status": state})


async def delete_dead_letter(request: Request) -> Response:
    key = operator_of(request)
    entry = entry_id_of(request.path_params["entry"])
    dashboard = dashboard_of(request)
    if not int(await dashboard.redis.xdel(dashboard.keys.dead, entry)):
        raise DashboardError(404, f"no dead letter {entry}", "dead_letter_not_found")
    dashboard.dead_changed()
    log.warning("dashboard: %s deleted dead letter %s", key.tenant_name, entry)
    return json_response(request, {"entry": entry, "deleted": True})


async def pause_upstream(request: Request) -> Response:
    return await _pause(request, pause=True)


async def resume_upstream(request: Request) -> Response:
    return await _pause(request, pause=False)


async def _pause(request: Request, *, pause: bool) -> Response:
    """Pause or resume an upstream, or a route, for the whole fleet (every shard's
    scheduler)."""
    key = operator_of(request)
    name = request.path_params["name"]
    scheduler = dashboard_of(request).client.queue.scheduler
    known = _UPSTREAM.fullmatch(name) and (
        name in (await scheduler.served() or []) or (not pause and name in await scheduler.paused())
    )
    if not known:  # (a name the workers do not serve would be held in Redis for nothing)
        raise DashboardError(404, f"no upstream or route {name!r}", "upstream_not_found")
    changed = await (scheduler.pause(name) if pause else scheduler.resume(name))
    verb = "paused" if pause else "resumed"
    if changed:
        log.warning("dashboard: %s %s upstream %r for the fleet", key.tenant_name, verb, name)
    return json_response(request, {"upstream": name, "paused": pause, "changed": changed})


async def healthz(request: Request) -> Response:
    dashboard = dashboard_of(request)
    counts = {"pages": len(dashboard.live.listeners), "reads": dashboard.live.reads}
    try:
        await dashboard.redis.ping()
    except RedisError:
        return json_response(request, {"status": "redis unreachable", **counts}, 503)
    return json_response(request, {"status": "ok", **counts})


# -- errors and the app -----------------------------------------------------------------------


def _error(request: Request, status: int, message: str, code: str | None) -> Response:
    return json_response(request, {"error": {"message": message, "code": code}}, status)


async def on_dashboard_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, DashboardError)
    return _error(request, exc.status, exc.message, exc.code)


async def on_not_found(request: Request, exc: Exception) -> Response:
    return _error(request, 404, str(exc), "job_not_found")


async def on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed"}
    return _error(request, exc.status_code, message.get(exc.status_code, str(exc.detail)), None)


async def on_redis_error(request: Request, exc: Exception) -> Response:
    log.warning("dashboard: Redis error: %s", exc)
    return _error(request, 503, "Redis is unavailable; retry shortly", "unavailable")


async def on_unexpected(request: Request, exc: Exception) -> Response:
    log.error("dashboard: unexpected error on %s %s", request.method, request.url.path,
              exc_info=exc)  # fmt: skip
    return _error(request, 500, "internal error", None)


ROUTES = [
    Route("/healthz", healthz, methods=["GET"]),
    Route("/api/session", session, methods=["GET"]),
    Route("/api/overview", overview, methods=["GET"]),
    Route("/api/live", live, methods=["GET"]),
    Route("/api/tenants", tenants, methods=["GET"]),
    Route("/api/activity", activity, methods=["GET"]),
    Route("/api/jobs", list_jobs, methods=["GET"]),
    Route("/api/jobs/{job_id}", get_job, methods=["GET"]),
    Route("/api/jobs/{job_id}/events", job_events, methods=["GET"]),
    Route("/api/jobs/{job_id}/cancel", cancel_job, methods=["POST"]),
    Route("/api/jobs/{job_id}/requeue", requeue_job, methods=["POST"]),
    Route("/api/dead", list_dead, methods=["GET"]),
    Route("/api/dead/{entry}/delete", delete_dead_letter, methods=["POST"]),
    Route("/api/upstreams/{name:path}/pause", pause_upstream, methods=["POST"]),
    Route("/api/upstreams/{name:path}/resume", resume_upstream, methods=["POST"]),
]


def create_app(settings: Settings, redis: RedisClient | None = None) -> Starlette:
    """The dashboard of the fleet of ``settings`` (its Redis URL and prefix). ``redis``: a
    client to use (else one from the settings, closed with the app). Mounted in another app
    (``Mount("/ops", create_app(settings))``), it starts its read loop with the first page;
    call ``app.state.dashboard.aclose()`` from the host's lifespan to stop it."""
    dashboard = Dashboard(settings, redis)
    app = Starlette(
        routes=[*ROUTES, *page_routes()],
        exception_handlers={
            DashboardError: on_dashboard_error,
            JobNotFoundError: on_not_found,
            HTTPException: on_http_error,
            RedisError: on_redis_error,
            Exception: on_unexpected,
        },
        lifespan=dashboard.lifespan,
    )
    app.state.dashboard = dashboard
    return app
