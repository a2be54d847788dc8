"""Serving the dashboard with uvicorn in a running event loop: ``chatstream dashboard``
(until SIGINT / SIGTERM, then exit 0), the tests and the benchmark."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import uvicorn

from worker.dashboard.app import create_app
from worker.embedded_server import EmbeddedServer, bind, served
from worker.gateway.server import base_url, until_signalled
from worker.settings import Settings
from worker.store.redis_client import RedisClient, connect

log = logging.getLogger("chatstream.dashboard")
SHUTDOWN_GRACE_SECONDS = 1  # open pages' streams end; the pages reconnect by themselves


async def run_dashboard(settings: Settings) -> int:
    """Serve until SIGINT / SIGTERM, then stop (exit status 0)."""
    redis = await connect(settings)  # a plain URL of a Cluster node becomes a cluster client
    try:
        async with serve_dashboard(settings, redis) as url:
            mode = "actions with a key" if settings.dashboard_keys else "read-only"
            log.info("dashboard listening on %s (%s)", url, mode)
            await until_signalled()
            log.info("dashboard stopping")
    finally:
        await redis.aclose()
    return 0


@contextlib.asynccontextmanager
async def serve_dashboard(
    settings: Settings,
    redis: RedisClient | None = None,
    *,
    host: str | None = None,
    port: int | None = None,
) -> AsyncIterator[str]:
    """The dashboard in this event loop; yields its base URL (``http://127.0.0.1:PORT``)."""
    host = settings.dashboard_host if host is None else host
    sock = bind(host, settings.dashboard_port if port is None else port, what="the dashboard")
    config = uvicorn.Config(
        create_app(settings, redis),
        lifespan="on",
        log_config=None,  # chatstream's logging (worker/logs.py) stays as configured
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
    )
    server = EmbeddedServer(config, name="dashboard", grace=SHUTDOWN_GRACE_SECONDS)
    async with served(server, sock) as bound:
        yield base_url(host, bound)
