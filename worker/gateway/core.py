"""The HTTP gateway: OpenAI-compatible requests in, resumable token streams out.

A Starlette app (docs/gateway.md documents every endpoint and header). It enqueues jobs with
the public ``Client`` and otherwise only reads Redis: job records with ``HMGET``, events
streams with ``XRANGE`` and, for everything live, the process's ``EventHub``. A slow or
vanished client therefore never blocks a worker or another client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from schemas.jobs import TERMINAL, JobRecord, JobStatus
from schemas.requests import JOB_ID_PATTERN, MAX_NESTING, ChatRequest, Priority, nesting_depth
from worker.aio import cancel_and_wait
from worker.client import Client
from worker.errors import (
    ChatstreamError,
    InvalidJobError,
    JobNotFoundError,
    NotReplicatedError,
    QueueFullError,
)
from worker.gateway import openai_format as fmt
from worker.gateway.auth import ApiKey, ApiKeys, bearer
from worker.gateway.connections import Connections
from worker.gateway.cursors import BadCursor, resume_after
from worker.gateway.hub import JobFeed, Row, event_hub, is_terminal
from worker.gateway.limits import RateLimiter, Slot, StreamSlots
from worker.gateway.streaming import EventStream, client_gone
from worker.settings import Settings
from worker.store.redis_client import RedisClient, redis_from_settings

log = logging.getLogger("chatstream.gateway")

_JOB_ID = re.compile(JOB_ID_PATTERN)
IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,255}")
# EventSource reconnects after this many ms. It rides on the first event: the openai SDK
# dispatches an event for a lone "retry:" line, with empty data it cannot parse.
RETRY_LINE = b"retry: 1000\n"
TRUE = frozenset({"1", "true", "yes"})
CANCEL_HEADER = "x-chatstream-cancel-on-disconnect"
PRIORITY_HEADER = "x-chatstream-priority"
SERVED_HEADER = "x-chatstream-served-by"
QUEUE_FULL_RETRY_AFTER = 5  # seconds: a full tenant queue drains at the fleet's pace
TERMINAL_VALUES = frozenset(status.value for status in TERMINAL)


class GatewayError(Exception):
    """Answered as OpenAI's error JSON with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.headers = headers or {}


