"""What a process runs with, said without secrets: the start-up line, Redis locations.

``runtime_choices()`` is the one place that reports the event loop and the Redis reply
parser in use (asyncio or uvloop; redis-py's Python parser or hiredis), so the start-up
line says what a worker actually runs on. ``startup_summary()`` is that line: Redis
(host, db, TLS; never the password), the key prefix, the upstreams by name and URL (never
their keys or headers), concurrency, lease, event loop, parser and HTTP transport.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool

from worker.settings import DEFAULT_UPSTREAM, Settings
from worker.speedups import chosen_transport
from worker.store.redis_client import RedisClient, is_fake
from worker.urls import parse_redis_url, redacted_url


def redis_location(redis: RedisClient) -> str:
    """``host:port/db`` (or the socket path) of a client, from its pool's settings; the
    nodes of a cluster; the service of a Sentinel-managed client."""
    if isinstance(redis, RedisCluster):
        nodes = redis.get_primaries() or redis.startup_nodes
        return "cluster " + ",".join(f"{node.host}:{node.port}" for node in nodes)
    pool = redis.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        return f"sentinel service {pool.service_name}"
    kwargs: dict[str, Any] = getattr(pool, "connection_kwargs", {})
    db = kwargs.get("db", 0)
    if "path" in kwargs:
        return f"unix:{kwargs['path']}/{db}"
    return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{db}"


@dataclass(frozen=True, slots=True)
class RuntimeChoices:
    event_loop: str  # "asyncio" or "uvloop" (the running loop's implementation)
    redis_parser: str  # "hiredis", "python" (redis-py's own) or "fakeredis"


def runtime_choices(redis: RedisClient) -> RuntimeChoices:
    """The event loop this code runs on and the reply parser ``redis`` uses.

    Call it inside the running loop. The parser is the connection class's ``parser_class``
    (redis-py picks hiredis when it is installed, unless told otherwise).
    """
    loop_module = type(asyncio.get_running_loop()).__module__
    event_loop = "asyncio" if loop_module.startswith("asyncio") else loop_module.split(".")[0]
    return RuntimeChoices(event_loop, _parser_name(redis))


def _parser_name(redis: RedisClient) -> str:
    from redis.asyncio.connection import DefaultParser

    if is_fake(redis):
        return "fakeredis"
    if isinstance(redis, RedisCluster):  # the cluster client takes redis-py's default
        parser = DefaultParser
    else:
        parser = redis.connection_pool.connection_kwargs.get("parser_class", DefaultParser)
    return "hiredis" if "hiredis" in parser.__name__.lower() else "python"


def _redis_description(settings: Settings, redis: RedisClient) -> str:
    """Where Redis is, as configured: ``[kind ][user@]nodes[ service=...] tls=...``; a
    one-server URL that :func:`worker.store.redis_client.connect` found to be a cluster node is
    described as the cluster it is."""
    parsed = parse_redis_url(settings.redis_url)
    url = urlsplit(parsed.url)
    if url.scheme == "unix":
        return f"unix:{url.path}"
    db = url.path.strip("/") or "0"
    user = f"{url.username}@" if url.username else ""
    tls = "on" if parsed.tls else "off"
    if parsed.kind == "single" and not isinstance(redis, RedisCluster):
        return f"{user}{url.hostname}:{url.port or 6379}/{db} tls={tls}"
    nodes = parsed.nodes or ((url.hostname or "localhost", url.port or 6379),)
    service = f" service={parsed.service}/{db}" if parsed.kind == "sentinel" else ""
    kind = "sentinel" if parsed.kind == "sentinel" else "cluster"
    return f"{kind} {user}{','.join(f'{host}:{port}' for host, port in nodes)}{service} tls={tls}"


def upstream_urls(settings: Settings) -> dict[str, str]:
    """Each configured upstream's base URL (passwords in a URL masked; keys never shown)."""
    return {name: redacted_url(settings.upstream(name).url) for name in settings.upstream_names()}


def default_upstream_unset(settings: Settings) -> bool:
    """The upstream ``default`` is the settings' built-in URL: nobody configured it."""
    return DEFAULT_UPSTREAM not in settings.upstreams and (
        "upstream_url" not in settings.model_fields_set
    )


def startup_summary(
    settings: Settings, redis: RedisClient, worker: str
) -> tuple[str, dict[str, Any]]:
    """The start-up line and the same facts as fields (for JSON logs)."""
    choices = runtime_choices(redis)
    upstreams = upstream_urls(settings)
    fields: dict[str, Any] = {
        "redis": _redis_description(settings, redis),
        "prefix": settings.prefix,
        "upstreams": upstreams,
        "concurrency": settings.concurrency,
        "lease_seconds": settings.lease_seconds,
        "event_loop": choices.event_loop,
        "redis_parser": choices.redis_parser,
        "http_transport": chosen_transport(settings),
    }
    shown = " ".join(f"{name}={url}" for name, url in upstreams.items())
    message = (
        f"worker {worker} started: redis {fields['redis']} prefix={settings.prefix} "
        f"upstreams: {shown} concurrency={settings.concurrency} "
        f"lease={settings.lease_seconds:g}s event_loop={choices.event_loop} "
        f"redis_parser={choices.redis_parser} http_transport={fields['http_transport']}"
    )
    return message, fields
