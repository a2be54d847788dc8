"""Where chatstream reaches below a dependency's public API, checked against the installed
release (docs/decisions.md, 79).

Each place is an :class:`Internal`: what it reaches for, a check of the installed release
(no I/O), the release it is known in, and the public path the code takes when the check
fails. :func:`available` runs a check once per process and, when it fails, logs one
WARNING line naming what was not found and what is done instead; the code then takes
that path, never an error. The line is a WARNING when the installed release is at least
the one named as having it (a release moved it), INFO when it predates it (the public path
is that release's normal one). :func:`check_all` runs every check whose dependency is
installed and in use (a worker and a gateway call it at start, so the lines come together
there); OpenTelemetry's are checked where its SDK is set up, only when exporting, and
uvicorn's where an embedded server or the gateway's protocol is made.
``tests/unit/test_internals.py`` simulates each change and asserts the path and the line,
and that every check passes on the releases named here.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

log = logging.getLogger("chatstream.internals")


@dataclass(frozen=True)
class Internal:
    distribution: str  # the package on PyPI
    what: str  # what is reached for, as its source names it
    since: str  # the release of ``distribution`` known to have it
    fallback: str  # what chatstream does without it
    present: Callable[[], bool]


def _names_in(function: Any, *names: str) -> bool:
    """``function``'s code reads or writes every one of ``names`` (attributes, globals)."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    return code is not None and all(name in code.co_names for name in names)


def _redis_parsers() -> bool:
    parsers = import_module("redis._parsers")
    return all(hasattr(parsers, n) for n in ("_AsyncHiredisParser", "_AsyncRESP3Parser"))


def _connection_writer() -> bool:
    connection = import_module("redis.asyncio.connection").Connection
    return _names_in(connection._connect, "_writer")


def _connect_hook() -> bool:
    connection = import_module("redis.asyncio.connection").AbstractConnection
    connects = getattr(connection, "connect_check_health", connection.connect)
    return callable(getattr(connection, "_connect", None)) and _names_in(connects, "_connect")


def _determine_slot() -> bool:
    cluster = import_module("redis.asyncio.cluster").RedisCluster
    callers = [f for f in vars(cluster).values() if _names_in(f, "_determine_slot")]
    return inspect.iscoroutinefunction(getattr(cluster, "_determine_slot", None)) and bool(callers)


def _cluster_pipeline() -> bool:
    pipeline = import_module("redis.asyncio.cluster").ClusterPipeline
    try:
        inspect.signature(pipeline).bind(None, None)
    except TypeError:
        return False
    return True


def _move_slot() -> bool:
    nodes = import_module("redis.asyncio.cluster").NodesManager
    return inspect.iscoroutinefunction(getattr(nodes, "move_slot", None))


def _loop_queues() -> bool:
    base = import_module("asyncio.base_events").BaseEventLoop
    return _names_in(base.__init__, "_ready", "_scheduled")


def _proxy_meter_provider() -> bool:
    return hasattr(import_module("opentelemetry.metrics._internal"), "_ProxyMeterProvider")


def _capture_signals() -> bool:
    server = import_module("uvicorn").Server
    return callable(getattr(server, "capture_signals", None)) and _names_in(
        server.serve, "capture_signals"
    )


def _uvicorn_server() -> bool:
    uvicorn = import_module("uvicorn")
    server = uvicorn.Server
    methods = ("main_loop", "on_tick", "startup", "shutdown")
    return (
        all(callable(getattr(server, name, None)) for name in methods)
        and _names_in(server.__init__, "server_state")
        and _names_in(server.startup, "servers", "lifespan")
        and _names_in(uvicorn.Config.load, "http_protocol_class")
    )


def _uvicorn_protocols() -> bool:
    h11 = import_module("uvicorn.protocols.http.h11_impl").H11Protocol
    return callable(getattr(h11, "on_response_complete", None)) and _names_in(
        h11.__init__, "cycle", "server", "client", "transport", "loop"
    )


