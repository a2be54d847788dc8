"""The streaming call to an OpenAI-compatible ``/v1/chat/completions`` endpoint.

The only module that knows httpx: its exceptions are translated once, in
``_translate_httpx_errors``, into the ``worker.errors`` tree. Everything up to and including
the first body byte is one try, retried with tenacity while it fails retryably (up to
``CHATSTREAM_RETRY_ATTEMPTS`` tries when set; by default until the job's timeout cancels
it). Each upstream has a gate (``worker/upstream/gate.py``) that paces the tries while it is down:
one probe at a time after a jittered, capped backoff or the upstream's ``Retry-After``,
the other jobs waiting without their slot. After the first byte nothing is retried here,
because output may already have been published.

    async with client.stream("default", body, idle=give_back_my_slot) as reads:
        async for data in reads:  # raw SSE bytes, as they arrive
            ...
        # or: await reads.feed(consume), consume(data) -> True to stop reading
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
    nullcontext,
)
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Protocol

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_never,
    wait_none,
)

from worker.aio import URGENT
from worker.errors import (
    ProtocolError,
    RetryableUpstreamError,
    TerminalUpstreamError,
    UpstreamTimeoutError,
    retryable,
)
from worker.logs import RedactFilter, mask_credentials, secrets_of
from worker.settings import Settings, Upstream
from worker.speedups import chosen_transport
from worker.telemetry import inject_upstream
from worker.upstream import BODY_EXTENSION
from worker.upstream.error_body import error_detail
from worker.upstream.gate import IdleSlot, UpstreamGate, keep_slot
from worker.upstream.verdict import Grain

logger = logging.getLogger("chatstream.upstream")

RETRY_STATUSES = frozenset({408, 409, 425, 429})
MAX_ERROR_BODY = 64 * 1024
REDACTED = "[REDACTED]"
HTTP_LOGGERS = (
    "httpx",
    "httpcore.connection",
    "httpcore.http11",
    "httpcore.http2",
    "httpcore.proxy",
    "httpcore.socks",
)
_HTTP_LOG_REDACTION = RedactFilter([])

OnRetry = Callable[[BaseException, float], None]


class Pacing(Protocol):
    """What a fleet-wide limit asks of each try (``worker/service/limits.py``): the client
    knows nothing of where the limits are kept."""

    async def before_try(self) -> None:
        """Wait until the upstream may be sent one more request (waits without the slot)."""

    async def rate_limited(self, retry_after: float | None) -> None:
        """The upstream answered 429: the fleet pauses it (``retry_after`` when it said)."""


@dataclass(frozen=True, slots=True)
class _Call:
    """One stream's request and where it goes."""

    name: str  # the upstream's
    model: str  # the body's (its target's gate)
    target: Upstream
    request: httpx.Request


@dataclass(frozen=True)
class _Opened:
    """A response whose status and content type were accepted and whose first byte arrived."""

    response: httpx.Response
    chunks: AsyncIterator[bytes]
    first: bytes
    raw: bool  # ``chunks`` are the body as it arrived (not decoded)


class FedBody(Protocol):
    """A transport's body that calls back with each read (``worker.upstream.transport``)."""

    async def feed(self, consume: Callable[[bytes], bool]) -> None: ...


