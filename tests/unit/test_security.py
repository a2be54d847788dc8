"""Security: jobs cannot choose URLs; API keys never reach Redis, logs or errors; Redis
with a password and with an ACL user works; Redis URLs are logged without passwords.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager

import pytest
from pydantic import SecretStr
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from schemas.events import EventType
from tests.helpers.extras import TRANSPORTS
from tests.helpers.harness import Harness, chat, custom_harness, inject
from tests.helpers.servers import AuthRedisServer, auth_server, free_port
from worker import logs
from worker.client import Client
from worker.errors import InvalidJobError
from worker.service.worker import Worker
from worker.settings import Settings, Upstream
from worker.store.redis_client import redis_from_settings
from worker.testing.mock_upstream import MockConfig, MockUpstream, expected_reply, serve_mock
from worker.urls import redacted_url

# -- a job names an upstream; it never chooses a URL --------------------------------------------

URL_FIELDS = ("url", "base_url", "api_base", "upstream", "upstream_url", "endpoint", "baseURL")


@pytest.fixture
async def trap() -> AsyncIterator[tuple[MockUpstream, str]]:
    """Another upstream the jobs point at: it must never be called."""
    app = MockUpstream()
    async with serve_mock(app=app) as url:
        yield app, url


async def test_url_fields_in_the_request_or_metadata_have_no_effect(
    harness: Harness, trap: tuple[MockUpstream, str]
) -> None:
    trap_app, trap_url = trap
    request = chat("hi", tokens=3)
    for name in URL_FIELDS:
        request[name] = trap_url
    request["extra_headers"] = {"Host": "evil.example"}
    metadata = {name: trap_url for name in URL_FIELDS}
    record = await harness.run(request, metadata=metadata)
    assert record.status == "succeeded"
    assert record.upstream == "default"
    assert record.content == expected_reply(chat("hi", tokens=3), harness.mock.config)
    assert sum(harness.mock.requests.values()) == 1
    assert sum(trap_app.requests.values()) == 0


@pytest.mark.parametrize("name", ["http://127.0.0.1:1/v1", "127.0.0.1:80", "default/../x", ""])
async def test_the_client_refuses_a_url_as_upstream(harness: Harness, name: str) -> None:
    with pytest.raises(InvalidJobError):
        await harness.client.enqueue(chat("hi"), upstream=name)


async def test_a_url_written_as_upstream_into_the_record_is_refused(
    harness: Harness, trap: tuple[MockUpstream, str]
) -> None:
    trap_app, trap_url = trap
    job_id = await inject(harness, {"request": json.dumps(chat("hi")), "upstream": trap_url})
    await harness.worker.run_burst()
    record = await harness.client.get(job_id)
    assert record.status == "failed"
    assert record.error is not None
    assert record.error["code"] == "unknown_upstream"
    assert sum(trap_app.requests.values()) == 0


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_server(on_connect: Handler) -> AsyncIterator[str]:
    """A loopback TCP server speaking whatever ``on_connect`` writes; yields its base URL."""
    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await server.wait_closed()


@asynccontextmanager
async def redirecting_server(location: str) -> AsyncIterator[str]:
    """An upstream that answers every request with a redirect to ``location``."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            f"HTTP/1.1 307 Temporary Redirect\r\nlocation: {location}/chat/completions\r\n"
            "content-length: 0\r\nconnection: close\r\n\r\n".encode()
        )
        await writer.drain()
        writer.close()

    async with raw_server(on_connect) as url:
        yield url


async def test_an_upstream_redirect_is_not_followed(
    harness: Harness, trap: tuple[MockUpstream, str]
) -> None:
    trap_app, trap_url = trap
    async with (
        redirecting_server(trap_url) as url,
        custom_harness(harness, upstream_url=url) as h,
    ):
        record = await h.run(chat("hi"))
    assert record.status == "failed"
    assert record.error is not None
    assert record.error["code"] == "upstream_terminal"
    assert record.error["status"] == 307
    assert sum(trap_app.requests.values()) == 0


def test_settings_accept_only_http_upstream_urls() -> None:
    for url in ("file:///etc/passwd", "ftp://x/v1", "gopher://x", "127.0.0.1:80/v1"):
        with pytest.raises(ValueError):
            Upstream(url=url)


# -- API keys never reach Redis, logs or error messages -------------------------------------


