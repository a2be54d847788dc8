"""Live reads of many jobs' events streams through one Redis reader per gateway process.

Every open event stream of the gateway needs its job's entries as they are written.
Rather than one blocking ``XREAD`` per HTTP client (a Redis connection each, held for the
whole reply), one ``EventHub`` task reads every followed stream with one multi-key
``XREAD BLOCK`` and hands the entries to the clients following each job. A client
(``JobFeed``) first catches up with ``XRANGE``, which costs the hub nothing, then follows:

* No gap, no duplicate: ``follow()`` runs without awaiting. When the hub already reads the
  job past the client's cursor, the client reads that gap with ``XRANGE`` itself; entries
  the hub hands it at or before its cursor are dropped.
* A slow client never holds anyone up: the hub appends to the client's own buffer and
  never waits for it, and holds at most ``max_bytes`` (``CHATSTREAM_GATEWAY_CLIENT_BUFFER_
  BYTES``) and ``max_backlog`` entries for it, counting the batch its stream is writing.
  A client with entries waiting that would pass them is dropped: its feed raises
  ClientTooSlow and the client resumes from its last event id (docs/decisions.md, 58; a
  feed made with ``drop_when_behind=False`` reads the gap from Redis instead). A client
  with nothing waiting whose one read is larger gets the first entries within the bounds
  and reads the rest from Redis, in pages, at its own pace, before it follows again.
* Replayed history is read in pages sized to ``max_bytes`` from the entries seen so far.
* A newly followed job wakes the hub's blocked read: an ``XADD`` to the hub's own wake
  stream (a key under the prefix, so an ACL user limited to the prefix works).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from worker.aio import cancel_and_wait
from worker.errors import JobNotFoundError
from worker.retry import REDIS_WAIT, often_enough, pause
from worker.store.keys import Keys
from worker.store.redis_client import RedisClient, stream_replies

log = logging.getLogger("chatstream.gateway")

Row = tuple[str, dict[str, str]]
TERMINAL_TYPES = frozenset({"done", "error", "cancelled"})
RANGE_COUNT = 500  # entries per XRANGE page, at most
FIRST_GUESS_ROW_BYTES = 2_048  # a history page's first size: max_bytes / this (then measured)
READ_COUNT = 500  # entries per stream per XREAD
WAKE_TTL_SECONDS = 3600
# Successive XREADs start at least this far apart. An idle hub is blocked in XREAD and
# hands an entry on at once; a busy one gets many entries per read instead of one (each
# read re-sends every followed key and costs a round trip): at most this much added delay.
MIN_READ_INTERVAL = 0.005


# what a row costs beyond its text: the tuple, the dict and the str objects (CPython, 64-bit)
ROW_OVERHEAD = 400


class Behind:
    """Set when a live feed's client fell more than its byte bound behind. The stream
    waits on it beside its writes: a client that reads nothing blocks the write, so the
    feed alone would never get to raise ClientTooSlow."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.waiting = 0

    def fell_behind(self, waiting: int) -> None:
        self.waiting = waiting
        self.event.set()

    def error(self) -> ClientTooSlow:
        return ClientTooSlow(self.waiting)


class ClientTooSlow(Exception):
    """A live feed's client fell more than its byte bound behind: drop it (it resumes)."""

    def __init__(self, waiting: int) -> None:
        super().__init__(f"{waiting} bytes were waiting for a client that did not read them")
        self.waiting = waiting


def rows_size(rows: list[Row]) -> int:
    """About how many bytes ``rows`` hold in memory."""
    size = 0
    for entry_id, fields in rows:
        size += ROW_OVERHEAD + len(entry_id) + sum(len(k) + len(v) for k, v in fields.items())
    return size


def id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def is_terminal(row: Row) -> bool:
    return row[1].get("type") in TERMINAL_TYPES


def _bulk(text: str) -> bytes:
    data = text.encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


class ReadCommand:
    """``XREAD COUNT c BLOCK ms STREAMS <keys> <ids>``, packed by hand and kept up to date.

    redis-py builds and packs the arguments anew for every call, about 2 us per key: with
    thousands of followed jobs and a read every few milliseconds that alone is more than a
    core. Here each key and id is encoded once, when it changes, and a read joins them.
    """

    def __init__(self, count: int, block_ms: int) -> None:
        self.block_ms = block_ms
        self.count = 0
        self._options = b""
        self.set_count(count)
        self._keys: dict[str, bytes] = {}  # both dicts share one order: keys and ids align
        self._ids: dict[str, bytes] = {}

    def set_count(self, count: int) -> None:
        """Entries per stream per read, at most."""
        if count != self.count:
            self.count = count
            parts = ("XREAD", "COUNT", str(count), "BLOCK", str(self.block_ms))
            self._options = b"".join(_bulk(part) for part in parts)

    def set(self, key: str, entry_id: str) -> None:
        if key not in self._keys:
            self._keys[key] = _bulk(key)
        self._ids[key] = _bulk(entry_id)

    def drop(self, key: str) -> None:
        del self._keys[key], self._ids[key]

    def packed(self) -> bytes:
        head = b"*%d\r\n" % (6 + 2 * len(self._keys))
        keys, ids = b"".join(self._keys.values()), b"".join(self._ids.values())
        return b"".join((head, self._options, b"$7\r\nSTREAMS\r\n", keys, ids))


