"""The gateway tests' running gateways (tests/helpers/gateway_env.py): ``gw`` with an
in-process worker, ``idle`` without one (jobs stay queued). A module that needs other
settings defines its own fixture of the same name."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from tests.helpers.gateway_env import GatewayEnv, running_gateway
from worker.settings import Settings
from worker.testing.mock_upstream import MockUpstream


@pytest.fixture
async def gw(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> AsyncIterator[GatewayEnv]:
    async with running_gateway(settings, redis, mock_upstream) as env:
        yield env


@pytest.fixture
async def idle(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> AsyncIterator[GatewayEnv]:
    """A gateway without any worker: jobs stay queued."""
    async with running_gateway(
        settings, redis, mock_upstream, worker=False, gateway_keepalive_seconds=0.2
    ) as env:
        yield env