@asynccontextmanager
async def echo_server() -> AsyncIterator[str]:
    """A hostile upstream that echoes the request's Authorization header back (400)."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
        headers = {k.lower(): v for k, v in headers.items()}
        await reader.readexactly(int(headers.get("content-length", "0")))
        auth = headers.get("authorization", "")
        body = json.dumps({"error": {"message": f"bad credentials: {auth}"}}).encode()
        writer.write(
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
            + f"x-echo: {auth}\r\ncontent-length: {len(body)}\r\n".encode()
            + b"connection: close\r\n\r\n"
            + body
        )
        await writer.drain()
        writer.close()

    async with raw_server(on_connect) as url:
        yield url


async def redis_text(redis: Redis, prefix: str) -> str:
    """Every key name and value under the prefix, as one string."""
    parts: list[str] = []
    async for key in redis.scan_iter(match=f"{prefix}*"):
        parts.append(key)
        kind = await redis.type(key)
        if kind == "hash":
            parts.append(json.dumps(await redis.hgetall(key)))
        elif kind == "stream":
            parts.append(json.dumps(await redis.xrange(key)))
        elif kind == "zset":
            parts.append(json.dumps(await redis.zrange(key, 0, -1, withscores=True)))
        elif kind == "list":
            parts.append(json.dumps(await redis.lrange(key, 0, -1)))
        elif kind == "set":
            parts.append(json.dumps(sorted(await redis.smembers(key))))
        elif kind == "string":
            parts.append(str(await redis.get(key)))
        else:
            raise AssertionError(f"unexpected key type {kind!r} of {key!r}")
    return "\n".join(parts)


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every logger at DEBUG, httpx and httpcore (which log headers) included."""
    caplog.set_level(logging.DEBUG)
    for name in ("httpx", "httpcore", "chatstream", "redis", "uvicorn", "hpack"):
        caplog.set_level(logging.DEBUG, logger=name)
    yield caplog


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_api_keys_never_reach_redis_logs_or_errors(
    settings: Settings, redis: Redis, debug_logs: pytest.LogCaptureFixture, transport: str
) -> None:
    """Over both transports; httpx's own (httpcore) logs request headers at DEBUG."""
    token = uuid.uuid4().hex
    key, wrong, closed_key, echo_key = (f"sk-{n}-{token}" for n in ("live", "bad", "cl", "echo"))
    secrets = (key, wrong, closed_key, echo_key)
    app = MockUpstream(MockConfig(tokens=6, api_key=key))
    async with serve_mock(app=app) as url, echo_server() as echo_url:
        upstreams = {
            "wrongkey": Upstream(url=url, api_key=SecretStr(wrong)),
            "closed": Upstream(url=f"http://127.0.0.1:{free_port()}/v1", api_key=closed_key),
            "echo": Upstream(url=echo_url, api_key=SecretStr(echo_key)),
        }
        config = settings.model_copy(
            update={
                "upstream_url": url,
                "upstream_api_key": SecretStr(key),
                "upstreams": upstreams,
                "retry_attempts": 2,
                "http_transport": transport,
            }
        )
        production = io.StringIO()  # the handler `chatstream worker` installs
        handler = logs.build_handler(config.model_copy(update={"log_level": "DEBUG"}), production)
        logging.getLogger().addHandler(handler)
        worker = Worker(config, redis)
        client = Client.from_settings(config, redis)
        await worker.startup()
        try:
            jobs = {
                "ok": await client.enqueue(chat("a")),
                "500": await client.enqueue(chat("b", fault="http_500")),
                "midstream": await client.enqueue(chat("c", fault="midstream_error")),
                "401": await client.enqueue(chat("d"), upstream="wrongkey"),
                "refused": await client.enqueue(chat("e"), upstream="closed"),
                "echo": await client.enqueue(chat("f"), upstream="echo"),
            }
            await worker.run_burst()
        finally:
            await worker.shutdown()
            logging.getLogger().removeHandler(handler)
    records = {name: await client.get(job_id) for name, job_id in jobs.items()}
    assert records["ok"].status == "succeeded"  # the key was sent and accepted
    assert {name: r.status for name, r in records.items() if name != "ok"} == dict.fromkeys(
        ("500", "midstream", "401", "refused", "echo"), "failed"
    )
    assert records["401"].error is not None and records["401"].error["status"] == 401
    echoed = records["echo"].error
    assert echoed is not None and "[REDACTED]" in echoed["detail"]["message"]

    stored = await redis_text(redis, config.prefix)
    assert len(stored) > 1000
    # caplog's text is formatted as each record is emitted, before any other handler
    raw_logs = debug_logs.text
    assert "HTTP Request: POST" in raw_logs  # httpx (and httpcore) were really captured
    assert ("send_request_headers" in raw_logs) == (transport == "httpx")
    if transport == "httpx":
        assert "x-echo', b'Bearer ***'" in raw_logs  # httpcore logged the echoed key, masked
    for secret in secrets:
        assert secret not in stored
        assert secret not in raw_logs
        assert secret not in production.getvalue()


