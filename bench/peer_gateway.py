"""The peer for bench_gateway.py: an SSE endpoint as it is usually written.

One blocking ``XREAD`` per HTTP client (a Redis connection each, held while the client is
connected), Starlette's ``StreamingResponse``, the same OpenAI chunk formatting and the
same uvicorn as the gateway. No auth, no limits: only the read strategy differs.

    python bench/peer_gateway.py PORT REDIS_URL PREFIX
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from worker.embedded_server import bind
from worker.gateway import openai_format as fmt
from worker.store.keys import Keys

TERMINAL = frozenset({"done", "error", "cancelled"})


def app(redis: Redis, keys: Keys) -> Starlette:
    async def events(request: Request) -> StreamingResponse:
        job_id = request.path_params["job_id"]
        _, metadata = await redis.hmget(keys.job(job_id), ["status", "metadata"])
        meta = json.loads(metadata or "{}")
        ctx = fmt.ChunkContext(job_id, int(meta.get("created", 0)), str(meta.get("model")), False)
        after = request.headers.get("last-event-id", "0-0")
        return StreamingResponse(
            frames(keys.events(job_id), after, ctx), media_type="text/event-stream"
        )

    async def frames(key: str, cursor: str, ctx: fmt.ChunkContext) -> AsyncIterator[bytes]:
        while True:
            reply: Any = await redis.xread({key: cursor}, count=100, block=5_000)
            if not reply:
                yield fmt.KEEPALIVE_FRAME
                continue
            rows = reply[0][1]
            cursor = rows[-1][0]
            yield fmt.sse_frames(ctx, rows)
            if rows[-1][1].get("type") in TERMINAL:
                return

    return Starlette(routes=[Route("/v1/jobs/{job_id}/events", events)])


async def main(port: int, redis_url: str, prefix: str) -> None:
    redis = Redis.from_url(
        redis_url, decode_responses=True, socket_timeout=15, max_connections=100_000
    )
    config = uvicorn.Config(
        app(redis, Keys(prefix)), log_level="warning", access_log=False, lifespan="off"
    )
    await uvicorn.Server(config).serve(sockets=[bind("127.0.0.1", port, backlog=4096)])


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
