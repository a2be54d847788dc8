"""The peer for ``bench/bench_worker.py``: what users write today.

An `arq <https://arq-docs.helpmanual.io/>`_ task streams a chat completion with the
official ``openai`` SDK (``AsyncOpenAI(base_url=...)``, ``stream=True``,
``stream_options={"include_usage": True}``) and XADDs every content delta to a per-job
Redis Stream, one XADD per token chunk, then a terminal entry. Nothing is coalesced,
fenced or pipelined; the job's result (content and usage) is arq's job result.

It runs under its own virtual environment (``bench/.peer-venv``, built by the benchmark:
arq pins redis-py < 6) and must not import chatstream. Commands::

    python bench/peer_arq.py worker  --redis URL --upstream URL --max-jobs N [--prefix P]
    python bench/peer_arq.py enqueue --redis URL --jobs FILE.json [--ramp SECONDS]

``enqueue`` reads ``[{"id": ..., "body": {...}}, ...]``, enqueues every job at once and
prints ``{"first": t, "last": t}`` (``time.time()`` around the enqueue calls) as JSON.
Stream entries: ``{type: delta, content: <text>}`` per chunk, then ``{type: done, usage}``
or ``{type: error, error}``; the key is ``<prefix>:{<job id>}:events``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from arq import create_pool
from arq.connections import ArqRedis, RedisSettings
from arq.worker import Worker

RETENTION_SECONDS = 86_400


def events_key(prefix: str, job_id: str) -> str:
    return f"{prefix}:{{{job_id}}}:events"


async def stream_chat(ctx: dict[str, Any], job_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """The arq task: stream the reply, one XADD per content chunk, then a terminal entry."""
    redis: ArqRedis = ctx["redis"]
    key = events_key(ctx["prefix"], job_id)
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        stream = await ctx["openai"].chat.completions.create(
            model=body["model"],
            messages=body["messages"],
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"mock": body.get("mock", {})},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
            if chunk.choices and chunk.choices[0].delta.content:
                text = chunk.choices[0].delta.content
                parts.append(text)
                await redis.xadd(key, {"type": "delta", "content": text})
    except Exception as exc:
        await redis.xadd(key, {"type": "error", "error": repr(exc)})
        await redis.expire(key, RETENTION_SECONDS)
        raise
    await redis.xadd(key, {"type": "done", "usage": json.dumps(usage)})
    await redis.expire(key, RETENTION_SECONDS)
    return {"content": "".join(parts), "usage": usage}


def run_worker(args: argparse.Namespace) -> None:
    from openai import AsyncOpenAI

    async def startup(ctx: dict[str, Any]) -> None:
        ctx["prefix"] = args.prefix
        ctx["openai"] = AsyncOpenAI(base_url=args.upstream, api_key="bench")

    async def shutdown(ctx: dict[str, Any]) -> None:
        await ctx["openai"].close()

    worker = Worker(
        functions=[stream_chat],
        redis_settings=RedisSettings.from_dsn(args.redis),
        max_jobs=args.max_jobs,
        poll_delay=args.poll_delay,
        on_startup=startup,
        on_shutdown=shutdown,
        job_timeout=600,
    )
    worker.run()


async def enqueue(args: argparse.Namespace, jobs: list[dict[str, Any]]) -> None:
    """Enqueue the jobs evenly over ``--ramp`` seconds (0: all at once), as the benchmark's
    ``spread`` does for chatstream: up to 250 slices."""
    pool = await create_pool(RedisSettings.from_dsn(args.redis))
    slices = min(len(jobs), 250) if args.ramp > 0 else 1
    size = -(-len(jobs) // slices)
    first = time.time()
    for i in range(slices):
        await asyncio.gather(
            *(
                pool.enqueue_job("stream_chat", job["id"], job["body"], _job_id=job["id"])
                for job in jobs[i * size : (i + 1) * size]
            )
        )
        await asyncio.sleep(max(0.0, first + args.ramp * (i + 1) / slices - time.time()))
    last = time.time()
    await pool.aclose()
    print(json.dumps({"first": first, "last": last}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--redis", required=True)
    w.add_argument("--upstream", required=True, help="base URL ending in /v1")
    w.add_argument("--max-jobs", type=int, default=256)
    w.add_argument("--poll-delay", type=float, default=0.05)
    w.add_argument("--prefix", default="peer")
    e = sub.add_parser("enqueue")
    e.add_argument("--redis", required=True)
    e.add_argument("--jobs", required=True, help="JSON file: [{id, body}, ...]")
    e.add_argument("--ramp", type=float, default=0.0, help="spread over this many seconds")
    args = parser.parse_args(argv)
    if args.command == "worker":
        run_worker(args)
    else:
        asyncio.run(enqueue(args, json.loads(Path(args.jobs).read_text())))


if __name__ == "__main__":
    main(sys.argv[1:])