def error_response(
    status: int,
    message: str,
    type_: str,
    code: str | None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def not_found(job_id: str) -> GatewayError:
    return GatewayError(404, f"no job {job_id!r}", code="job_not_found")


@dataclass(frozen=True)
class JobInfo:
    """What the gateway keeps of a job: its status and the metadata it wrote at creation."""

    job_id: str
    status: str
    owner: str
    model: str
    include_usage: bool
    created: int
    request_sha256: str

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_VALUES

    def context(self, include_usage: bool | None = None) -> fmt.ChunkContext:
        usage = self.include_usage if include_usage is None else include_usage
        return fmt.ChunkContext(self.job_id, self.created, self.model, usage)


class Gateway:
    """The app's state: settings, keys, Redis, the client, the hub and the limits."""

    def __init__(self, settings: Settings, redis: RedisClient | None = None) -> None:
        self.settings = settings
        self.api_keys = ApiKeys.from_setting(settings.gateway_api_keys)
        self.owns_redis = redis is None
        self.redis = redis if redis is not None else redis_from_settings(settings)
        self.client = Client.from_settings(settings, self.redis)
        self.keys = self.client.keys
        self.hub = event_hub(self.redis, self.keys, max_bytes=settings.gateway_client_buffer_bytes)
        self.connections = Connections()  # filled by the server's protocol (server.py)
        self.slots = StreamSlots(
            settings.gateway_max_streams_per_key, settings.gateway_max_connections
        )
        self.rate = RateLimiter(self.redis, self.keys, settings.gateway_jobs_per_minute)

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # What is alive after start-up lives as long as the process: out of the collector's
        # sight, full collections stay short (they stalled every stream for 80-90 ms with
        # hundreds of clients; the worker does the same, docs/decisions.md 15).
        gc.collect()
        gc.freeze()
        task = asyncio.create_task(self.hub.run(), name="chatstream-gateway-hub")
        try:
            yield
        finally:
            await cancel_and_wait([task])
            await self.hub.close()
            if self.owns_redis:
                await self.redis.aclose()

    # -- who is asking ----------------------------------------------------------------------

    def authenticate(self, request: Request) -> ApiKey:
        token = bearer(request.headers.get("authorization"))
        if not token:
            raise GatewayError(
                401,
                "missing API key: send Authorization: Bearer <key>",
                code="missing_api_key",
            )
        key = self.api_keys.check(token)
        if key is None:
            raise GatewayError(401, "invalid API key", code="invalid_api_key")
        return key

    async def job_info(self, job_id: str) -> JobInfo | None:
        if not _JOB_ID.fullmatch(job_id):
            return None
        reply: Any = await self.redis.hmget(self.keys.job(job_id), ["status", "metadata"])
        status, metadata = reply
        if status is None:
            return None
        meta = fmt.json_object(metadata)
        return JobInfo(
            job_id=job_id,
            status=status,
            owner=str(meta.get("owner", "")),
            model=str(meta.get("model", "")),
            include_usage=bool(meta.get("include_usage")),
            created=int(meta.get("created") or 0),
            request_sha256=str(meta.get("request_sha256", "")),
        )

    async def owned_job(self, job_id: str, key: ApiKey) -> JobInfo:
        """The job when ``key`` created it; 404 alike for another key's job and none."""
        info = await self.job_info(job_id)
        if info is None or info.owner != key.id:
            raise not_found(job_id)
        return info

    async def events_access(self, request: Request, job_id: str) -> tuple[JobInfo, ApiKey]:
        """A bearer key that owns the job, or (for browsers) the job's events token."""
        token = request.query_params.get("token")
        if token is None or "authorization" in request.headers:
            key = self.authenticate(request)
            return await self.owned_job(job_id, key), key
        info = await self.job_info(job_id)
        found = self.api_keys.check_token(info.owner, job_id, token) if info else None
        if info is None or found is None:
            raise GatewayError(401, "invalid events token for this job", code="invalid_token")
        return info, found

    # -- creating jobs ----------------------------------------------------------------------

    async def submit(
        self,
        key: ApiKey,
        body: dict[str, Any],
        idempotency_key: str | None,
        priority: Priority = "normal",
    ) -> JobInfo:
        """Enqueue the request as a job of ``key`` (or find the one the key already made)."""
        _check_chat_request(body)  # before it spends a job of the key's rate
        sha = _request_sha256(body)
        job_id = None
        if idempotency_key is not None:
            job_id = _idempotent_job_id(key, idempotency_key)
            existing = await self.job_info(job_id)
            if existing is not None:
                if existing.request_sha256 != sha:
                    raise GatewayError(
                        400,
                        "this Idempotency-Key was used for a different request",
                        code="idempotency_key_reused",
                    )
                return existing
        await self.rate.take(key.id)
        info = JobInfo(
            job_id="",
            status=JobStatus.QUEUED.value,
            owner=key.id,
            model=str(body.get("model", "")),
            include_usage=include_usage(body),
            created=int(time.time()),
            request_sha256=sha,
        )
        metadata = {
            "owner": info.owner,
            "model": info.model,
            "include_usage": info.include_usage,
            "created": info.created,
            "request_sha256": sha,
        }
        try:
            job_id = await self.client.enqueue(
                body, job_id=job_id, metadata=metadata, tenant=key.tenant_name, priority=priority
            )
        except InvalidJobError as exc:
            raise GatewayError(400, exc.message, code="invalid_request") from None
        except QueueFullError as exc:
            raise GatewayError(
                429,
                exc.message,
                type_="rate_limit_error",
                code="queue_full",
                headers={"retry-after": str(QUEUE_FULL_RETRY_AFTER)},
            ) from None
        except NotReplicatedError as exc:  # queued on the master: a retry waits again
            headers = {"retry-after": "1"}
            raise GatewayError(
                503, exc.message, type_="server_error", code="not_replicated", headers=headers
            ) from None
        return dataclasses.replace(info, job_id=job_id)

    # -- answering --------------------------------------------------------------------------

    async def stream_reply(
        self,
        info: JobInfo,
        ctx: fmt.ChunkContext,
        headers: dict[str, str],
        slot: Slot,
        *,
        cancel: bool = False,
    ) -> Response | EventStream:
        """An SSE response once the first entry came (or a keep-alive is due). A job that
        failed before any output is answered with an HTTP error, as OpenAI does. The
        response releases ``slot`` when it ends."""
        feed = JobFeed(
            self.hub, self.keys, info.job_id, idle_seconds=self.settings.gateway_keepalive_seconds
        )
        batches = feed.batches()
        first = await anext(batches)
        if failed_before_output(first):
            await batches.aclose()
            slot.release()
            last = first[-1][1]
            return job_error_response(json.loads(last.get("data") or "{}"), last["type"], headers)
        frames = openai_frames(ctx, batches, first=first)
        return self.event_stream(frames, info, headers, slot, cancel=cancel, feed=feed)

    def event_stream(
        self,
        frames: AsyncGenerator[bytes, None],
        info: JobInfo,
        headers: dict[str, str],
        slot: Slot,
        *,
        cancel: bool = False,
        feed: JobFeed | None = None,
    ) -> EventStream:
        """The SSE response of ``frames``; ``feed``: the live feed they come from (its client
        is dropped when it falls behind)."""

        async def close(client_gone: bool) -> None:
            slot.release()
            if client_gone and cancel:
                await self.cancel_quietly(info.job_id)

        return EventStream(
            frames,
            headers=headers,
            send_timeout=self.settings.gateway_send_timeout,
            on_close=close,
            abort=self.connections.abort,
            behind=None if feed is None else feed.behind,
        )

    async def cancel_quietly(self, job_id: str) -> None:
        try:
            await self.client.cancel(job_id)
            log.info("gateway: job %s cancelled: its client disconnected", job_id)
        except (ChatstreamError, RedisError) as exc:
            log.warning("gateway: cancelling job %s failed: %s", job_id, exc)

    async def wait_reply(
        self, request: Request, info: JobInfo, ctx: fmt.ChunkContext, headers: dict[str, str]
    ) -> Response:
        """The ``chat.completion`` once the job ends (or the error it ended with)."""
        if not await self.until_end(request, info.job_id):
            return Response(status_code=499)  # nobody is listening
        record = await self.client.get(info.job_id)
        headers = {**headers, **served_headers(record)}
        if record.status is JobStatus.SUCCEEDED:
            return JSONResponse(fmt.completion(ctx, record), headers=headers)
        kind = "cancelled" if record.status is JobStatus.CANCELLED else "error"
        return job_error_response({"error": record.error}, kind, headers)

    async def until_end(self, request: Request, job_id: str) -> bool:
        """True once the job's stream has its terminal entry; False when the client went
        away first (the job is then cancelled if the request asked for that)."""
        finished = asyncio.create_task(self.wait_terminal(job_id))
        gone = asyncio.create_task(client_gone(request.receive))
        try:
            await asyncio.wait((finished, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait([finished, gone])
        if not finished.done() or finished.cancelled():
            if cancel_on_disconnect(request):
                await self.cancel_quietly(job_id)
            return False
        finished.result()
        return True

    async def wait_terminal(self, job_id: str) -> None:
        """Returns once the job's stream has its terminal entry."""
        key = self.keys.events(job_id)
        last: Any = await self.redis.xrevrange(key, count=1)
        if last and is_terminal(last[0]):
            return
        after = last[0][0] if last else "0-0"
        feed = JobFeed(
            self.hub, self.keys, job_id, after=after, idle_seconds=60, drop_when_behind=False
        )
        async for rows in feed.batches():
            if rows and is_terminal(rows[-1]):
                return


# -- frames ---------------------------------------------------------------------------------


async def openai_frames(
    ctx: fmt.ChunkContext,
    batches: AsyncGenerator[list[Row], None],
    *,
    first: list[Row] | None = None,
    done_if_empty: bool = False,
) -> AsyncGenerator[bytes, None]:
    """The job's entries as OpenAI chunks; a keep-alive comment for an idle period."""
    sent = False
    try:
        if first is not None:
            yield _openai_bytes(ctx, first, retry=True)
            sent = bool(first)
        async for rows in batches:
            yield _openai_bytes(ctx, rows, retry=not sent)
            sent = sent or bool(rows)
        if not sent and done_if_empty:
            yield fmt.DONE_FRAME  # resumed after the done entry: only the end marker is left
    except JobNotFoundError as exc:
        yield fmt.error_frame(ctx, "job_expired", exc.message)
    finally:
        await batches.aclose()


def _openai_bytes(ctx: fmt.ChunkContext, rows: list[Row], *, retry: bool) -> bytes:
    """The rows' frames (the first data-bearing one with ``retry:``); a keep-alive for []."""
    if not rows:
        return fmt.KEEPALIVE_FRAME
    frames = fmt.sse_frames(ctx, rows)
    return RETRY_LINE + frames if retry else frames


async def native_frames(batches: AsyncGenerator[list[Row], None]) -> AsyncGenerator[bytes, None]:
    """The job's entries as chatstream events (``?format=chatstream``)."""
    sent = False
    try:
        async for rows in batches:
            if not rows:
                yield fmt.KEEPALIVE_FRAME
                continue
            yield fmt.native_frames(rows) if sent else RETRY_LINE + fmt.native_frames(rows)
            sent = True
    except JobNotFoundError as exc:
        error = {"code": "job_expired", "message": exc.message}
        event = {"id": None, "type": "error", "attempt": 0, "data": {"error": error}}
        yield b"data: " + json.dumps(event).encode() + b"\n\n"
    finally:
        await batches.aclose()


# -- helpers --------------------------------------------------------------------------------


def job_headers(key: ApiKey, job_id: str) -> dict[str, str]:
    """The headers of a new job's reply: its id and the token its events URL carries."""
    return {"x-chatstream-job-id": job_id, "x-chatstream-events-token": key.events_token(job_id)}


def served_headers(record: JobRecord) -> dict[str, str]:
    """``x-chatstream-served-by``: the upstream (and model) of the attempt that ended the job,
    once it ran: on a route, the target that served it (docs/routing.md)."""
    if not record.served_upstream:
        return {}
    model = f"; model={quote(record.served_model)}" if record.served_model else ""
    return {SERVED_HEADER: f"{quote(record.served_upstream)}{model}"}


def include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def resume_cursor(request: Request) -> str:
    """Where a client resumes: ``Last-Event-ID`` (an EventSource reconnecting), else
    ``?after=``, else the beginning; a 400 before the response starts for an id Redis
    would refuse (worker/gateway/cursors.py)."""
    header = request.headers.get("last-event-id")
    value = header or request.query_params.get("after") or "0-0"
    try:
        return resume_after(value)
    except BadCursor as exc:
        name = "Last-Event-ID" if header else "after"
        raise GatewayError(
            400, f"{name} is not a valid cursor: {exc}", code="invalid_cursor"
        ) from None


def _check_chat_request(body: dict[str, Any]) -> None:
    if nesting_depth(body) > MAX_NESTING:
        raise GatewayError(
            400,
            f"invalid request: the body is nested more than {MAX_NESTING} levels deep",
            code="invalid_request",
        )
    try:
        ChatRequest.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        raise GatewayError(400, f"invalid request: {problems}", code="invalid_request") from None


def _request_sha256(body: dict[str, Any]) -> str:
    """The request without how it is delivered (``stream``, ``stream_options``)."""
    same_job = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    canonical = json.dumps(same_job, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _idempotent_job_id(key: ApiKey, idempotency_key: str) -> str:
    """The job id of a key's Idempotency-Key: another key's same header is another job."""
    return "idem-" + hashlib.sha256(f"{key.id}\n{idempotency_key}".encode()).hexdigest()[:40]


def cancel_on_disconnect(request: Request) -> bool:
    return request.headers.get(CANCEL_HEADER, "").lower() in TRUE


def failed_before_output(rows: list[Row]) -> bool:
    """The job ended with an error (or a cancel) before it sent any delta."""
    return (
        bool(rows)
        and rows[-1][1].get("type") in ("error", "cancelled")
        and all(row[1].get("type") in ("reset", "waiting") for row in rows[:-1])
    )


def job_error_response(data: dict[str, Any], kind: str, headers: dict[str, str]) -> Response:
    error = data.get("error") if kind == "error" else fmt.CANCELLED_ERROR
    error = error or {"code": "error", "message": "the job failed"}
    status, type_ = fmt.job_error_status(error)
    return error_response(
        status,
        str(error.get("message", "")),
        type_,
        error.get("code"),
        {**headers, "x-should-retry": "false"},
    )
