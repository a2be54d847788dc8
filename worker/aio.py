"""Small asyncio helpers shared by the worker's long-running tasks, and the set of sockets
whose news ends a wake-up tick's sleep (``URGENT``, ``worker.service.ticks``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import time
from collections.abc import Iterator
from typing import Any, Protocol, TypeVar

C = TypeVar("C")


_MIXED: dict[tuple[type[Any], type[Any]], type[Any]] = {}


def mixed_in(mixin: type[Any], cls: type[C], prefix: str) -> type[C]:
    """``cls`` with ``mixin`` in front (made once per pair; ``cls`` itself if it has it)."""
    if issubclass(cls, mixin):
        return cls
    if (mixin, cls) not in _MIXED:
        _MIXED[mixin, cls] = type(f"{prefix}{cls.__name__}", (mixin, cls), {})
    return _MIXED[mixin, cls]


async def cancel_and_wait(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel the tasks and wait for them, cancelling again any that ignored it: on Python
    3.11, ``asyncio.wait_for`` (redis-py wraps socket writes in it) swallows a cancellation
    that races the write's completion, and the task would then block in its next read."""
    while pending := [task for task in tasks if not task.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.1)
    await asyncio.gather(*tasks, return_exceptions=True)


HURRY_TICK = 0.001  # the longest sleep while a connection is being made (URGENT.hurry)


class HasFileno(Protocol):
    def fileno(self) -> int: ...


class UrgentSockets:
    """The sockets whose events end a tick's sleep at once.

    An edge-triggered epoll set of the process's own (the event loop's poll still watches
    every socket): news on one of these while the loop sleeps out a tick wakes it, news on
    any other waits for the tick's end. A closed socket leaves the set by itself. While a
    connection is being made (``hurry``: its socket is not known yet, and its connect and
    TLS handshake are a chain of hops), a sleep lasts at most ``HURRY_TICK``.

    Dormant until a worker whose tick is on calls :meth:`start` (``watch`` does nothing
    before), so a process that only imports and uses the client gets no epoll set and no
    fork hook (issue 37); the last :meth:`stop` closes the set."""

    EVENTS = getattr(select, "EPOLLIN", 0) | getattr(select, "EPOLLET", 0)

    def __init__(self) -> None:
        self._epoll: Any = None  # select.epoll while started (None: dormant, or not Linux)
        self._hurrying = 0
        self._users = 0

    @staticmethod
    def possible() -> bool:
        """This platform has epoll (Linux): elsewhere there is no set, and no tick."""
        return hasattr(select, "epoll")

    def start(self) -> bool:
        """Make the set (one per worker that runs a tick; idempotent); False without epoll."""
        if not self.possible():
            return False
        if self._epoll is None:
            self._epoll = select.epoll()
            _reset_in_forked_children()
        self._users += 1
        return True

    def stop(self) -> None:
        """One :meth:`start` less; the last closes the set."""
        self._users = max(0, self._users - 1)
        if self._users == 0 and self._epoll is not None:
            self._epoll.close()
            self._epoll = None

    @property
    def started(self) -> bool:
        return self._epoll is not None

    def watch(self, sock: HasFileno | None) -> None:
        epoll = self._epoll
        if epoll is None or sock is None:
            return
        with contextlib.suppress(OSError, ValueError):  # already watched, or closed
            epoll.register(sock.fileno(), self.EVENTS)

    def forget(self, sock: HasFileno | None) -> None:
        if self._epoll is None or sock is None:
            return
        with contextlib.suppress(OSError, ValueError):  # not watched, or closed
            self._epoll.unregister(sock.fileno())

    def watching(self, sock: HasFileno) -> bool:
        """Whether ``sock`` is in the set (for tests: it re-arms the socket's edge)."""
        if self._epoll is None:
            return False
        try:
            self._epoll.modify(sock.fileno(), self.EVENTS)
        except (OSError, ValueError):
            return False
        return True

    @property
    def hurrying(self) -> bool:
        return self._hurrying > 0

    @contextlib.contextmanager
    def hurry(self) -> Iterator[None]:
        self._hurrying += 1
        try:
            yield
        finally:
            self._hurrying -= 1

    def sleep(self, seconds: float) -> None:
        """Up to ``seconds``: until then, or until news on a watched socket."""
        if self._hurrying:
            seconds = min(seconds, HURRY_TICK)
        if self._epoll is None:
            time.sleep(seconds)
        else:
            self._epoll.poll(seconds, 64)

    def reset(self) -> None:
        """A forked child starts dormant (the parent's set is shared, not its own)."""
        if self._epoll is not None:
            self._epoll.close()  # the child's descriptor only: the parent's set lives on
        self._epoll, self._hurrying, self._users = None, 0, 0


URGENT = UrgentSockets()
_FORK_HOOK: list[bool] = []  # registered (once, and only once a set was made)


def _reset_in_forked_children() -> None:
    if not _FORK_HOOK and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=URGENT.reset)
        _FORK_HOOK.append(True)


def socket_of(transport: Any) -> HasFileno | None:
    """The socket under an asyncio or uvloop transport (None: closed or none)."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock if sock is not None and sock.fileno() >= 0 else None
