"""chatstream: chat-completion jobs in, live and durable token streams out.

The package's rooms, from the pure core outwards (which may import which is a test,
``tests/test_repo.py``, and a decision, docs/decisions.md "Layout"):

=============== ======================================================================
``protocol/``   the upstream's wire format: SSE decoder, chunk folding, merge rules (pure)
``upstream/``   the streaming HTTP call: httpx client, httptools transport, health gate
``store/``      everything kept in Redis: keys, connections, records, queue, heartbeats,
                the publisher and its round trips, the jobs index, stats, the Lua scripts
``service/``    the worker process: lifecycle, a queue entry's fate, upkeep, the pipeline
                of one job, metrics and health, the supervisor
``gateway/``    ``chatstream gateway``: OpenAI-compatible HTTP in, resumable SSE out
``dashboard/``  ``chatstream dashboard``: the operator's page, live from Redis alone
``cli/``        the ``chatstream`` command, what it prints, the demos
``testing/``    the mock upstream, for the demo and for users' own tests
=============== ======================================================================

Shared by every room: ``settings`` (configuration), ``urls`` (the forms of
``CHATSTREAM_REDIS_URL``; URLs shown without secrets), ``errors`` (the exception tree),
``logs`` (log lines, secrets masked), ``retry`` (backoff policies), ``aio`` (asyncio
helpers), ``speedups`` (uvloop, hiredis, httptools when installed), ``embedded_server``
(uvicorn inside a running loop), ``telemetry`` (OpenTelemetry: setup from the OTEL_*
variables, W3C trace context, log ids), ``telemetry_sdk`` (its SDK providers and OTLP
exporters, the ``otel`` extra) and ``internals`` (where we reach below a dependency's
public API: checked once against the installed release, the public path otherwise).
What backend services import is ``client`` (``Client``, ``SyncClient``) and ``schemas``.
"""

from functools import cache
from importlib.metadata import PackageNotFoundError, version


@cache
def package_version() -> str:
    """chatstream's installed version (``unknown`` in a checkout never installed)."""
    try:
        return version("chatstream")
    except PackageNotFoundError:
        return "unknown"
