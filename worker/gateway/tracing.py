"""The gateway's OpenTelemetry: a SERVER span per HTTP request, a child of the caller's
``traceparent``, current while the request runs, so a job it creates carries the trace
(``Client.enqueue`` stores the active span's context) and the worker's span joins it.

Installed by ``create_app`` only when the process traces (``worker.telemetry.tracing_on``).
The span follows the HTTP server conventions: ``<method> <route>`` (the route template,
never a job id), ``http.request.method``, ``http.route``, ``url.path``,
``http.response.status_code``, ``error.type`` on a 5xx. The query string is never
recorded: it may hold an events token. A streamed reply's span ends with its stream.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from starlette.routing import BaseRoute, Match

from worker import telemetry

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
CARRIED = frozenset(name.encode() for name in telemetry.TRACE_FIELDS)


class TraceRequests:
    """ASGI middleware: each HTTP request in its own SERVER span."""

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute]) -> None:
        from opentelemetry import trace

        self.app = app
        self.routes = routes
        self.tracer = trace.get_tracer("chatstream.gateway", schema_url=telemetry.SCHEMA_URL)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from opentelemetry import context, trace

        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in CARRIED
        }
        parent = telemetry.job_context(carrier)
        route = self.route_of(scope)
        method = scope["method"]
        attributes = {"http.request.method": method, "url.path": scope["path"]}
        if route is not None:
            attributes["http.route"] = route
        name = f"{method} {route}" if route is not None else method
        span = self.tracer.start_span(name, parent, trace.SpanKind.SERVER, attributes)
        token = context.attach(trace.set_span_in_context(span, parent))
        try:
            await self.app(scope, receive, _status_recorder(send, span))
        except BaseException as exc:
            span.record_exception(exc)
            _server_error(span, type(exc).__qualname__)
            raise
        finally:
            context.detach(token)
            span.end()

    def route_of(self, scope: Scope) -> str | None:
        """The template of the route the request goes to (``/v1/jobs/{job_id}``)."""
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return getattr(route, "path", None)
        return None


def _status_recorder(send: Send, span: Any) -> Send:
    async def recorded(message: Message) -> None:
        if message["type"] == "http.response.start":
            status = int(message["status"])
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                _server_error(span, str(status))
        await send(message)

    return recorded


def _server_error(span: Any, error_type: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR))
