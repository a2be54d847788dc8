"""Platforms (README, "Platforms"): without epoll (macOS) the worker runs without the wake-up
tick; on Windows the commands that run a worker say at start that they are not supported,
and the producers run."""

from __future__ import annotations

import importlib
import logging
import select
from typing import Any

import pytest

from tests.helpers.harness import chat
from worker.client import Client
from worker.service.ticks import tick_seconds
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.redis_client import RedisClient
from worker.testing.mock_upstream import MockUpstream

cli = importlib.import_module("worker.cli.main")  # (the package exports a function of that name)


async def test_without_epoll_a_worker_runs_its_jobs_without_the_tick(
    settings: Settings,
    redis: RedisClient,
    mock_upstream: tuple[MockUpstream, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delattr(select, "epoll", raising=False)  # macOS, Windows
    caplog.set_level(logging.INFO, logger="chatstream.worker")
    settings = settings.model_copy(update={"upstream_url": mock_upstream[1], "wake_tick_ms": 12})
    worker = Worker(settings, redis)
    assert not worker.ticks.on
    await worker.startup()
    try:
        client = Client.from_settings(settings, redis)
        job_id = await client.enqueue(chat())
        await worker.run_burst()
        assert (await client.get(job_id)).status == "succeeded"
        assert not worker.ticks.running and worker.ticks.sleeps == 0
    finally:
        await worker.shutdown()
    assert any("no epoll on" in r.getMessage() for r in caplog.records)
    assert tick_seconds(settings.model_copy(update={"wake_tick_ms": 0})) == 0


@pytest.mark.parametrize("command", ["worker", "gateway", "demo"])
def test_on_windows_the_worker_commands_say_they_are_not_supported(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli.sys, "platform", "win32")
    args = cli.build_parser().parse_args([command])
    assert cli.run_command(args) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"chatstream: error: `chatstream {command}` is not supported on Windows")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "argv",
    [["enqueue", "--model", "m", "--message", "hi"], ["tail", "j"], ["status", "j"],
     ["cancel", "j"], ["jobs"], ["stats"], ["dead"], ["mock-upstream"]],
)  # fmt: skip
def test_on_windows_the_producers_and_readers_run(argv: list[str]) -> None:
    args: Any = cli.build_parser().parse_args(argv)
    assert cli.not_supported_here(args, platform="win32") is None
    assert cli.not_supported_here(args, platform="linux") is None
