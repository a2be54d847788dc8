"""The gateway's endpoints and the Starlette app that routes to them (docs/gateway.md)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any, cast

from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from schemas.jobs import JobRecord, JobStatus
from schemas.requests import MAX_NESTING, PRIORITY_RANK, Priority, nesting_depth
from worker import telemetry
from worker.errors import JobNotFoundError
from worker.gateway import responses_api
from worker.gateway.core import (
    CANCEL_HEADER,
    IDEMPOTENCY_KEY,
    PRIORITY_HEADER,
    TRUE,
    Gateway,
    GatewayError,
    cancel_on_disconnect,
    error_response,
    include_usage,
    job_headers,
    native_frames,
    openai_frames,
    resume_cursor,
)
from worker.gateway.hub import JobFeed
from worker.gateway.limits import LimitExceeded
from worker.gateway.page import page_routes
from worker.gateway.streaming import EventStream
from worker.settings import Settings
from worker.store.redis_client import RedisClient

log = logging.getLogger("chatstream.gateway")


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object: 413 past ``limit`` bytes, 400 when not JSON or
    nested deeper than ``MAX_NESTING``."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(limit)
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large(limit)
        parts.append(part)
    try:
        body = json.loads(b"".join(parts))
    except (ValueError, RecursionError) as exc:
        raise GatewayError(
            400, f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object", code="invalid_request")
    if nesting_depth(body) > MAX_NESTING:  # more than a worker can run (decisions.md, 51)
        raise GatewayError(
            400,
            f"the request body is nested more than {MAX_NESTING} levels deep",
            code="invalid_request",
        )
    return body


def too_large(limit: int) -> GatewayError:
    return GatewayError(
        413, f"the request body is larger than the limit of {limit} bytes", code="request_too_large"
    )


# choices per request (n): OpenAI's own limit, so what OpenAI accepts the gateway accepts
MAX_CHOICES = 128


def check_request(body: dict[str, Any]) -> None:
    """What the gateway itself relies on; the rest is validated at enqueue."""
    if not isinstance(body.get("stream", False), bool):
        raise GatewayError(400, "stream must be true or false", code="invalid_request")
    n = body.get("n")
    if n is not None and (type(n) is not int or not 1 <= n <= MAX_CHOICES):
        raise GatewayError(
            400, f"n must be an integer from 1 to {MAX_CHOICES}", code="invalid_request"
        )
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise GatewayError(400, "stream_options must be an object", code="invalid_request")


def idempotency_key(request: Request) -> str | None:
    value = request.headers.get("idempotency-key")
    if value is not None and not IDEMPOTENCY_KEY.fullmatch(value):
        raise GatewayError(
            400,
            "Idempotency-Key must be 1 to 255 visible ASCII characters",
            code="invalid_idempotency_key",
        )
    return value


PRIORITIES = frozenset(PRIORITY_RANK)


def priority_of(request: Request) -> Priority:
    """``X-Chatstream-Priority: high | normal | low`` (default normal), or a 400."""
    value = request.headers.get(PRIORITY_HEADER, "normal").strip().lower()
    if value not in PRIORITIES:
        raise GatewayError(
            400, f"{PRIORITY_HEADER} must be high, normal or low", code="invalid_priority"
        )
    return cast("Priority", value)


# -- endpoints ------------------------------------------------------------------------------


async def chat_completions(request: Request) -> Response | EventStream:
    gateway = gateway_of(request)
    key = gateway.authenticate(request)
    body = await read_json(request, gateway.settings.gateway_max_body_bytes)
    check_request(body)
    respond_async = "respond-async" in request.headers.get("prefer", "").lower()
    slot = None if respond_async else gateway.slots.take(key.id)  # before the job exists
    try:
        info = await gateway.submit(key, body, idempotency_key(request), priority_of(request))
        headers = job_headers(key, info.job_id)
        if slot is None:
            return JSONResponse(
                accepted_job(info.job_id, headers), status_code=202, headers=headers
            )
        ctx = info.context(include_usage=include_usage(body))
        if not body.get("stream"):
            return await gateway.wait_reply(request, info, ctx, headers)
        cancel = cancel_on_disconnect(request)
        reply = await gateway.stream_reply(info, ctx, headers, slot, cancel=cancel)
        if isinstance(reply, EventStream):
            slot = None  # the stream releases it when it ends
        return reply
    finally:
        if slot is not None:
            slot.release()


def accepted_job(job_id: str, headers: dict[str, str]) -> dict[str, Any]:
    token = headers["x-chatstream-events-token"]
    return {
        "id": job_id,
        "object": "chatstream.job",
        "events_url": f"/v1/jobs/{job_id}/events?token={token}",
        "events_token": token,
    }


async def job_events(request: Request) -> EventStream:
    gateway = gateway_of(request)
    job_id = request.path_params["job_id"]
    info, key = await gateway.events_access(request, job_id)
    after = resume_cursor(request)
    native = _format(request) == "chatstream"
    cancel = request.query_params.get("cancel_on_disconnect", "").lower() in TRUE
    slot = gateway.slots.take(key.id)
    feed = JobFeed(
        gateway.hub,
        gateway.keys,
        job_id,
        after=after,
        ended=info.terminal,
        idle_seconds=gateway.settings.gateway_keepalive_seconds,
    )
    if native:
        frames = native_frames(feed.batches())
    else:
        done = info.status == JobStatus.SUCCEEDED.value
        ctx = replace(info.context(), progress_events=_progress_events(request))
        frames = openai_frames(ctx, feed.batches(), done_if_empty=done)
    headers = {"x-chatstream-job-id": job_id}
    return gateway.event_stream(frames, info, headers, slot, cancel=cancel, feed=feed)


def _format(request: Request) -> str:
    value = request.query_params.get("format", "openai")
    if value not in ("openai", "chatstream"):
        raise GatewayError(400, "format must be openai or chatstream", code="invalid_format")
    return value


def _progress_events(request: Request) -> bool:
    """``?progress=events``: waiting entries as named SSE events (an EventSource listens for
    them) instead of comments (which OpenAI SDKs skip)."""
    value = request.query_params.get("progress", "comments")
    if value not in ("comments", "events"):
        raise GatewayError(400, "progress must be comments or events", code="invalid_progress")
    return value == "events"


async def owned(request: Request) -> tuple[Gateway, str]:
    """The gateway and the path's job id, once the caller's key is known to own the job."""
    gateway = gateway_of(request)
    key = gateway.authenticate(request)
    job_id: str = request.path_params["job_id"]
    await gateway.owned_job(job_id, key)
    return gateway, job_id


async def get_job(request: Request) -> Response:
    gateway, job_id = await owned(request)
    record = await gateway.client.get(job_id)
    return JSONResponse(record.model_dump(mode="json", include=set(JobRecord.model_fields)))


async def cancel_job(request: Request) -> Response:
    gateway, job_id = await owned(request)
    state = await gateway.client.cancel(job_id)
    return JSONResponse({"id": job_id, "status": str(state)})


async def create_response(request: Request) -> Response | EventStream:
    gateway = gateway_of(request)
    key = gateway.authenticate(request)
    body = await read_json(request, gateway.settings.gateway_max_body_bytes)
    return await responses_api.create(
        gateway, request, key, body, idempotency_key(request), priority_of(request)
    )


async def retrieve_response(request: Request) -> Response | EventStream:
    gateway = gateway_of(request)
    key = gateway.authenticate(request)
    return await responses_api.retrieve(gateway, request, key, request.path_params["response_id"])


async def cancel_response(request: Request) -> Response:
    gateway = gateway_of(request)
    key = gateway.authenticate(request)
    return await responses_api.cancel(gateway, key, request.path_params["response_id"])


async def healthz(request: Request) -> Response:
    """Redis reachable (else 503), with the process's open streams and followed jobs."""
    gateway = gateway_of(request)
    counts = {
        "open_streams": gateway.slots.open_total,
        "followed_jobs": gateway.hub.followed,
        "connections": len(gateway.connections),
        "heads_timed_out": gateway.connections.heads_timed_out,
    }
    try:
        await gateway.redis.ping()
    except RedisError:
        return JSONResponse({"status": "redis unreachable", **counts}, status_code=503)
    return JSONResponse({"status": "ok", **counts})