def test_settings_never_render_keys() -> None:
    config = Settings(
        _env_file=None,
        upstream_api_key="sk-secret-1",
        upstreams={"x": {"url": "http://h/v1", "api_key": "sk-secret-2"}},
    )
    rendered = repr(config) + str(config) + config.model_dump_json() + str(config.model_dump())
    assert "sk-secret-1" not in rendered
    assert "sk-secret-2" not in rendered


# -- Redis with a password and with an ACL user -----------------------------------------------

ACL_USER, ACL_PASSWORD, ACL_PREFIX = "chatstream", "acl-Secret-9", "acl-"


@pytest.fixture(scope="module")
def acl_server() -> Iterator[AuthRedisServer]:
    # the default user is off; ours may only touch keys and channels under its prefix
    rules = ("on", f">{ACL_PASSWORD}", f"~{ACL_PREFIX}*", f"&{ACL_PREFIX}*", "+@all")
    extra = ("--user", "default", "off", "--user", ACL_USER, *rules)
    with auth_server(f"{ACL_USER}:{ACL_PASSWORD}", *extra) as server:
        yield server


async def run_through(settings: Settings, prefix: str) -> None:
    """A job end to end (and a cancel) with worker and client on ``settings.redis_url``."""
    app = MockUpstream(MockConfig(tokens=5))
    async with serve_mock(app=app) as url:
        config = settings.model_copy(update={"upstream_url": url, "prefix": prefix})
        redis = redis_from_settings(config)
        worker = Worker(config, redis)
        client = Client.from_settings(config, redis)
        await worker.startup()
        try:
            record = await client.get(await client.enqueue(chat("auth")))
            assert record.status == "queued"
            await worker.run_burst()
            job_id = record.id
            assert (await client.result(job_id, timeout=5)).content == "tok0 tok1 tok2 tok3 tok4"
            slow = await client.enqueue(chat("slow", tokens=400, rate=20.0))
            burst = asyncio.create_task(worker.run_burst())
            async with asyncio.timeout(5):
                async for event in client.events(slow, block_ms=100):
                    if event.type is EventType.DELTA:
                        break
            assert await client.cancel(slow) == "requested"
            await burst
            assert (await client.get(slow)).status == "cancelled"
        finally:
            await worker.shutdown()
            await redis.aclose()


async def test_redis_with_a_password(password_server: AuthRedisServer, settings: Settings) -> None:
    await run_through(settings.model_copy(update={"redis_url": password_server.url}), "pw-x")
    anonymous = Redis.from_url(password_server.anonymous_url)
    with pytest.raises(AuthenticationError):
        await anonymous.ping()
    await anonymous.aclose()


async def test_redis_with_an_acl_user_limited_to_the_prefix(
    acl_server: AuthRedisServer, settings: Settings
) -> None:
    prefix = f"{ACL_PREFIX}{uuid.uuid4().hex[:8]}"
    await run_through(settings.model_copy(update={"redis_url": acl_server.url}), prefix)
    user = Redis.from_url(acl_server.url, decode_responses=True)
    with pytest.raises(NoPermissionError):  # the limit is real: other keys are refused
        await user.set("elsewhere", "1")
    assert await user.acl_whoami() == ACL_USER
    await user.aclose()
    anonymous = Redis.from_url(acl_server.anonymous_url)
    with pytest.raises((AuthenticationError, ResponseError)):
        await anonymous.get(f"{prefix}:queue")
    await anonymous.aclose()


# -- Redis URLs are never shown with their password -------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://user:pw@h:6379/0", "redis://user:***@h:6379/0"),
        ("redis://user@h:6379/0", "redis://user@h:6379/0"),
        (
            "rediss://u:p%40ss@h:6380/0?ssl_ca_certs=/ca.pem",
            "rediss://u:***@h:6380/0?ssl_ca_certs=/ca.pem",
        ),
        ("redis://u:p@ss@h/0", "redis://u:***@h/0"),
        ("redis://h:6379/0?password=pw", "redis://h:6379/0?password=***"),
        (
            "redis://h/0?db=1&password=pw&ssl_password=k",
            "redis://h/0?db=1&password=***&ssl_password=***",
        ),
        ("unix://:pw@/run/redis.sock?db=0", "unix://:***@/run/redis.sock?db=0"),
        ("unix:///run/redis.sock?password=pw", "unix:///run/redis.sock?password=***"),
    ],
)
def test_redacted_url(url: str, shown: str) -> None:
    assert redacted_url(url) == shown
