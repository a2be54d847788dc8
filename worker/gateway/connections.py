"""The gateway's HTTP connections: uvicorn's protocol with a bound on the request head, and
a way for a response to abort its own connection.

uvicorn closes an idle keep-alive connection (``timeout_keep_alive``) but sets no timer on a
request head that arrives slowly: its keep-alive timer is cancelled by the first byte and
none is set on a new connection at all, so a client that trickles its head a byte at a time
holds a connection (and a file descriptor) for as long as it likes. ``HeadTimeout`` closes a
connection whose request head is not complete ``head_timeout`` seconds after the server
began to wait for it (a new connection, or the previous response's end); a complete head
cancels the timer, whatever the body then does.

``Connections`` holds every open connection's transport by its (server, client) address,
so that ``abort(scope)`` can drop a connection whose client stopped reading: an aborted
transport frees its buffer at once, where ``close()`` would keep it until the client reads
it (docs/decisions.md, 58).
"""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, cast

from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is an extra: uvicorn's h11 protocol serves without it
    HttpToolsProtocol = None  # type: ignore[assignment, misc]

from worker import internals

Address = tuple[Any, Any]

if TYPE_CHECKING:
    _Base = H11Protocol
else:
    _Base = object


class Connections:
    """The open connections' transports by ``(server, client)`` address."""

    def __init__(self) -> None:
        self._open: dict[Address, asyncio.Transport] = {}
        self.heads_timed_out = 0

    def add(self, address: Address, transport: asyncio.Transport) -> None:
        self._open[address] = transport

    def discard(self, address: Address) -> None:
        self._open.pop(address, None)

    def __len__(self) -> int:
        return len(self._open)

    def abort(self, scope: MutableMapping[str, Any]) -> bool:
        """Drop the connection of the request ``scope`` at once (its unsent bytes with it);
        False when it is not known (closed already)."""
        server, client = scope.get("server"), scope.get("client")
        transport = self._open.get((_address(server), _address(client)))
        if transport is None or transport.is_closing():
            return False
        transport.abort()
        return True


def _address(value: Any) -> Any:
    return tuple(value) if isinstance(value, list | tuple) else value


class HeadTimeout(_Base):
    """Mixed into uvicorn's HTTP protocol (h11 or httptools; see ``protocol_class``)."""

    head_timeout: float = 10.0
    registry: Connections
    _head_timer: asyncio.TimerHandle | None = None
    _head_cycle: Any = None
    _address: Address | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._address = (_address(self.server), _address(self.client))
        self.registry.add(self._address, transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._head_cycle:
            self._stop_head_timer()  # a head is complete: a new request cycle began

    def on_response_complete(self) -> None:
        super().on_response_complete()
        cycle = self.cycle
        if not self.transport.is_closing() and cycle is not None and cycle.response_complete:
            self._await_head()  # idle: the next request's head is due (pipelined: it came)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        if self._address is not None:
            self.registry.discard(self._address)
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._stop_head_timer()
        self._head_cycle = self.cycle
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.cycle is self._head_cycle and not self.transport.is_closing():
            self.registry.heads_timed_out += 1
            self.transport.abort()


def protocol_class(
    head_timeout: float, registry: Connections, *, implementation: str = "auto"
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools when installed, else h11; or as named) with the
    head timeout and ``registry``; uvicorn's own protocol where its internals moved
    (``worker.internals``)."""
    base: type[Any] = H11Protocol
    if implementation != "h11" and HttpToolsProtocol is not None:
        base = HttpToolsProtocol
    if not internals.available("uvicorn-protocols"):
        return cast("type[asyncio.Protocol]", base)
    attributes = {"head_timeout": head_timeout, "registry": registry}
    return type(f"HeadTimeout{base.__name__}", (HeadTimeout, base), attributes)
