"""The Responses API on the gateway: responses created, streamed, retrieved and cancelled
as jobs (docs/gateway.md, "The Responses API").

The translation is pure: ``responses_request`` turns a request into a chat-completions job,
``responses_format`` folds the job's events stream into Responses events and objects. Here
is the I/O around them. A response is a job created by ``Gateway.submit`` (the chat
endpoint's keys, ownership, limits and ``Idempotency-Key``) whose record also holds the
field ``response``: the request's hash and what every Response object repeats of it,
written once right after the job is created. Every stream and every retrieved object is
folded from the job's events stream from its first entry, so any gateway process numbers
the events alike and ``starting_after`` resumes anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from schemas.requests import Priority
from worker.errors import JobNotFoundError
from worker.gateway.auth import ApiKey
from worker.gateway.core import (
    TRUE,
    Gateway,
    GatewayError,
    JobInfo,
    cancel_on_disconnect,
    failed_before_output,
    job_error_response,
    job_headers,
)
from worker.gateway.hub import JobFeed, Row
from worker.gateway.limits import Slot
from worker.gateway.openai_format import KEEPALIVE_FRAME, json_object
from worker.gateway.responses_format import (
    ResponseContext,
    ResponseEvents,
    job_id_of,
    sse_frames,
)
from worker.gateway.responses_request import RequestRefused, request_sha256, translate
from worker.gateway.streaming import EventStream

RESPONSE_FIELD = "response"  # the record's field: {"request_sha256", "echo"}
CANCEL_WAIT_SECONDS = 10.0  # how long a cancel waits for a running job's stream to end
FALSE = frozenset({"0", "false", "no"})
# a job not yet ended, by its record's status, as a Response's status
PENDING_STATUS = {"queued": "queued"}


@dataclass(frozen=True)
class ResponseJob:
    info: JobInfo
    ctx: ResponseContext


def response_not_found(response_id: str) -> GatewayError:
    return GatewayError(404, f"no response {response_id!r}", code="response_not_found")


# -- the endpoints --------------------------------------------------------------------------


async def create(
    gateway: Gateway,
    request: Request,
    key: ApiKey,
    body: dict[str, Any],
    idem: str | None,
    priority: Priority = "normal",
) -> Response | EventStream:
    """``POST /v1/responses``: a stream, the final object, or (background) the queued one."""
    try:
        wanted = translate(body)
    except RequestRefused as exc:
        raise GatewayError(400, exc.message, code="invalid_request") from None
    waits = wanted.stream or not wanted.background
    slot = gateway.slots.take(key.id) if waits else None  # before the job exists
    try:
        info = await gateway.submit(key, wanted.chat, idem, priority)
        job = ResponseJob(info, await _attach(gateway, info, body, wanted.echo))
        headers = job_headers(key, info.job_id)
        if slot is None:
            return JSONResponse(await snapshot(gateway, job), headers=headers)
        if not wanted.stream:
            return await _final(gateway, request, job, headers)
        reply = await _new_stream(gateway, request, job, headers, slot, wanted.background)
        if isinstance(reply, EventStream):
            slot = None  # the stream releases it when it ends
        return reply
    finally:
        if slot is not None:
            slot.release()


async def retrieve(
    gateway: Gateway, request: Request, key: ApiKey, response_id: str
) -> Response | EventStream:
    """``GET /v1/responses/{id}``: the object, or (``?stream=true``) its events after
    ``starting_after``, replayed then live."""
    job = await load(gateway, key, response_id)
    headers = {"x-chatstream-job-id": job.info.job_id}
    if not _stream_flag(request):
        return JSONResponse(await snapshot(gateway, job), headers=headers)
    after = _starting_after(request)
    slot = gateway.slots.take(key.id)
    feed = JobFeed(
        gateway.hub,
        gateway.keys,
        job.info.job_id,
        ended=job.info.terminal,
        idle_seconds=gateway.settings.gateway_keepalive_seconds,
    )
    frames = response_frames(job.ctx, feed.batches(), after=after)
    cancel = cancel_on_disconnect(request)
    return gateway.event_stream(frames, job.info, headers, slot, cancel=cancel, feed=feed)


async def cancel(gateway: Gateway, key: ApiKey, response_id: str) -> Response:
    """``POST /v1/responses/{id}/cancel``: the object once its stream ended (a running
    job's within ``CANCEL_WAIT_SECONDS``); 400 for a response that already ended."""
    job = await load(gateway, key, response_id)
    if job.info.terminal and job.info.status != "cancelled":
        raise GatewayError(
            400, f"response {response_id!r} already ended; it cannot be cancelled",
            code="response_ended",
        )  # fmt: skip
    try:
        state = await gateway.client.cancel(job.info.job_id)
    except JobNotFoundError:
        raise response_not_found(response_id) from None
    if state == "requested":
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CANCEL_WAIT_SECONDS):
                await gateway.wait_terminal(job.info.job_id)
    return JSONResponse(await snapshot(gateway, job))


# -- the job behind a response ----------------------------------------------------------------