def _rows(entries: Any) -> list[Row]:
    """A raw XREAD stream's entries ``[id, [field, value, ...]]`` as rows."""
    rows: list[Row] = []
    for entry_id, fields in entries:
        flat = fields or []
        rows.append((entry_id, dict(zip(flat[::2], flat[1::2], strict=True))))
    return rows


class Follower:
    """One client's place in the hub: the entries handed to it, not yet taken."""

    __slots__ = (
        "backlog", "behind", "dropped", "gap_end", "in_flight", "key", "overflowed", "ready",
        "size",
    )  # fmt: skip

    def __init__(self, key: str) -> None:
        self.key = key
        self.backlog: list[Row] = []
        self.size = 0  # bytes of the backlog
        self.in_flight = 0  # bytes of the batch taken last, until the client's stream wrote it
        self.ready = asyncio.Event()
        self.overflowed = False  # the hub hands it nothing more
        self.dropped = False  # ... because its client is not keeping up
        self.behind: Behind | None = None  # told when it is dropped
        self.gap_end: str | None = None

    @property
    def waiting(self) -> int:
        return self.size + self.in_flight

    def take(self, after: str) -> list[Row]:
        """The buffered entries after ``after``, in order."""
        rows, self.backlog = self.backlog, []
        self.in_flight, self.size = self.size, 0
        self.ready.clear()
        if rows and id_tuple(rows[0][0]) <= id_tuple(after):
            cursor = id_tuple(after)
            rows = [row for row in rows if id_tuple(row[0]) > cursor]
        return rows