# -- errors ---------------------------------------------------------------------------------


async def on_gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return error_response(exc.status, exc.message, exc.type, exc.code, exc.headers)


async def on_limit(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LimitExceeded)
    type_ = "rate_limit_error" if exc.status == 429 else "server_error"
    headers = {"retry-after": str(exc.retry_after)}
    return error_response(exc.status, exc.message, type_, exc.code, headers)


async def on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed"}
    text = message.get(exc.status_code, str(exc.detail))
    return error_response(exc.status_code, text, "invalid_request_error", None, exc.headers)


async def on_job_not_found(request: Request, exc: Exception) -> Response:
    job_id = request.path_params.get("job_id", "")
    return error_response(404, f"no job {job_id!r}", "invalid_request_error", "job_not_found")


async def on_redis_error(request: Request, exc: Exception) -> Response:
    log.warning("gateway: Redis error: %s", exc)
    headers = {"retry-after": "1"}
    return error_response(
        503, "Redis is unavailable; retry shortly", "server_error", "unavailable", headers
    )


async def on_unexpected(request: Request, exc: Exception) -> Response:
    log.error("gateway: unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal error", "server_error", None)


# -- the app --------------------------------------------------------------------------------

API_ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/jobs/{job_id}", get_job, methods=["GET"]),
    Route("/v1/jobs/{job_id}/events", job_events, methods=["GET"]),
    Route("/v1/jobs/{job_id}/cancel", cancel_job, methods=["POST"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
    Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
]
CORS_HEADERS = [
    "authorization",
    "content-type",
    "idempotency-key",
    "last-event-id",
    "prefer",
    CANCEL_HEADER,
    PRIORITY_HEADER,
    *telemetry.TRACE_FIELDS,  # a page's own OpenTelemetry sends traceparent (docs/gateway.md)
]
EXPOSED_HEADERS = [
    "x-chatstream-job-id",
    "x-chatstream-events-token",
    "x-chatstream-served-by",
    "retry-after",
]


def create_app(settings: Settings, redis: RedisClient | None = None) -> Starlette:
    """The gateway app; raises ConfigError without API keys. ``redis``: a client to use
    (else one from the settings, closed with the app)."""
    gateway = Gateway(settings, redis)
    middleware = []
    if settings.gateway_cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=settings.gateway_cors_origins,
                allow_methods=["GET", "POST"],
                allow_headers=CORS_HEADERS,
                expose_headers=EXPOSED_HEADERS,
            )
        )
    routes = [*API_ROUTES, *page_routes()]
    if telemetry.tracing_on():  # each request in a span, a child of its traceparent
        from worker.gateway.tracing import TraceRequests

        middleware.insert(0, Middleware(TraceRequests, routes=routes))
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={
            GatewayError: on_gateway_error,
            LimitExceeded: on_limit,
            HTTPException: on_http_error,
            JobNotFoundError: on_job_not_found,
            RedisError: on_redis_error,
            Exception: on_unexpected,
        },
        lifespan=gateway.lifespan,
    )
    app.state.gateway = gateway
    return app