INTERNALS: dict[str, Internal] = {
    "redis-parsers": Internal(
        "redis",
        "redis._parsers._AsyncHiredisParser / _AsyncRESP3Parser",
        "8.0",
        "redis-py picks the reply parser itself (CHATSTREAM_REDIS_PARSER cannot force one)",
        _redis_parsers,
    ),
    "redis-connection-writer": Internal(
        "redis",
        "redis.asyncio.connection.AbstractConnection._writer",
        "8.0",
        "a write on a closed transport raises what the transport raises; Redis sockets are "
        "not watched by the wake-up tick (it is off)",
        _connection_writer,
    ),
    "redis-connect-hook": Internal(
        "redis",
        "redis.asyncio.connection.AbstractConnection._connect (called by connect)",
        "8.0",
        "Redis sockets are not watched by the wake-up tick (it is off)",
        _connect_hook,
    ),
    "redis-determine-slot": Internal(
        "redis",
        "redis.asyncio.cluster.RedisCluster._determine_slot (called per command)",
        "8.0",
        "redis-py routes XREAD, XREADGROUP, XGROUP and XINFO itself (COMMAND GETKEYS)",
        _determine_slot,
    ),
    "redis-cluster-pipeline": Internal(
        "redis",
        "redis.asyncio.cluster.ClusterPipeline(client, transaction)",
        "8.0",
        "redis-py's own cluster pipeline (its RedisClusterException is not retried)",
        _cluster_pipeline,
    ),
    "redis-move-slot": Internal(
        "redis",
        "redis.asyncio.cluster.NodesManager.move_slot (a coroutine)",
        "8.0",
        "a MOVED reply reloads the whole slot map before the command is sent again",
        _move_slot,
    ),
    "asyncio-loop-queues": Internal(
        "python",
        "asyncio.BaseEventLoop._ready / _scheduled",
        "3.11",
        "the wake-up tick tells an idle loop by two quick passes (as on uvloop)",
        _loop_queues,
    ),
    "otel-proxy-meter-provider": Internal(
        "opentelemetry-api",
        "opentelemetry.metrics._internal._ProxyMeterProvider",
        "1.33",
        "chatstream's MeterProvider is offered through set_meter_provider and kept only if "
        "the API took it",
        _proxy_meter_provider,
    ),
    "uvicorn-capture-signals": Internal(
        "uvicorn",
        "uvicorn.Server.capture_signals (called by serve)",
        "0.29",
        "an embedded server (metrics, mock upstream) may take SIGTERM/SIGINT while it runs",
        _capture_signals,
    ),
    "uvicorn-server": Internal(
        "uvicorn",
        "uvicorn.Server main_loop / on_tick / startup / shutdown / server_state / servers, "
        "Config.http_protocol_class",
        "0.29",
        "embedded servers run as uvicorn's own Server (serve until should_exit), their "
        "sockets not watched by the wake-up tick",
        _uvicorn_server,
    ),
    "uvicorn-protocols": Internal(
        "uvicorn",
        "uvicorn.protocols.http: H11Protocol / HttpToolsProtocol cycle, on_response_complete",
        "0.29",
        "the gateway serves with uvicorn's own protocol: no request-head timeout, and a "
        "client that stops reading is not cut off",
        _uvicorn_protocols,
    ),
}

_FOUND: dict[str, bool] = {}


def installed(distribution: str) -> str | None:
    """The installed release of ``distribution`` (Python's own for ``python``)."""
    if distribution == "python":
        import platform

        return platform.python_version()
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def available(name: str) -> bool:
    """Whether the installed release has what ``name`` reaches for (checked once; a
    failed check is said in one WARNING line). A dependency that is not installed is
    not looked at: False, and nothing said."""
    found = _FOUND.get(name)
    if found is None:
        internal = INTERNALS[name]
        release = installed(internal.distribution)
        try:
            found = release is not None and bool(internal.present())
        except (ImportError, AttributeError, TypeError, ValueError):
            found = False
        _FOUND[name] = found
        if not found and release is not None:
            moved = _release(release) >= _release(internal.since)
            log.log(
                logging.WARNING if moved else logging.INFO,
                "%s %s: %s not found; %s",
                internal.distribution,
                release,
                internal.what,
                internal.fallback,
            )
    return found


def _release(text: str) -> tuple[int, ...]:
    """``1.33.0`` -> (1, 33, 0); what follows the numbers (``b2``, ``rc1``) is ignored."""
    numbers = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(part) for part in numbers.group().split(".")) if numbers else ()


def check_all() -> dict[str, bool]:
    """Every check of what this process uses (one line per one that fails): not
    OpenTelemetry's (checked where its SDK is set up), nor uvicorn's unless it is imported
    (a worker without its metrics endpoint does not import it: start-up time)."""
    return {
        name: available(name)
        for name in INTERNALS
        if not name.startswith("otel-")
        and (not name.startswith("uvicorn-") or "uvicorn" in sys.modules)
    }


def forget() -> None:
    """Check again on next use (tests that simulate another release)."""
    _FOUND.clear()
