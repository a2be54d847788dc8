"""A worker's HTTP endpoints: metrics, liveness and readiness.

    GET /metrics   the worker's registry (Prometheus text, or OpenMetrics when asked)
    GET /healthz   200 while the process's event loop answers
    GET /readyz    200 when Redis answers PING, the event loop is not lagging, the worker can
                   read its queue and is not shutting down; else 503 with
                   {"ready": false, "reason": ...}

Served by uvicorn inside the worker's event loop on ``settings.metrics_port`` (``None``:
off, ``0``: a free port).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import make_asgi_app
from redis.exceptions import RedisError

from worker.service.metrics import Metrics
from worker.service.runtime import redis_location
from worker.store.redis_client import RedisClient

if TYPE_CHECKING:
    from worker.embedded_server import EmbeddedServer

log = logging.getLogger("chatstream.metrics")

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

LAG_INTERVAL = 0.5  # seconds between event-loop lag samples
MAX_LAG = 1.0  # a loop that lagged longer than this is not ready
PING_TIMEOUT = 1.0


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` for one worker (an ASGI app and its server)."""

    def __init__(
        self,
        metrics: Metrics,
        redis: RedisClient,
        stopping: asyncio.Event,
        cannot_consume: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.metrics = metrics
        self.redis = redis
        self.stopping = stopping
        self.cannot_consume = cannot_consume  # why the worker cannot read its queue, or None
        self.lag = 0.0
        self.port = 0
        self._metrics_app = make_asgi_app(metrics.registry)
        self._server: EmbeddedServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._socket: socket.socket | None = None

    async def start(self, host: str, port: int) -> None:
        import uvicorn

        from worker.embedded_server import EmbeddedServer, bind

        sock = bind(host, port, what="the metrics server (CHATSTREAM_METRICS_PORT)")
        config = uvicorn.Config(
            self, log_config=None, log_level="warning", access_log=False, lifespan="off"
        )
        server = EmbeddedServer(config)
        try:
            serving = await server.start(sock)
        except BaseException:
            sock.close()
            raise
        self._server, self._socket = server, sock
        self.port = sock.getsockname()[1]
        self._tasks = [serving, asyncio.create_task(self._watch_loop(), name="chatstream-lag")]
        log.info("metrics and health on http://%s:%d/metrics", host, self.port)

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.request_stop()
        self._tasks[1].cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._socket is not None:
            self._socket.close()
        self._server = None

    async def _watch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            await asyncio.sleep(LAG_INTERVAL)
            self.lag = max(loop.time() - began - LAG_INTERVAL, 0.0)
            self.metrics.loop_lag.set(self.lag)

    async def not_ready(self) -> str | None:
        """Why the worker should get no traffic now, or None when it is ready."""
        if self.stopping.is_set():
            return "shutting down"
        if self.lag > MAX_LAG:
            return f"event loop lagging ({self.lag:.2f}s)"
        try:
            async with asyncio.timeout(PING_TIMEOUT):
                await self.redis.ping()
        except TimeoutError:
            where = redis_location(self.redis)
            return f"redis at {where} did not answer PING within {PING_TIMEOUT:g}s"
        except (RedisError, OSError) as exc:
            reason = str(exc)[:200] or "no detail"
            return (
                f"redis at {redis_location(self.redis)} unreachable: {type(exc).__name__}: {reason}"
            )
        if (problem := self.cannot_consume()) is not None:
            return f"cannot read the queue: {problem[:200]}"
        return None

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/metrics":
            await self._metrics_app(scope, receive, send)
        elif path == "/healthz":
            await _send_json(send, 200, {"status": "ok", "loop_lag_seconds": self.lag})
        elif path == "/readyz":
            reason = await self.not_ready()
            body = {"ready": True} if reason is None else {"ready": False, "reason": reason}
            await _send_json(send, 200 if reason is None else 503, body)
        else:
            await _send_json(send, 404, {"error": f"no route {path}"})


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