class UpstreamBody:
    """The body after the first byte, with the idle timeout and no retries: iterated, or
    ``feed``-ed a callback (from the transport's data callback where it can: no wake-up of
    the reading task per read, docs/decisions.md, 64)."""

    def __init__(self, name: str, opened: _Opened, idle_timeout: float) -> None:
        self._name = name
        self._opened = opened
        self._idle_timeout = idle_timeout
        self._relay: AsyncGenerator[bytes, None] | None = None

    def __aiter__(self) -> UpstreamBody:
        return self

    async def __anext__(self) -> bytes:
        if self._relay is None:
            self._relay = self._reads()
        return await anext(self._relay)

    async def feed(self, consume: Callable[[bytes], bool]) -> None:
        """``consume(data)`` for each read (the first byte's included) until it returns
        True or the body ends; what ``consume`` raises is raised here."""
        opened = self._opened
        with self._translated():
            if consume(opened.first):
                return
            fed: FedBody | None = opened.response.extensions.get(BODY_EXTENSION)
            if fed is not None and opened.raw:
                await fed.feed(consume)
                return
            async for chunk in opened.chunks:
                if chunk and consume(chunk):
                    return

    async def aclose(self) -> None:
        if self._relay is not None:
            await self._relay.aclose()

    async def _reads(self) -> AsyncGenerator[bytes, None]:
        yield self._opened.first
        with self._translated():
            async for chunk in self._opened.chunks:
                if chunk:
                    yield chunk

    def _translated(self) -> AbstractContextManager[None]:
        # httpx's read timeout (= idle_timeout) bounds each silence: no timer per read
        # here; the caller's ProgressDeadline (idle.py) bounds the time between events
        url = self._opened.response.request.url
        return _translate_httpx_errors(self._name, url, streaming=True, deadline=self._idle_timeout)