async def load(gateway: Gateway, key: ApiKey, response_id: str) -> ResponseJob:
    """The response's job when ``key`` created it; 404 alike for another key's and none."""
    job_id = job_id_of(response_id)
    info = await gateway.job_info(job_id) if job_id else None
    if job_id is None or info is None or info.owner != key.id:
        raise response_not_found(response_id)
    raw: Any = await gateway.redis.hget(gateway.keys.job(job_id), RESPONSE_FIELD)
    if raw is None:  # a chat completion's job: not a response
        raise response_not_found(response_id)
    return ResponseJob(info, _context(info, json_object(raw)))


async def _attach(
    gateway: Gateway, info: JobInfo, body: dict[str, Any], echo: dict[str, Any]
) -> ResponseContext:
    """Writes the response's field on the new job (once: a job found again by its
    Idempotency-Key keeps the first one, and must be for the same request)."""
    sha = request_sha256(body)
    value = json.dumps({"request_sha256": sha, "echo": echo}, separators=(",", ":"))
    kept = await gateway.client.records.set_once(info.job_id, RESPONSE_FIELD, value)
    stored = json_object(kept)
    if kept is not None and stored.get("request_sha256") != sha:
        raise GatewayError(
            400, "this Idempotency-Key was used for a different request",
            code="idempotency_key_reused",
        )  # fmt: skip
    return _context(info, stored or {"echo": echo})


def _context(info: JobInfo, stored: dict[str, Any]) -> ResponseContext:
    echo = stored.get("echo")
    return ResponseContext(info.job_id, info.created, echo if isinstance(echo, dict) else {})


async def fold_history(gateway: Gateway, job: ResponseJob) -> ResponseEvents:
    """The job's stream so far, folded (read with XRANGE, never followed live)."""
    fold = ResponseEvents(job.ctx)
    feed = JobFeed(gateway.hub, gateway.keys, job.info.job_id, ended=True)
    async for rows in feed.batches():
        for entry_id, fields in rows:
            fold.feed(entry_id, fields)
    return fold


async def snapshot(gateway: Gateway, job: ResponseJob) -> dict[str, Any]:
    """The Response object now: ``queued`` / ``in_progress`` (by the record) until the job
    ended, with the output so far."""
    fold = await fold_history(gateway, job)
    return fold.response(PENDING_STATUS.get(job.info.status, "in_progress"))


# -- answers ------------------------------------------------------------------------------------


async def _final(
    gateway: Gateway, request: Request, job: ResponseJob, headers: dict[str, str]
) -> Response:
    """The Response once the job ended; a failed job's error over HTTP, as the chat
    endpoint answers it."""
    if not await gateway.until_end(request, job.info.job_id):
        return Response(status_code=499)  # nobody is listening
    fold = await fold_history(gateway, job)
    if fold.failure is not None:
        return job_error_response({"error": fold.failure}, "error", headers)
    return JSONResponse(fold.response(), headers=headers)


async def _new_stream(
    gateway: Gateway,
    request: Request,
    job: ResponseJob,
    headers: dict[str, str],
    slot: Slot,
    background: bool,
) -> Response | EventStream:
    """The new response's events. Unless it runs in the background, a job that failed
    before any output is answered with an HTTP error instead, as the chat endpoint does
    (the stream waits up to one keep-alive interval for the job's first entry to know)."""
    feed = JobFeed(
        gateway.hub,
        gateway.keys,
        job.info.job_id,
        idle_seconds=gateway.settings.gateway_keepalive_seconds,
    )
    batches = feed.batches()
    first = None
    if not background:
        first = await anext(batches)
        if failed_before_output(first) and first[-1][1].get("type") == "error":
            await batches.aclose()
            return job_error_response(json_object(first[-1][1].get("data")), "error", headers)
    frames = response_frames(job.ctx, batches, first=first)
    cancel = cancel_on_disconnect(request)
    return gateway.event_stream(frames, job.info, headers, slot, cancel=cancel, feed=feed)


async def response_frames(
    ctx: ResponseContext,
    batches: AsyncGenerator[list[Row], None],
    *,
    after: int = -1,
    first: list[Row] | None = None,
) -> AsyncGenerator[bytes, None]:
    """The job's entries as Responses events numbered above ``after``; a keep-alive
    comment for an idle period."""
    fold = ResponseEvents(ctx)
    try:
        if frame := sse_frames(fold.opening(), after):
            yield frame
        if first is not None and (frame := _frame(fold, first, after)):
            yield frame
        async for rows in batches:
            if frame := _frame(fold, rows, after):
                yield frame
    except JobNotFoundError as exc:
        yield sse_frames([fold.expired(exc.message)])
    finally:
        await batches.aclose()


def _frame(fold: ResponseEvents, rows: list[Row], after: int) -> bytes:
    if not rows:
        return KEEPALIVE_FRAME
    return sse_frames([event for row in rows for event in fold.feed(*row)], after)


def _stream_flag(request: Request) -> bool:
    value = request.query_params.get("stream", "false").lower()
    if value not in TRUE | FALSE:
        raise GatewayError(400, "stream must be true or false", code="invalid_request")
    return value in TRUE


def _starting_after(request: Request) -> int:
    value = request.query_params.get("starting_after")
    if value is None:
        return -1
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise GatewayError(
            400, "starting_after must be a sequence number (an integer from 0)",
            code="invalid_cursor",
        )  # fmt: skip
    return int(value)
