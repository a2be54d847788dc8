"""worker.speedups: uvloop and hiredis when installed, forced either way by a setting."""

from __future__ import annotations

import asyncio
import logging

import pytest
from redis._parsers import _AsyncHiredisParser, _AsyncRESP3Parser
from redis.asyncio import Redis

from tests.helpers.harness import chat
from worker import speedups
from worker.client import Client
from worker.errors import ConfigError
from worker.service.runtime import runtime_choices
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.redis_client import redis_from_settings
from worker.testing.mock_upstream import serve_mock

needs_uvloop = pytest.mark.skipif(not speedups.uvloop_installed(), reason="needs uvloop")
needs_hiredis = pytest.mark.skipif(not speedups.hiredis_installed(), reason="needs hiredis")


def test_auto_picks_what_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(_env_file=None)
    monkeypatch.setattr(speedups, "uvloop_installed", lambda: True)
    monkeypatch.setattr(speedups, "hiredis_installed", lambda: True)
    assert (speedups.chosen_loop(settings), speedups.chosen_parser(settings)) == (
        "uvloop",
        "hiredis",
    )
    monkeypatch.setattr(speedups, "uvloop_installed", lambda: False)
    monkeypatch.setattr(speedups, "hiredis_installed", lambda: False)
    assert (speedups.chosen_loop(settings), speedups.chosen_parser(settings)) == (
        "asyncio",
        "python",
    )
    assert speedups.loop_factory(settings) is None
    assert speedups.parser_class(settings) is _AsyncRESP3Parser


def test_forcing_what_is_missing_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(speedups, "uvloop_installed", lambda: False)
    monkeypatch.setattr(speedups, "hiredis_installed", lambda: False)
    settings = Settings(_env_file=None, event_loop="uvloop", redis_parser="hiredis")
    with pytest.raises(ConfigError, match=r"CHATSTREAM_EVENT_LOOP=uvloop.*not installed"):
        speedups.loop_factory(settings)
    with pytest.raises(ConfigError, match=r"CHATSTREAM_REDIS_PARSER=hiredis.*not installed"):
        speedups.parser_class(settings)


def test_forcing_asyncio_runs_asyncio() -> None:
    settings = Settings(_env_file=None, event_loop="asyncio")

    async def which() -> str:
        return runtime_choices(Redis()).event_loop

    assert speedups.run(which(), settings) == "asyncio"


@needs_uvloop
def test_auto_runs_uvloop_when_installed() -> None:
    settings = Settings(_env_file=None)

    async def which() -> str:
        return runtime_choices(Redis()).event_loop

    assert speedups.run(which(), settings) == "uvloop"


@pytest.mark.parametrize("parser", ["python", pytest.param("hiredis", marks=needs_hiredis)])
async def test_each_parser_talks_to_redis_and_replaces_bad_utf8(
    settings: Settings, parser: str
) -> None:
    config = settings.model_copy(update={"redis_parser": parser})
    redis = redis_from_settings(config)
    expected = _AsyncHiredisParser if parser == "hiredis" else _AsyncRESP3Parser
    assert isinstance(redis, Redis)
    assert redis.connection_pool.connection_kwargs["parser_class"] is expected
    assert runtime_choices(redis).redis_parser == parser
    key = f"{config.prefix}:bytes"
    try:
        await redis.set(key, b"ok \xff\xfe")
        assert await redis.get(key) == "ok \ufffd\ufffd"
        await redis.xadd(key + ":s", {"a": "1"})
        entries = await redis.xrange(key + ":s")
        assert [fields for _, fields in entries or []] == [{"a": "1"}]
    finally:
        await redis.delete(key, key + ":s")
        await redis.aclose()


@pytest.mark.parametrize("parser", ["python", pytest.param("hiredis", marks=needs_hiredis)])
async def test_a_worker_runs_a_job_and_logs_what_it_runs_on(
    settings: Settings, parser: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="chatstream")
    async with serve_mock(tokens=5) as url:
        config = settings.model_copy(update={"redis_parser": parser, "upstream_url": url})
        redis = redis_from_settings(config)
        worker = Worker(config, redis)
        await worker.startup()
        try:
            client = Client.from_settings(config, redis)
            job_id = await client.enqueue(chat("hi"))
            assert await worker.run_burst() == 1
            assert (await client.result(job_id, timeout=5)).status == "succeeded"
        finally:
            await worker.shutdown()
            await redis.aclose()
    loop = "uvloop" if "uvloop" in type(asyncio.get_running_loop()).__module__ else "asyncio"
    assert f"event_loop={loop} redis_parser={parser}" in caplog.text