class EventHub:
    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        *,
        block_ms: int = 2_000,
        max_backlog: int = 2_000,
        max_bytes: int = 262_144,
        min_interval: float = MIN_READ_INTERVAL,
    ) -> None:
        self.redis = redis
        self.block_ms = block_ms
        self.min_interval = min_interval
        self.max_backlog = max_backlog
        self.max_bytes = max_bytes
        self.wake_key = keys.gateway_wake(uuid.uuid4().hex[:16])
        self._last: dict[str, str] = {}  # followed key -> the last entry id the hub read
        self._row_bytes = float(FIRST_GUESS_ROW_BYTES)  # what an entry costs, lately
        self._command = ReadCommand(self.read_count(), block_ms)
        self._command.set(self.wake_key, "0-0")
        self._connection: Any = None  # the hub's own: its XREAD blocks
        self._followers: dict[str, set[Follower]] = {}
        self._reading = False
        self._wake_sent = False
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def followed(self) -> int:
        return len(self._last)

    def follow(self, key: str, cursor: str) -> Follower:
        """Hand ``key``'s entries after ``cursor`` to a new follower from now on."""
        follower = Follower(key)
        last = self._last.get(key)
        if last is None:
            self._last[key] = cursor
            self._command.set(key, cursor)
            self._followers[key] = {follower}
            self._wake()
        else:
            self._followers[key].add(follower)
            if id_tuple(last) > id_tuple(cursor):
                follower.gap_end = last
        return follower

    def unfollow(self, follower: Follower) -> None:
        followers = self._followers.get(follower.key)
        if followers is None:
            return
        followers.discard(follower)
        if not followers:
            del self._followers[follower.key]
            del self._last[follower.key]
            self._command.drop(follower.key)

    async def run(self) -> None:
        """Read and hand out entries until cancelled; Redis errors are retried."""
        loop = asyncio.get_running_loop()
        started, failures = 0.0, 0
        while True:
            if not self._last:
                self._changed.clear()
                await self._changed.wait()
                continue
            early = started + self.min_interval - loop.time()
            if early > 0:
                await asyncio.sleep(early)
            started = loop.time()
            try:
                await self._read_once()
                failures = 0
            except RedisError as exc:
                failures += 1
                if often_enough(failures):
                    log.warning("gateway: reading job streams failed (%s); retrying", exc)
                await asyncio.sleep(pause(REDIS_WAIT, failures))

    async def _read_once(self) -> None:
        before = dict(self._last)
        self._reading, self._wake_sent = True, False
        try:
            reply = await self._xread(self._command.packed())
        finally:
            self._reading = False
        for key, entries in stream_replies(reply):
            if key == self.wake_key:
                self._command.set(key, entries[-1][0])
            elif entries and key in before and self._last.get(key) == before[key]:
                self._deliver(key, _rows(entries))  # (unless unfollowed or re-followed)
        self._command.set_count(self.read_count())

    def read_count(self) -> int:
        """Entries per stream per read: about ``max_bytes`` of the entries seen lately (a
        client takes no more from one read; more would be read again from Redis)."""
        return max(1, min(READ_COUNT, self.max_bytes // max(1, int(self._row_bytes))))

    async def _xread(self, packed: bytes) -> Any:
        """One XREAD on the hub's own connection (made like the pool's, reconnected after
        any failure); the reply as Redis sent it."""
        connection = self._connection
        if connection is None:
            assert isinstance(self.redis, Redis)  # ClusterEventHub reads per job
            pool = self.redis.connection_pool
            connection = self._connection = pool.connection_class(**pool.connection_kwargs)
        try:
            if not connection.is_connected:  # connect(): a Sentinel's finds the master
                await connection.connect()
            await connection.send_packed_command(packed)
            return await connection.read_response()
        except BaseException:
            self._connection = None
            with contextlib.suppress(Exception):
                await connection.disconnect()
            raise

    def _deliver(self, key: str, rows: list[Row]) -> None:
        self._last[key] = rows[-1][0]
        self._command.set(key, rows[-1][0])
        size = rows_size(rows)  # the rows are shared by the job's followers
        self._row_bytes += (size / len(rows) - self._row_bytes) / 8  # a moving average
        for follower in list(self._followers[key]):
            if follower.waiting + size <= self.max_bytes and (
                len(follower.backlog) + len(rows) <= self.max_backlog
            ):
                follower.backlog.extend(rows)
                follower.size += size
            elif follower.backlog or follower.in_flight:
                self._drop(follower, size)  # it is not keeping up: behind
            else:
                self._hand_part(follower, rows)  # it keeps up, but this read is too large
            follower.ready.set()

    def _drop(self, follower: Follower, size: int) -> None:
        follower.overflowed = follower.dropped = True
        follower.size = follower.waiting + size  # (what it would have had waiting)
        follower.backlog = []
        self.unfollow(follower)
        if follower.behind is not None:
            follower.behind.fell_behind(follower.size)

    def _hand_part(self, follower: Follower, rows: list[Row]) -> None:
        """The first rows within the bounds (one at least), and no more from the hub: the
        feed reads the rest from Redis, at its client's pace, then follows again."""
        taken: list[Row] = []
        size = 0
        for row in rows:
            row_size = rows_size([row])
            if taken and (size + row_size > self.max_bytes or len(taken) >= self.max_backlog):
                break
            taken.append(row)
            size += row_size
        follower.backlog, follower.size = taken, size
        follower.overflowed = True
        self.unfollow(follower)

    def _wake(self) -> None:
        self._changed.set()
        if self._reading and not self._wake_sent:
            self._wake_sent = True
            task = asyncio.create_task(self._send_wake())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send_wake(self) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self.wake_key, {"w": "1"}, maxlen=1, approximate=False)
                pipe.expire(self.wake_key, WAKE_TTL_SECONDS)
                await pipe.execute()
        except RedisError as exc:  # the blocked read ends by itself within block_ms
            log.warning("gateway: waking the stream reader failed (%s)", exc)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._connection is not None:
            with contextlib.suppress(Exception):
                await self._connection.disconnect()
            self._connection = None
        with contextlib.suppress(RedisError):
            await self.redis.delete(self.wake_key)


class ClusterEventHub(EventHub):
    """The hub on a Redis Cluster: a multi-key ``XREAD`` must stay in one slot, and every job
    has a slot of its own, so each followed job is read by a blocking ``XREAD`` of its own
    (on the cluster client's connection to the job's master); its entries are still handed
    to all the job's followers, with the same no-gap, no-duplicate rules."""

    def __init__(self, redis: RedisClient, keys: Keys, **options: Any) -> None:
        super().__init__(redis, keys, **options)
        self._readers: dict[str, asyncio.Task[None]] = {}

    def follow(self, key: str, cursor: str) -> Follower:
        follower = super().follow(key, cursor)
        if key not in self._readers:
            self._readers[key] = asyncio.create_task(self._read_key(key), name=f"hub-{key}")
        return follower

    def unfollow(self, follower: Follower) -> None:
        super().unfollow(follower)
        if follower.key not in self._last and (reader := self._readers.pop(follower.key, None)):
            reader.cancel()

    async def run(self) -> None:
        """Nothing to do here: each followed job has its reader (until cancelled)."""
        await asyncio.Event().wait()

    async def _read_key(self, key: str) -> None:
        failures = 0
        while (cursor := self._last.get(key)) is not None:
            try:
                reply: Any = await self.redis.xread(
                    {key: cursor}, count=self.read_count(), block=self.block_ms
                )
                failures = 0
            except RedisError as exc:
                failures += 1
                if often_enough(failures):
                    log.warning("gateway: reading %s failed (%s); retrying", key, exc)
                await asyncio.sleep(pause(REDIS_WAIT, failures))
                continue
            rows = [
                (eid, dict(fields))
                for _, entries in stream_replies(reply)
                for eid, fields in entries
            ]
            if rows and self._last.get(key) == cursor:  # (unless unfollowed or re-followed)
                self._deliver(key, rows)

    async def close(self) -> None:
        readers, self._readers = list(self._readers.values()), {}
        await cancel_and_wait(readers)
        await super().close()


def event_hub(redis: RedisClient, keys: Keys, *, max_bytes: int = 262_144) -> EventHub:
    """The hub for this deployment: one multi-key reader, or one reader per job on a
    Cluster. ``max_bytes``: what may wait for one client."""
    kind = ClusterEventHub if isinstance(redis, RedisCluster) else EventHub
    return kind(redis, keys, max_bytes=max_bytes)


class JobFeed:
    """One client's read of one job's events: from ``after``, live, to the terminal entry.

    ``batches()`` yields lists of entries; an empty list when nothing came for
    ``idle_seconds`` (time for a keep-alive). ``ended``: the job's record was terminal
    before the read began, so its stream is complete and nothing is followed live. Raises
    JobNotFoundError when the job's record disappears (expired) while the feed waits.
    """

    def __init__(
        self,
        hub: EventHub,
        keys: Keys,
        job_id: str,
        *,
        after: str = "0-0",
        ended: bool = False,
        idle_seconds: float = 15.0,
        drop_when_behind: bool = True,
    ) -> None:
        self.hub = hub
        self.redis = hub.redis
        self.key = keys.events(job_id)
        self.record_key = keys.job(job_id)
        self.job_id = job_id
        self.cursor = after
        self.ended = ended
        self.idle_seconds = idle_seconds
        self.drop_when_behind = drop_when_behind
        self.behind = Behind()
        self.page = max(1, min(RANGE_COUNT, hub.max_bytes // FIRST_GUESS_ROW_BYTES))

    async def batches(self) -> AsyncGenerator[list[Row], None]:
        while True:
            async for rows in self._history():
                yield rows
                if is_terminal(rows[-1]):
                    return
            if self.ended:
                return
            follower = self.hub.follow(self.key, self.cursor)
            if self.drop_when_behind:
                follower.behind = self.behind
            try:
                async for rows in self._live(follower):
                    yield rows
                    if rows and is_terminal(rows[-1]):
                        return
            finally:
                self.hub.unfollow(follower)
            if follower.dropped and self.drop_when_behind:  # this client fell behind
                raise ClientTooSlow(follower.waiting)
            # (else catch up from Redis)

    async def _history(self, until: str = "+") -> AsyncIterator[list[Row]]:
        """Every entry after the cursor (up to ``until``), in pages; stops at a terminal one."""
        while True:
            count = self.page
            rows: Any = await self.redis.xrange(
                self.key, min=f"({self.cursor}", max=until, count=count
            )
            if not rows:
                return
            rows = _through_terminal(rows)
            self.cursor = rows[-1][0]
            per_row = rows_size(rows) // len(rows)  # the next page: about max_bytes
            self.page = max(1, min(RANGE_COUNT, self.hub.max_bytes // per_row))
            yield rows
            if len(rows) < count or is_terminal(rows[-1]):
                return

    async def _live(self, follower: Follower) -> AsyncIterator[list[Row]]:
        if follower.gap_end is not None:
            async for rows in self._history(until=follower.gap_end):
                yield rows
                if is_terminal(rows[-1]):
                    return
        while follower.backlog or not follower.overflowed:
            if not follower.backlog:
                try:
                    async with asyncio.timeout(self.idle_seconds):
                        await follower.ready.wait()
                except TimeoutError:
                    await self._check_record()
                    yield []
                    continue
            rows = follower.take(self.cursor)
            if rows:
                rows = _through_terminal(rows)
                self.cursor = rows[-1][0]
                yield rows
            follower.in_flight = 0  # the client's stream wrote them (or they were none)

    async def _check_record(self) -> None:
        if not await self.redis.exists(self.record_key):
            raise JobNotFoundError(f"job {self.job_id!r} expired while it was being read")


def _through_terminal(rows: list[Row]) -> list[Row]:
    """The rows up to and including the first terminal one (nothing follows it)."""
    for index, row in enumerate(rows):
        if is_terminal(row):
            return rows[: index + 1]
    return rows
