"""uvloop, hiredis and httptools: used when installed (``pip install 'chatstream[fast]'``).

They are the ecosystem's standard accelerators (uvicorn and redis-py ship them as
extras): uvloop is an event loop on libuv, hiredis parses Redis replies in C, httptools
parses HTTP responses in C (llhttp) under ``worker.upstream.transport``. Without them the worker
runs on asyncio, redis-py's pure-Python parser and httpx's own transport, the same code
either way. ``CHATSTREAM_EVENT_LOOP`` / ``CHATSTREAM_REDIS_PARSER`` /
``CHATSTREAM_HTTP_TRANSPORT`` (``auto``, the default, or one of the two) force a choice;
forcing one that is not installed is a configuration error. What a running process uses
(``worker.service.runtime.runtime_choices``, ``chosen_transport``) is in the worker's start-up line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from importlib.util import find_spec
from typing import Any, TypeVar

from worker import internals
from worker.errors import ConfigError
from worker.settings import Settings

T = TypeVar("T")


def uvloop_installed() -> bool:
    return find_spec("uvloop") is not None


def hiredis_installed() -> bool:
    from redis.utils import HIREDIS_AVAILABLE  # False for a hiredis redis-py cannot use

    return bool(HIREDIS_AVAILABLE)


def chosen_loop(settings: Settings) -> str:
    choice = settings.event_loop
    if choice == "auto":
        return "uvloop" if uvloop_installed() else "asyncio"
    if choice == "uvloop" and not uvloop_installed():
        raise ConfigError(
            "CHATSTREAM_EVENT_LOOP=uvloop, but uvloop is not installed "
            "(pip install 'chatstream[fast]')"
        )
    return choice


def chosen_parser(settings: Settings) -> str:
    choice = settings.redis_parser
    if choice == "auto":
        return "hiredis" if hiredis_installed() else "python"
    if choice == "hiredis" and not hiredis_installed():
        raise ConfigError(
            "CHATSTREAM_REDIS_PARSER=hiredis, but hiredis (>= 3.2) is not installed "
            "(pip install 'chatstream[fast]')"
        )
    return choice


def httptools_installed() -> bool:
    return find_spec("httptools") is not None


def environment_proxies() -> dict[str, str]:
    """The proxies the environment configures (what httpx would use), by scheme."""
    from urllib.request import getproxies

    return {k: v for k, v in getproxies().items() if k in ("http", "https", "all") and v}


def chosen_transport(settings: Settings) -> str:
    """``httptools`` (``worker.upstream.transport``) or ``httpx`` (httpx's own, on httpcore)."""
    choice = settings.http_transport
    if choice == "auto":
        usable = httptools_installed() and not environment_proxies()
        return "httptools" if usable else "httpx"
    if choice == "httptools" and not httptools_installed():
        raise ConfigError(
            "CHATSTREAM_HTTP_TRANSPORT=httptools, but httptools is not installed "
            "(pip install 'chatstream[fast]')"
        )
    if choice == "httptools" and environment_proxies():
        raise ConfigError(
            "CHATSTREAM_HTTP_TRANSPORT=httptools does not speak to proxies, and the "
            "environment configures one (HTTP_PROXY / HTTPS_PROXY / ALL_PROXY): use auto"
        )
    return choice


def loop_factory(settings: Settings) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop factory for ``asyncio.Runner`` (None: asyncio's default loop)."""
    if chosen_loop(settings) != "uvloop":
        return None
    import uvloop

    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], settings: Settings) -> T:
    """``asyncio.run(main)`` on the chosen event loop. A choice that cannot be made (uvloop
    forced but missing) closes ``main`` unstarted before the error leaves: the user reads
    the one-line error, not also Python's "coroutine was never awaited" warning."""
    try:
        factory = loop_factory(settings)
    except BaseException:
        main.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def parser_class(settings: Settings) -> type[Any]:
    """The redis-py reply parser for the chosen implementation (redis-py's own choice where
    its parser classes are not where they were: ``worker.internals``)."""
    choice = chosen_parser(settings)
    if not internals.available("redis-parsers"):
        from redis.asyncio.connection import DefaultParser

        return DefaultParser
    from redis._parsers import _AsyncHiredisParser, _AsyncRESP3Parser

    return _AsyncHiredisParser if choice == "hiredis" else _AsyncRESP3Parser
