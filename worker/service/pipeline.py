"""One job's whole data flow, top to bottom.

request (record) ──▶ upstream SSE bytes ──▶ SSEDecoder ──▶ Accumulator ──▶ Publisher
                                                               │
                               final message / error ──▶ terminal write (record + event)

Only this module knows the whole chain. Retries: failures before the first byte are
retried inside ``UpstreamClient`` (while the upstream is down the job waits there without
its slot, until the upstream is back or the job's timeout); a retryable failure after it
(truncated stream, disconnect, idle timeout) is retried here when nothing was published yet,
or, with ``retry_after_output``, as a new attempt that starts with a ``reset`` event. An
attempt whose writes the fence refuses (a newer attempt owns the job, or the record is gone)
stops at the next upstream read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pydantic import ValidationError

from schemas.events import EventType
from schemas.jobs import EXTRAS, JSON_FIELDS, OUTPUT_FIELDS, JobStatus
from schemas.requests import ChatRequest
from worker import logs
from worker.errors import (
    ChatstreamError,
    InvalidJobError,
    MidStreamError,
    RetryableStreamError,
    StaleAttemptError,
    TruncatedStreamError,
    UpstreamError,
    UpstreamTimeoutError,
    retryable,
)
from worker.protocol.accumulator import Accumulator, FinalMessage
from worker.protocol.sse import SSEDecoder
from worker.service.limits import AttemptLimits, FleetLimits
from worker.service.metrics import JobTiming, Metrics
from worker.service.routing import RouteState, Routing
from worker.service.tracing import NoTracing
from worker.settings import Settings
from worker.store.publisher import JobStream, Publisher, Terminal
from worker.store.queue import Entry
from worker.store.records import Records, dumps
from worker.upstream.client import UpstreamClient
from worker.upstream.gate import IdleSlot, keep_slot
from worker.upstream.idle import ProgressDeadline
from worker.upstream.verdict import judge

log = logging.getLogger("chatstream.pipeline")
REDACTED = "[REDACTED]"  # a credential in what an upstream sent, as the record keeps it


class Retry(Enum):
    """What to do after a retryable failure of a try."""

    NO = "no"
    SAME_ATTEMPT = "same attempt"  # nothing was published: try the stream again
    NEW_ATTEMPT = "new attempt"  # output was published: a new attempt, announced by `reset`


class Outcome(Enum):
    FINISHED = "finished"  # terminal state written: ack the queue entry
    STALE = "stale"  # a newer attempt owns the job: leave the entry to it
    RELEASED = "released"  # given back to the queue (shutdown)


@dataclass(slots=True)
class Attempt:
    """A started attempt of a job, as the worker tracks it."""

    job_id: str
    attempt: int
    request: str
    upstream: str
    stream: JobStream
    cancel_requested: bool = False
    release_requested: bool = False
    timing: JobTiming = field(default_factory=JobTiming)
    opened: bool = False  # the current try got past the upstream's first byte
    acc: Accumulator | None = None  # the current try's output: kept when cancelled
    idle: IdleSlot = keep_slot  # entered while waiting for a down upstream (frees the slot)
    replicated: bool = True  # its terminal write reached the replicas it waits for
    limits: AttemptLimits | None = None  # its upstream's fleet-wide limits, if it has any
    entry: Entry | None = None  # the queue entry it runs under
    route: RouteState | None = None  # the route it uses, if any
    last_failure: UpstreamError | None = None  # the latest failure of its own tries
    content: bool = False  # the current attempt published more than the role
    model: str = ""  # the model its request names (a route's target may send another)
    tokens: int = 0  # its prompt and completion tokens, as the limits estimate them
    delivery: int = 1  # its queue entry's delivery count (more than 1: taken over)
    tenant: str = "default"

    def saw_failure(self, exc: UpstreamError) -> None:
        """One of its own tries failed (before the first byte, where the upstream client
        retries it): kept, so its error can say what the upstream last answered."""
        self.last_failure = exc


@dataclass(frozen=True, slots=True)
class Services:
    settings: Settings
    records: Records
    publisher: Publisher
    upstream: UpstreamClient
    worker_name: str
    metrics: Metrics = field(default_factory=Metrics)
    tracing: NoTracing = field(default_factory=NoTracing)  # the attempt's span, if traced
    routing: Routing | None = None  # the routes' side of a routed job (None: no routes)
    fleet_limits: FleetLimits | None = None  # the upstreams' fleet-wide limits


async def run_job(services: Services, job: Attempt) -> Outcome:
    """Run one attempt to its terminal write; never raises for anything the job did."""
    final: FinalMessage | None = None
    error: ChatstreamError | None = None
    try:
        body = load_request(job.request, services.settings.max_request_bytes)
        _know_request(services.settings, job, body)
        _join_route(services, job)
        services.tracing.requested(body)
        async with asyncio.timeout(services.settings.job_timeout):
            final, error = await stream_with_retries(services, job, body)
    except ChatstreamError as exc:
        error = exc
    except TimeoutError:
        error = _timed_out(services, job)
        final = job.acc.finish() if job.acc is not None else None  # the output so far
    except asyncio.CancelledError:
        if not (job.cancel_requested or job.release_requested):
            raise
        _uncancel()
        if job.release_requested:
            return Outcome.RELEASED
        partial = job.acc.finish() if job.acc is not None else None
        return await write_terminal(services, job, partial, None, cancelled=True)
    return await write_terminal(services, job, final, error)


def _timed_out(services: Services, job: Attempt) -> UpstreamTimeoutError:
    """The job timeout's error, naming what the job was waiting for, with the last answer
    its own tries got (status and the upstream's words), else its target's latest."""
    message = f"job exceeded {services.settings.job_timeout:g}s"
    own = job.last_failure
    if job.route is not None and job.route.waiting_since is not None:
        message += f" waiting for a target of route {job.route.name!r}"
    elif not job.opened:
        gate = services.upstream.down_gate(job.upstream, job.model)
        if gate is not None:
            message += f" waiting for {gate.label}, down"
            own = own or gate.last_failure
    if own is None:
        return UpstreamTimeoutError(message)
    message += f"; last answer: {own}"
    return UpstreamTimeoutError(message, status=own.status, detail=own.detail)


def _know_request(settings: Settings, job: Attempt, body: dict[str, Any]) -> None:
    """What the attempt needs of its request besides the body: its model, and its tokens as
    the limits estimate them (a route's target is admitted on them)."""
    model = body.get("model")
    job.model = model if isinstance(model, str) else ""
    max_tokens = next(
        (v for k in ("max_completion_tokens", "max_tokens") if _is_count(v := body.get(k))), None
    )
    completion = max_tokens if max_tokens is not None else settings.completion_tokens_estimate
    job.tokens = len(job.request) // 4 + completion


def _join_route(services: Services, job: Attempt) -> None:
    """A job of a route starts on the target the scheduler chose with its entry (with the
    permit it took), or finds one before its first try."""
    routing = services.routing
    name = routing.route_of(job.upstream, job.model) if routing is not None else None
    if routing is None or name is None:
        return
    if job.entry is None:
        raise InvalidJobError(f"route {name!r}: a routed job runs from a queue entry")
    target = routing.first_target(job.entry, name, job.delivery)
    job.route = RouteState(name, target)
    if target is not None and services.fleet_limits is not None:
        job.limits = services.fleet_limits.for_entry(job.entry, target.upstream, job.idle)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def load_request(raw: str, max_bytes: int) -> dict[str, Any]:
    """The upstream body from the stored request, or InvalidJobError saying what is wrong."""
    if len(raw.encode()) > max_bytes:
        raise InvalidJobError(f"request is larger than the limit of {max_bytes} bytes")
    try:
        return ChatRequest.model_validate_json(raw).upstream_body()
    except ValidationError as exc:
        raise InvalidJobError(f"invalid request: {_first_problem(exc)}") from None


async def stream_with_retries(
    services: Services, job: Attempt, body: dict[str, Any]
) -> tuple[FinalMessage, ChatstreamError | None]:
    """Stream the reply; retry retryable failures the policy allows (on a route: on the
    next target)."""
    tries = 0
    while True:
        acc = job.acc = Accumulator()
        job.opened = False
        try:
            sent = await _target_body(services, job, body)
            await stream_once(services, job, sent, acc)
            return acc.finish(), None
        except ChatstreamError as exc:
            tries += job.opened
            services.metrics.upstream_error(exc, job.upstream)
            if isinstance(exc, UpstreamError):
                job.last_failure = exc
            plan = retry_plan(services.settings, job, exc, tries)
            if plan is Retry.NO:
                return acc.finish(), exc
            failed_at = served(job)
            await _after_failure(services, job, exc)
            if plan is Retry.NEW_ATTEMPT and not await start_next_attempt(services, job, failed_at):
                return acc.finish(), exc
            services.metrics.pipeline_retry()
            services.tracing.retried("stream", exc)
            log.info("job %s attempt %d: retrying after %s", job.job_id, job.attempt, exc.code)


async def _target_body(services: Services, job: Attempt, body: dict[str, Any]) -> dict[str, Any]:
    """The body for the next try: a routed job's goes to its target (chosen now if it has
    none: waiting without its slot while no target can take it), with the target's model."""
    state, routing = job.route, services.routing
    if state is None or routing is None:
        return body
    target = state.target
    if target is None or routing.locally_down(target):
        target = await routing.next_target(job, job.tokens, context=state.on_context)
        state.target = target
        if services.fleet_limits is not None and job.entry is not None:
            job.limits = services.fleet_limits.for_entry(
                job.entry, target.upstream, job.idle, routed=True
            )
    job.upstream = target.upstream
    sent = {**body, "model": target.model}
    services.tracing.routed(state.name, target.upstream)
    services.tracing.requested(sent)
    return sent


async def _after_failure(services: Services, job: Attempt, exc: ChatstreamError) -> None:
    """What a failed try leaves for the next one: on a route, its target down for the fleet
    and another to find; else the target's gate told of an error chunk."""
    verdict = judge(exc)
    state, routing = job.route, services.routing
    if state is not None and routing is not None and state.target is not None:
        await routing.failed(job, state.target, exc, verdict)
        target = state.target
        services.metrics.route_fallback(state.name, target.upstream, target.model)
        state.target = None
        state.moves += 1
        state.on_context = verdict.context
    elif isinstance(exc, RetryableStreamError):
        services.upstream.report(job.upstream, job.model, exc)


async def stream_once(
    services: Services, job: Attempt, body: dict[str, Any], acc: Accumulator
) -> None:
    limit = services.settings.max_event_bytes
    decoder = SSEDecoder(limit)
    stream = services.upstream.stream(
        job.upstream,
        body,
        idle=job.idle,
        pacing=job.limits,
        single_try=job.route is not None,
        on_failure=job.saw_failure,
    )
    idle_timeout = services.settings.idle_timeout
    async with stream as reads:
        job.opened = True
        if job.route is not None and job.route.target is not None and services.routing:
            await services.routing.answered(job.route.target)
        async with ProgressDeadline(job.upstream, idle_timeout, decoder):
            await reads.feed(_folder(decoder, limit, acc, services.publisher, job))
    if acc.truncated:  # (an unfinished event at the end is never dispatched: nothing to fold)
        raise TruncatedStreamError("the upstream stream ended without [DONE] or a finish_reason")
    _raise_retryable_stream_error(acc)


def _raise_retryable_stream_error(acc: Accumulator) -> None:
    """An error chunk after the 200 that says "try again" (overloaded, rate limited, a
    server error) is a retryable failure of the target, not the job's end."""
    failure = acc.finish().exception() if acc.closed else None
    if isinstance(failure, MidStreamError) and judge(failure).move:
        raise RetryableStreamError(failure.message, status=failure.status, detail=failure.detail)


def _folder(
    decoder: SSEDecoder, limit: int, acc: Accumulator, publisher: Publisher, job: Attempt
) -> Callable[[bytes], bool]:
    """What each read of the body goes through, as it arrives: its events folded and
    published as one delta. True (read no more) once the reply is complete; raises when
    the attempt went stale."""

    def fold(data: bytes) -> bool:
        fields = decoder.feed_data(data) if len(data) <= limit else _sliced(decoder, data, limit)
        _fold_and_publish(fields, acc, publisher, job)
        if acc.closed:
            return True
        if job.stream.stale:
            raise StaleAttemptError("a newer attempt owns the job, or its record is gone")
        return False

    return fold


def _fold_and_publish(
    fields: Iterable[bytes], acc: Accumulator, publisher: Publisher, job: Attempt
) -> None:
    """Fold the data of one read's events and publish what they added as one delta; what
    was folded before an invalid event is still published (the record and the stream
    agree)."""
    try:
        job.timing.deltas += acc.fold_all(fields)
    finally:
        delta = acc.take_delta()
        if delta is not None:
            publisher.publish(job.stream, delta)
            job.content = job.content or len(delta) > ("role" in delta)
        job.timing.saw_output()


def _sliced(decoder: SSEDecoder, data: bytes, limit: int) -> Iterator[bytes]:
    """A read longer than the event limit, fed in limit-sized slices: the events before an
    oversized one are still yielded (and published) before EventTooLargeError."""
    for start in range(0, len(data), limit):
        yield from decoder.feed_data(data[start : start + limit])


def retry_plan(settings: Settings, job: Attempt, exc: ChatstreamError, tries: int) -> Retry:
    """Whether (and how) a failed try is retried, by the policy of docs/failures.md (and,
    on a route, of docs/routing.md)."""
    if job.route is not None and _to_context_fallback(settings, job, exc):
        return Retry.SAME_ATTEMPT if not job.content else Retry.NO
    if not retryable(exc) or tries >= settings.max_attempts:
        return Retry.NO
    if not job.opened and job.route is None:  # UpstreamClient retried before the first byte
        return Retry.NO
    if not job.content:
        return Retry.SAME_ATTEMPT
    return Retry.NEW_ATTEMPT if settings.retry_after_output else Retry.NO


def _to_context_fallback(settings: Settings, job: Attempt, exc: ChatstreamError) -> bool:
    """The prompt was too long for the target, and the route has a target for that."""
    state = job.route
    if state is None or state.on_context or not judge(exc).context:
        return False
    route = settings.routes.get(state.name)
    return route is not None and route.context_fallback is not None


async def start_next_attempt(
    services: Services, job: Attempt, failed_at: dict[str, str] | None = None
) -> bool:
    """Start a new attempt of this job (its stream gets a ``reset``), only while the current
    one is still the job's; False when it is not (the attempt goes on to a refused write)."""
    settings = services.settings
    await services.publisher.flush(job.stream)  # its output lands before the `reset`
    after = {**(failed_at or served(job)), "error": str(job.last_failure or "")[:300]}
    started = await services.records.start(
        job.job_id,
        services.worker_name,
        settings.max_attempts,
        restart_of=job.attempt,
        reset_detail=dumps({"after": after}),
    )
    if started.state != "started":
        return False
    job.attempt = started.attempt
    logs.set_attempt(started.attempt)
    services.tracing.reset(started.attempt)
    job.stream = services.publisher.open(job.job_id, started.attempt)
    job.content = False
    return True


async def write_terminal(
    services: Services,
    job: Attempt,
    final: FinalMessage | None,
    error: ChatstreamError | None,
    *,
    cancelled: bool = False,
) -> Outcome:
    terminal = build_terminal(final, error, cancelled=cancelled)
    _mask_error(services.settings, terminal)
    _add_served(job, terminal)
    services.tracing.ending(terminal)
    written = await services.publisher.finish(job.stream, terminal)
    job.replicated = terminal.replicated
    if not written and job.stream.rolled_back:
        return Outcome.STALE  # Redis lost its writes: the runner requeues it, saying so
    if not written:
        log.warning(
            "job %s attempt %d: terminal write refused (a newer attempt owns the job, or a "
            "retried write found its first one applied)",
            job.job_id,
            job.attempt,
        )
        return Outcome.STALE
    status = terminal.fields["status"]
    services.metrics.job_finished(status, job.timing)
    error_data = terminal.event_data.get("error")
    services.metrics.job_ended(
        status,
        job.timing,
        tenant=job.tenant,
        upstream=job.upstream,
        usage=final.usage if final is not None else None,
        code=error_data.get("code") if isinstance(error_data, dict) else None,
        route=job.route.name if job.route is not None else None,
        fallbacks=job.route.moves if job.route is not None else 0,
    )
    if job.route is not None and "served" in terminal.event_data:
        services.metrics.route_job(job.route.name, terminal.event_data["served"], status)
    if final is not None:
        services.metrics.job_usage(job.upstream, final.model, final.usage)
        if job.limits is not None:
            await job.limits.spent(final.usage)
    if error is None and "error" in terminal.fields:  # the upstream's mid-stream error chunk
        services.metrics.upstream_error_code("upstream_stream_error", job.upstream)
    if status == JobStatus.FAILED:
        log_failure(job.job_id, job.attempt, job.upstream, terminal.event_data["error"])
    else:
        log.debug("job %s attempt %d: %s", job.job_id, job.attempt, status)
    return Outcome.FINISHED


MAX_LOGGED_MESSAGE = 300


def _mask_error(settings: Settings, terminal: Terminal) -> None:
    """A failed job's error as the record and the stream keep it, with every configured
    credential masked where it stands whole: an upstream may echo a key in its error body or
    in an error chunk after its 200."""
    text = terminal.fields.get("error")
    if text is None:
        return
    masked = logs.mask_credentials(text, logs.secrets_of(settings), REDACTED)
    if masked != text:
        terminal.fields["error"] = masked
        terminal.event_data["error"] = json.loads(masked)


def served(job: Attempt) -> dict[str, str]:
    """Where the job's current try sends its request: ``{upstream, model?, route?}``."""
    state = job.route
    if state is not None and state.target is not None:
        return {"upstream": state.target.upstream, "model": state.target.model, "route": state.name}
    found = {"upstream": job.upstream}
    if job.model:
        found["model"] = job.model
    return found


def _add_served(job: Attempt, terminal: Terminal) -> None:
    """Once the job ran (it was let through to a target at least once), the terminal write
    says where its last try went: the record's ``served_upstream`` and ``served_model``, the
    terminal entry's ``served``."""
    if job.acc is None:
        return
    where = served(job)
    terminal.event_data["served"] = where
    terminal.fields["served_upstream"] = where["upstream"]
    terminal.fields["served_model"] = where.get("model", "")


def log_failure(job_id: str, attempt: int, upstream: str, error: dict[str, Any]) -> None:
    """The one WARNING line of a job that ended ``failed``: what an operator alerts on.

    ``job J attempt N failed: code=... upstream=... status=... error="..."
    upstream_message="..."`` (values JSON-quoted, so the line stays one line); JSON logs
    carry the same as fields. The handler masks configured secrets in both.
    """
    fields = {
        "event": "job_failed",
        "code": str(error.get("code", "error")),
        "upstream": upstream or "-",
        "status": error.get("status"),
        "error": _capped(error.get("message")),
        "upstream_message": _capped(_upstream_message(error.get("detail"))),
    }
    log.warning(
        "job %s attempt %d failed: code=%s upstream=%s status=%s error=%s upstream_message=%s",
        job_id,
        attempt,
        fields["code"],
        fields["upstream"],
        fields["status"] if fields["status"] is not None else "-",
        dumps(fields["error"]),
        dumps(fields["upstream_message"]),
        extra={"fields": fields},
    )


def _upstream_message(detail: Any) -> str:
    """The upstream's own words: its error object's ``message``, else the detail itself."""
    if isinstance(detail, dict):
        message = detail.get("message")
        return message if isinstance(message, str) else dumps(detail)
    return "" if detail is None else str(detail)


def _capped(value: Any) -> str:
    text = "" if value is None else str(value)
    return text if len(text) <= MAX_LOGGED_MESSAGE else text[:MAX_LOGGED_MESSAGE] + "…"


def build_terminal(
    final: FinalMessage | None, error: ChatstreamError | None, *, cancelled: bool = False
) -> Terminal:
    """The record fields and closing event for how the attempt ended."""
    fields = message_fields(final)
    usage = final.usage if final is not None else None
    finish_reason = final.finish_reason if final is not None else None
    if cancelled:
        data: dict[str, Any] = {"usage": usage}
        status, event = JobStatus.CANCELLED, EventType.CANCELLED
    elif error is not None or (final is not None and final.error is not None):
        err = (error or _stream_error(final)).to_record()
        fields["error"] = dumps(err)
        status, event = JobStatus.FAILED, EventType.ERROR
        data = {"error": err, "finish_reason": finish_reason, "usage": usage}
    else:
        status, event = JobStatus.SUCCEEDED, EventType.DONE
        data = {"finish_reason": finish_reason, "usage": usage}
    if final is not None:
        data.update(terminal_extras(final))
    fields["status"] = status.value
    fields["finished_at"] = f"{time.time():.6f}"
    return Terminal(event.value, data, fields)


def message_fields(final: FinalMessage | None) -> dict[str, str]:
    """The record's output fields (``OUTPUT_FIELDS``; empty when there is none)."""
    if final is None:
        return {}
    fields = {}
    for name in OUTPUT_FIELDS:
        value = final.extras.get(name) if name in EXTRAS else getattr(final, name)
        if value is None:
            fields[name] = ""
        else:
            fields[name] = dumps(value) if name in JSON_FIELDS else value
    return fields


def terminal_extras(final: FinalMessage) -> dict[str, Any]:
    """What the terminal entry adds to its type's data: the provider extras that arrived,
    and with n > 1 every other choice's finish_reason."""
    extras: dict[str, Any] = dict(final.extras)
    if final.choices:
        extras["choices"] = [
            {"index": choice["index"], "finish_reason": choice["finish_reason"]}
            for choice in final.choices
        ]
    return extras


def _stream_error(final: FinalMessage | None) -> ChatstreamError:
    """The error chunk the stream ended with, as the accumulator maps it (MidStreamError)."""
    exc = final.exception() if final is not None else None
    if exc is None:  # unreachable: an error chunk always ends the stream as "error"
        raise AssertionError("build_terminal: no stream error to report")
    return exc


def _first_problem(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(part) for part in err["loc"]) or "body"
    return f"{where}: {err['msg']}"


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