class UpstreamClient:
    """Streams chat completions from the named upstreams of ``settings``.

    One instance (and one pooled ``httpx.AsyncClient``) per process. Pass ``http`` to inject
    a client (tests use ``httpx.MockTransport``); an injected client is not closed by
    ``aclose()``. ``on_retry(exc, wait)`` is called after every failed try that will be
    retried (``wait``: seconds until the upstream's next try). ``gates`` tell which upstreams
    are down and how many jobs wait for each.
    """

    def __init__(
        self,
        settings: Settings,
        http: httpx.AsyncClient | None = None,
        *,
        on_retry: OnRetry | None = None,
    ) -> None:
        self._settings = settings
        self._timeout = _timeouts(settings)
        self._owns_http = http is None
        self._http = http if http is not None else _new_http_client(settings, self._timeout)
        # our transport puts its sockets in URGENT until the first token; under another,
        # the wake-up tick is shortened until the first byte (worker.aio.UrgentSockets)
        watched = self._owns_http and chosen_transport(settings) == "httptools"
        self._until_first_byte = nullcontext if watched else URGENT.hurry
        self._on_retry = on_retry
        self.gates: dict[str, UpstreamGate] = {}  # by upstream, and by gate_key(upstream, model)
        guard_http_logs(secrets_of(settings))

    async def __aenter__(self) -> UpstreamClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    def gate(self, name: str, model: str | None = None) -> UpstreamGate:
        """The named upstream's gate (its health as this process sees it), or with ``model``
        the gate of that target (the upstream's answers about that model)."""
        key = name if model is None else gate_key(name, model)
        if key not in self.gates:
            settings = self._settings
            self.gates[key] = UpstreamGate(
                name, settings.retry_initial_backoff, settings.retry_max_backoff, model
            )
        return self.gates[key]

    def down_gate(self, name: str, model: str) -> UpstreamGate | None:
        """The gate that holds a job for ``name`` and ``model`` back: its upstream's, else
        its target's, while down (None: neither is)."""
        for key in (name, gate_key(name, model)):
            gate = self.gates.get(key)
            if gate is not None and gate.down:
                return gate
        return None

    def report(self, name: str, model: str, exc: RetryableUpstreamError) -> None:
        """A failure of the target seen after its try was let through (an error chunk after
        the 200): its gate goes down as if the try had failed."""
        self.gate(name, None if exc.unreachable else model).failed(exc)

    def _forget_idle_target(self, name: str, model: str) -> None:
        """A target's gate that is up and unused goes: gates are kept for what is live,
        not for every model ever asked for."""
        key = gate_key(name, model)
        gate = self.gates.get(key)
        if gate is not None and gate.idle:
            del self.gates[key]

    def stream(
        self,
        upstream: str,
        body: dict[str, Any],
        *,
        idle: IdleSlot = keep_slot,
        pacing: Pacing | None = None,
        single_try: bool = False,
        on_failure: Callable[[RetryableUpstreamError], None] | None = None,
    ) -> AbstractAsyncContextManager[UpstreamBody]:
        """POST ``body`` to the upstream named ``upstream``; yields its raw body bytes.

        Raises ``UnknownUpstreamError`` at once for a name the settings do not define.
        Entering retries everything before the first body byte; while the upstream, or the
        target (the upstream with ``body``'s model), is down the caller waits inside
        ``idle()`` (the worker gives the job's slot back there). ``single_try``: one try, no
        gate (a route's job moves to another target instead). Leaving (normally, by an
        exception or by cancellation) closes the response and its connection. ``pacing`` is
        asked before every try and told of every 429; ``on_failure`` is told of every failed
        try.
        """
        target = self._settings.upstream(upstream)
        request = self._http.build_request(
            "POST",
            target.completions_url,
            json=body,
            headers=_request_headers(target),
            timeout=self._timeout,
        )
        model = body.get("model")
        call = _Call(upstream, model if isinstance(model, str) else "", target, request)
        return self._stream(call, idle, pacing, single_try, on_failure)

    @asynccontextmanager
    async def _stream(
        self,
        call: _Call,
        idle: IdleSlot,
        pacing: Pacing | None,
        single_try: bool,
        on_failure: Callable[[RetryableUpstreamError], None] | None,
    ) -> AsyncIterator[UpstreamBody]:
        if single_try:
            opened = await self._paced_attempt(call, pacing, on_failure)
        else:
            try:
                opened = await self._open(call, idle, pacing, on_failure)
            finally:
                self._forget_idle_target(call.name, call.model)
        body = UpstreamBody(call.name, opened, self._settings.idle_timeout)
        try:
            yield body
        finally:
            await body.aclose()
            await opened.response.aclose()

    async def _open(
        self,
        call: _Call,
        idle: IdleSlot,
        pacing: Pacing | None,
        on_failure: Callable[[RetryableUpstreamError], None] | None,
    ) -> _Opened:
        attempts = self._settings.retry_attempts
        gates = (self.gate(call.name), self.gate(call.name, call.model))
        retrying = AsyncRetrying(
            stop=stop_never if attempts is None else stop_after_attempt(attempts),
            wait=wait_none(),  # the gates pace the tries
            retry=retry_if_exception(retryable),
            before_sleep=self._before_sleep(gates),
            reraise=True,
        )
        try:
            opened: _Opened = await retrying(
                self._gated_attempt, gates, idle, call, pacing, on_failure
            )
        except RetryableUpstreamError as exc:
            # reraise=True: only exhaustion lets a retryable error out, never RetryError.
            plural = "s" if attempts != 1 else ""
            exc.message = f"{exc.message} (gave up after {attempts} attempt{plural})"
            exc.args = (exc.message,)
            raise
        return opened

    async def _gated_attempt(
        self,
        gates: tuple[UpstreamGate, UpstreamGate],
        idle: IdleSlot,
        call: _Call,
        pacing: Pacing | None,
        on_failure: Callable[[RetryableUpstreamError], None] | None,
    ) -> _Opened:
        upstream_gate, target_gate = gates
        async with upstream_gate.admitted(idle), target_gate.admitted(idle, Grain.TARGET):
            return await self._paced_attempt(call, pacing, on_failure)

    async def _paced_attempt(
        self,
        call: _Call,
        pacing: Pacing | None,
        on_failure: Callable[[RetryableUpstreamError], None] | None,
    ) -> _Opened:
        if pacing is not None:
            await pacing.before_try()
        try:
            return await self._attempt(call.name, call.target, call.request)
        except RetryableUpstreamError as exc:
            if on_failure is not None:
                on_failure(exc)
            if exc.status == 429 and pacing is not None:
                await pacing.rate_limited(exc.retry_after)
            raise

    async def _attempt(self, name: str, target: Upstream, request: httpx.Request) -> _Opened:
        """One try: send, accept status and content type, wait for the first body byte."""
        deadline = self._settings.first_byte_timeout
        with _translate_httpx_errors(name, request.url, streaming=False, deadline=deadline):
            async with asyncio.timeout(deadline):
                with self._until_first_byte():
                    return await self._first_byte(name, target, request)

    async def _first_byte(self, name: str, target: Upstream, request: httpx.Request) -> _Opened:
        response = await self._http.send(request, stream=True)
        try:
            await _check_response(name, target, response)
            raw = _is_raw(response)
            chunks = response.aiter_raw() if raw else response.aiter_bytes()
            first = await _first_chunk(name, chunks)
        except BaseException:
            await response.aclose()
            raise
        return _Opened(response, chunks, first, raw)

    def _before_sleep(
        self, gates: tuple[UpstreamGate, UpstreamGate]
    ) -> Callable[[RetryCallState], None]:
        def log_and_notify(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            wait = max(gate.next_try_in() for gate in gates)
            logger.debug(  # the gates' down and back lines are the INFO-level story
                "upstream %r attempt %d failed, next try in %.3fs: %s",
                gates[0].name,
                state.attempt_number,
                wait,
                exc,
            )
            if self._on_retry is not None and exc is not None:
                self._on_retry(exc, wait)

        return log_and_notify


def gate_key(upstream: str, model: str) -> str:
    """``UpstreamClient.gates``' key of a target (an upstream's own key is its name)."""
    return f"{upstream}\x00{model}"


def guard_http_logs(secrets: list[str]) -> None:
    """Mask ``secrets`` in every record httpx and httpcore create.

    httpcore's DEBUG lines show response headers, and a hostile upstream can echo the API
    key in one. The filter sits on those loggers (not on a handler), so it holds whatever
    logging the application configures; it only runs for records that are logged at all.
    """
    known = set(_HTTP_LOG_REDACTION.secrets)
    if not known.issuperset(s for s in secrets if s):
        _HTTP_LOG_REDACTION.secrets = sorted(known.union(secrets) - {""}, key=len, reverse=True)
    for name in HTTP_LOGGERS:
        http_logger = logging.getLogger(name)
        if _HTTP_LOG_REDACTION not in http_logger.filters:
            http_logger.addFilter(_HTTP_LOG_REDACTION)


def _timeouts(settings: Settings) -> httpx.Timeout:
    """httpx's per-operation timeouts.

    ``read`` is the idle timeout: it bounds every single socket read, mid-stream gaps and
    the wait for the response headers alike (httpcore applies it per read, at no extra
    cost per chunk). Mid-stream, ``worker.upstream.idle`` bounds the time between complete
    SSE events too, so that bytes dripping in do not restart it. ``_attempt`` also bounds
    send + headers + first byte as a whole by ``first_byte_timeout``; the wait for headers
    is therefore the smaller of the two.
    """
    return httpx.Timeout(
        connect=settings.connect_timeout,
        read=settings.idle_timeout,
        write=settings.first_byte_timeout,
        pool=settings.connect_timeout,
    )


def _new_http_client(settings: Settings, timeout: httpx.Timeout) -> httpx.AsyncClient:
    """httpx's client, over ``worker.upstream.transport`` (httptools) when that is the chosen
    transport (about a third of the CPU per read of httpx's own; docs/decisions.md, 39),
    else over httpx's own (which also speaks to the environment's proxies)."""
    limits = httpx.Limits(
        max_connections=settings.concurrency,
        max_keepalive_connections=settings.concurrency,
        keepalive_expiry=5.0,
    )
    transport: httpx.AsyncBaseTransport | None = None
    if chosen_transport(settings) == "httptools":
        from worker.upstream.transport import HttptoolsTransport

        transport = HttptoolsTransport(limits=limits)
    return httpx.AsyncClient(
        timeout=timeout, limits=limits, follow_redirects=False, transport=transport
    )


def _is_raw(response: httpx.Response) -> bool:
    """Whether the body is read as it arrives (``aiter_raw``: it is not content-encoded, as
    we ask; one generator layer less per read), else with ``aiter_bytes``, which decodes
    (and also serves a body that was read already, as transports that are not sockets
    give)."""
    encoding = response.headers.get("content-encoding", "").strip().lower()
    return encoding in ("", "identity") and not response.is_stream_consumed


def _request_headers(target: Upstream) -> dict[str, str]:
    # identity: compression would make the upstream buffer tokens; aiter_bytes still
    # decodes a body compressed anyway.
    headers = {"Accept": "text/event-stream", "Accept-Encoding": "identity"}
    inject_upstream(headers, baggage=target.forward_baggage)  # the job's span, if traced
    if target.api_key is not None:
        headers["Authorization"] = f"Bearer {target.api_key.get_secret_value()}"
    headers.update(target.headers)
    return headers


@contextmanager
def _translate_httpx_errors(
    name: str, url: httpx.URL, *, streaming: bool, deadline: float
) -> Iterator[None]:
    """httpx (and our own deadline's ``TimeoutError``) -> the chatstream tree, once."""
    try:
        yield
    except (TimeoutError, httpx.ReadTimeout) as exc:
        reason = f"no data for {deadline:g}s" if streaming else f"no first byte in {deadline:g}s"
        raise UpstreamTimeoutError(f"upstream {name!r}: {reason}", upstream=name) from exc
    except httpx.ConnectTimeout as exc:
        raise UpstreamTimeoutError(
            f"upstream {name!r}: connecting to {_address(url)} timed out",
            upstream=name,
            unreachable=True,
        ) from exc
    except httpx.TimeoutException as exc:
        raise UpstreamTimeoutError(
            f"upstream {name!r}: {type(exc).__name__}", upstream=name
        ) from exc
    except (httpx.UnsupportedProtocol, httpx.LocalProtocolError) as exc:
        raise TerminalUpstreamError(
            f"upstream {name!r}: request rejected by httpx ({type(exc).__name__})", upstream=name
        ) from exc
    except httpx.TransportError as exc:
        if streaming:
            message = f"upstream {name!r} disconnected mid-stream"
        else:
            message = f"upstream {name!r}: {connect_failure(exc, url)}"
        raise RetryableUpstreamError(message, upstream=name, unreachable=not streaming) from exc
    except httpx.DecodingError as exc:
        raise ProtocolError(f"upstream {name!r}: undecodable response body") from exc


def _address(url: httpx.URL) -> str:
    port = url.port or (443 if url.scheme == "https" else 80)
    host = f"[{url.host}]" if ":" in url.host else url.host
    return f"{host}:{port}"


def connect_failure(exc: httpx.TransportError, url: httpx.URL) -> str:
    """Why a request failed before any response, told apart, with the host and port: the
    name does not resolve, nothing listens, TLS fails (the server does not speak it, or
    its certificate is not trusted), or the server hung up or answered something else
    than HTTP. The causes are found in the exception chain (httpx -> httpcore -> the
    socket or ssl error)."""
    address = _address(url)
    cause = _root_cause(exc)
    if isinstance(exc, httpx.ConnectError):
        return _connect_error(cause, url, address)
    if isinstance(exc, httpx.RemoteProtocolError):
        hint = " (a TLS port reached with http://?)" if url.scheme == "http" else ""
        return f"no HTTP response from {address} ({exc}){hint}"
    reason = _reason(cause, exc) if cause is not exc else type(exc).__name__
    return f"{address} dropped the connection before the first byte ({reason})"


def _connect_error(cause: BaseException, url: httpx.URL, address: str) -> str:
    if isinstance(cause, socket.gaierror):
        return f"cannot resolve host {url.host!r} (DNS: {cause.strerror or cause})"
    if isinstance(cause, ssl.SSLCertVerificationError):
        return f"TLS certificate of {address} not trusted ({cause.verify_message})"
    if isinstance(cause, ssl.SSLError):
        hint = " (the server does not speak TLS: use http://?)" if _not_tls(cause) else ""
        return f"TLS handshake with {address} failed ({cause.reason or cause}){hint}"
    if isinstance(cause, ConnectionRefusedError):
        return f"connection refused by {address} (nothing listens there)"
    return f"cannot connect to {address} ({_reason(cause, cause)})"


def _reason(cause: BaseException, fallback: BaseException) -> str:
    """``connection reset by peer``: the socket error's text, else the exception's name."""
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror.lower()
    return str(cause) or type(fallback).__name__


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost socket/ssl error of the chain. A link is the cause, the context, or
    the exception an httpcore error wraps as its argument (httpcore's pool re-raises
    ``from None``, which cuts the chain but keeps the argument)."""
    seen: set[int] = set()
    found: BaseException = exc
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError):
            found = current
        current = current.__cause__ or current.__context__ or _wrapped(current)
    return found


def _wrapped(exc: BaseException) -> BaseException | None:
    inner = exc.args[0] if exc.args else None
    return inner if isinstance(inner, BaseException) else None


def _not_tls(exc: ssl.SSLError) -> bool:
    return exc.reason in {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"}


async def _check_response(name: str, target: Upstream, response: httpx.Response) -> None:
    status = response.status_code
    content_type = response.headers.get("content-type", "")
    is_sse = content_type.split(";")[0].strip().lower() == "text/event-stream"
    if 200 <= status < 300 and is_sse:
        return
    detail = await _error_detail(response, target)
    if status in RETRY_STATUSES or status >= 500:
        raise RetryableUpstreamError(
            f"upstream {name!r} returned HTTP {status}",
            status=status,
            detail=detail,
            retry_after=retry_after_seconds(response.headers),
            upstream=name,
        )
    if 200 <= status < 300:
        raise TerminalUpstreamError(
            f"upstream {name!r} returned HTTP {status} with content-type {content_type!r},"
            " not text/event-stream",
            status=status,
            detail=detail,
            upstream=name,
        )
    raise TerminalUpstreamError(
        f"upstream {name!r} returned HTTP {status}", status=status, detail=detail, upstream=name
    )


async def _error_detail(response: httpx.Response, target: Upstream) -> Any:
    """The upstream's error object (``worker.upstream.error_body``), its key masked."""
    text = (await _read_capped(response)).decode("utf-8", "replace")
    if target.api_key is not None and (key := target.api_key.get_secret_value()):
        text = mask_credentials(text, [key], REDACTED)
    return error_detail(text, response.headers.get("content-type", ""))


async def _read_capped(response: httpx.Response, limit: int = MAX_ERROR_BODY) -> bytes:
    """At most ``limit`` bytes of an error body; a failure while reading keeps what came."""
    data = bytearray()
    try:
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) >= limit:
                break
    except httpx.HTTPError:
        pass
    return bytes(data[:limit])


async def _first_chunk(name: str, chunks: AsyncIterator[bytes]) -> bytes:
    async for chunk in chunks:
        if chunk:
            return chunk
    raise RetryableUpstreamError(
        f"upstream {name!r} closed the stream before the first byte", upstream=name
    )


def retry_after_seconds(headers: httpx.Headers) -> float | None:
    """``retry-after-ms``, or ``Retry-After`` as seconds or an HTTP-date; None if absent."""
    millis = _non_negative(headers.get("retry-after-ms"))
    if millis is not None:
        return millis / 1000
    value = headers.get("retry-after")
    if value is None:
        return None
    seconds = _non_negative(value)
    if seconds is not None:
        return seconds
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def _non_negative(value: str | None) -> float | None:
    try:
        number = float(value) if value is not None else math.nan
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None
