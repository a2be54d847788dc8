"""Every Redis key and name chatstream uses, built in one place.

Per-job keys share the hash tag ``{<job id>}`` so a job's record and events stream live in
one Redis Cluster slot and can be written by one script.

The queue is ``shards`` streams (``CHATSTREAM_QUEUE_SHARDS``, default 1). Shard 0 is
``<p>:queue``; shard *i* > 0 is ``<p>:queue:{<tag>}``, its tag chosen so that each shard
lies in its own N-th of the 16,384 slots (a Cluster made by ``redis-cli --cluster create``
gives each master one contiguous range, so N shards on N masters land one per master).
Each shard has a jobs index of its own (shard *i* > 0's in the shard's slot), and a
scheduler of its own (``<p>:sched:{<the shard's tag>}:...``: its tenants' queues and its
share of each upstream's limits), in the shard's slot, so one script decides a fair pick
and moves the job into the shard's stream. See docs/redis.md.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import lru_cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

GROUP = "workers"
BREAKER_FIELDS = ("until", "since", "why", "probe")  # what a breaker hash says


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "chatstream"
    shards: int = 1

    @property
    def queue(self) -> str:
        """Shard 0 of the queue (the whole queue when there is one shard)."""
        return f"{self.prefix}:queue"

    @property
    def queues(self) -> tuple[str, ...]:
        """Every shard of the queue, in shard order."""
        return tuple(self.queue_shard(shard) for shard in range(self.shards))

    def queue_shard(self, shard: int) -> str:
        return self._sharded(self.queue, shard)

    def queue_of(self, job_id: str) -> str:
        """The queue shard ``Client.enqueue`` puts a job on."""
        return self.queue_shard(self.shard_of(job_id))

    def shard_of(self, job_id: str) -> int:
        """The shard ``Client.enqueue`` puts a job on (any shard works: workers read all)."""
        return zlib.crc32(job_id.encode()) % self.shards if self.shards > 1 else 0

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    @property
    def cancel_channel(self) -> str:
        return f"{self.prefix}:cancel"

    @property
    def workers(self) -> str:
        """Sorted set: worker name -> last heartbeat (Unix seconds)."""
        return f"{self.prefix}:workers"

    @property
    def workers_info(self) -> str:
        """Hash: worker name -> what it reports beside its heartbeat (JSON: slots, jobs
        waiting for a down upstream, version, start). Tagged with the ``workers`` key's own
        name, so it lies in that key's slot and one script writes both."""
        return f"{self.prefix}:workers:info:{{{self.workers}}}"

    def activity(self, minute: int) -> str:
        """Hash: the fleet's counts of one Unix minute (``worker/store/activity.py``)."""
        return f"{self.prefix}:activity:{minute}"

    @property
    def jobs(self) -> str:
        """Sorted set: job id -> enqueue time (Unix seconds); shard 0's index ``jobs`` lists."""
        return f"{self.prefix}:jobs"

    def jobs_shard(self, shard: int) -> str:
        """The jobs index of the jobs enqueued on ``shard`` (shard *i* > 0's in its slot)."""
        return self._sharded(self.jobs, shard)

    def sched(self, shard: int) -> str:
        """The prefix of shard ``shard``'s scheduler keys, in the shard's slot: the tag is
        the shard's (``<p>:queue`` itself for shard 0, whose stream has no tag)."""
        tag = self.queue if shard == 0 else shard_tag(self.prefix, shard, self.shards)
        return f"{self.prefix}:sched:{{{tag}}}"

    def breakers(self, shard: int, upstream: str, model: str) -> tuple[str, str]:
        """The fleet's breakers a route's target passes (``sched/routes.lua``), hashes of
        ``BREAKER_FIELDS``: its upstream's (it could not be reached) and its own."""
        upstream_key = f"{self.sched(shard)}:down:{upstream}"
        return upstream_key, f"{upstream_key}|{model}"

    def _sharded(self, key: str, shard: int) -> str:
        """``key`` itself for shard 0, else ``key:{<the shard's tag>}``."""
        return key if shard == 0 else f"{key}:{{{shard_tag(self.prefix, shard, self.shards)}}}"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{{{job_id}}}"

    def events(self, job_id: str) -> str:
        return f"{self.prefix}:job:{{{job_id}}}:events"

    def gateway_rate(self, key_id: str) -> str:
        """String: the gateway's rate limiter state (GCRA) of one API key."""
        return f"{self.prefix}:gateway:rate:{key_id}"

    def gateway_wake(self, hub_id: str) -> str:
        """Stream: wakes one gateway process's reader when it follows a new job."""
        return f"{self.prefix}:gateway:wake:{hub_id}"


@lru_cache(maxsize=4096)
def shard_tag(prefix: str, shard: int, shards: int) -> str:
    """The hash tag of queue shard ``shard`` > 0 of ``shards``.

    The slots are cut into ``shards`` equal shares; shard 0 (``<p>:queue``) lies in one of
    them, and shard *i* takes the middle of the *i*-th of the others: the first of
    ``<p>:q<i>``, ``<p>:q<i>.1``, ``<p>:q<i>.2``, ... whose slot lies there. A cluster whose
    N masters each serve one contiguous share (``redis-cli --cluster create``) gets one shard
    per master."""
    width = REDIS_CLUSTER_HASH_SLOTS / shards
    first = int(key_slot(f"{prefix}:queue".encode()) // width)
    share = [other for other in range(shards) if other != first][shard - 1]
    low, high = (share + 0.25) * width, (share + 0.75) * width
    for attempt in range(1_000_000):
        tag = f"{prefix}:q{shard}" + (f".{attempt}" if attempt else "")
        if low <= key_slot(tag.encode()) < high:
            return tag
    raise AssertionError("unreachable: CRC16 covers every slot")
