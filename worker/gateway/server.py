"""Serving the gateway with uvicorn: ``chatstream gateway`` (blocking, with signals) or
embedded in a running event loop (the demo, the tests, the benchmark)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import uvicorn
from redis.asyncio import Redis

from worker.embedded_server import EmbeddedServer, bind
from worker.gateway.routes import create_app
from worker.settings import Settings

log = logging.getLogger("chatstream.gateway")

# open event streams get this long to end when the server stops; clients then resume
SHUTDOWN_GRACE_SECONDS = 2


def _config(settings: Settings, redis: Redis | None) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(settings, redis),
        lifespan="on",
        log_config=None,  # chatstream's logging (worker/logs.py) stays as configured
        access_log=False,  # an access line would show events tokens in query strings
        timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
        backlog=4096,
    )


async def run_gateway(settings: Settings) -> int:
    """Serve until SIGINT / SIGTERM."""
    config = _config(settings, None)
    sock = bind(settings.gateway_host, settings.gateway_port, backlog=4096)
    log.info("gateway listening on %s", _base_url(settings.gateway_host, sock.getsockname()[1]))
    try:
        await uvicorn.Server(config).serve(sockets=[sock])
    finally:
        sock.close()
    return 0


@contextlib.asynccontextmanager
async def serve_gateway(
    settings: Settings,
    redis: Redis | None = None,
    *,
    host: str | None = None,
    port: int | None = None,
) -> AsyncIterator[str]:
    """The gateway in this event loop; yields its base URL (``http://127.0.0.1:PORT``)."""
    host = settings.gateway_host if host is None else host
    sock = bind(host, settings.gateway_port if port is None else port, backlog=4096)
    server = EmbeddedServer(_config(settings, redis), name="gateway", grace=SHUTDOWN_GRACE_SECONDS)
    try:
        task = await server.start(sock)
    except BaseException:
        sock.close()
        raise
    try:
        yield _base_url(host, sock.getsockname()[1])
    finally:
        server.stop_requested.set()
        await task
        sock.close()


def _base_url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"
