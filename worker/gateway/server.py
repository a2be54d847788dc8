"""Serving the gateway with uvicorn in a running event loop: ``chatstream gateway`` (until
SIGINT / SIGTERM, then exit 0), the demo, the tests and the benchmark."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator

import uvicorn

from worker import internals, telemetry
from worker.embedded_server import EmbeddedServer, bind, served
from worker.gateway.app import create_app
from worker.gateway.connections import protocol_class
from worker.settings import Settings
from worker.store.redis_client import RedisClient, connect

log = logging.getLogger("chatstream.gateway")

# open event streams get this long to end when the server stops; clients then resume
SHUTDOWN_GRACE_SECONDS = 2


def _config(settings: Settings, redis: RedisClient | None) -> uvicorn.Config:
    app = create_app(settings, redis)
    connections = app.state.gateway.connections
    return uvicorn.Config(
        app,
        http=protocol_class(settings.gateway_head_timeout, connections),
        lifespan="on",
        log_config=None,  # chatstream's logging (worker/logs.py) stays as configured
        access_log=False,  # an access line would show events tokens in query strings
        timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
        backlog=4096,
    )


async def run_gateway(settings: Settings) -> int:
    """Serve until SIGINT / SIGTERM, then stop gracefully (exit status 0). Exports traces
    over OTLP when the OTEL_* variables ask for it (``worker.telemetry``)."""
    exporting = telemetry.setup("chatstream-gateway")
    redis = await connect(settings)
    try:
        async with serve_gateway(settings, redis) as url:
            log.info("gateway listening on %s", url)
            await until_signalled()
            log.info("gateway stopping")
    finally:
        await redis.aclose()
        if exporting is not None:
            await asyncio.to_thread(exporting.shutdown)  # the last spans
    return 0


async def until_signalled() -> signal.Signals:
    """Returns on SIGINT or SIGTERM: which one came."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[signal.Signals] = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _first, received, sig)
    try:
        return await received
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _first(received: asyncio.Future[signal.Signals], sig: signal.Signals) -> None:
    if not received.done():
        received.set_result(sig)


@contextlib.asynccontextmanager
async def serve_gateway(
    settings: Settings,
    redis: RedisClient | None = None,
    *,
    host: str | None = None,
    port: int | None = None,
) -> AsyncIterator[str]:
    """The gateway in this event loop; yields its base URL (``http://127.0.0.1:PORT``)."""
    host = settings.gateway_host if host is None else host
    internals.check_all()  # one line per internal a release moved: what is done instead
    sock = bind(host, settings.gateway_port if port is None else port, backlog=4096)
    server = EmbeddedServer(_config(settings, redis), name="gateway", grace=SHUTDOWN_GRACE_SECONDS)
    async with served(server, sock) as bound:
        yield base_url(host, bound)


def base_url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"
