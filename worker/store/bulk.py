"""Enqueueing many jobs in a few round trips: what ``Client.enqueue_many`` sends.

The steps of one ``enqueue``, each for the whole batch in one packed write (the batch
senders of ``worker/store/batch.py``; on a Cluster one per master): create the records,
then index the new ones and push them into their tenants' queues, then mark them queued.
Every step is the script a single enqueue runs (a push call carries up to ``PUSH_CHUNK`` jobs
of one shard), so a batch cut short by a crash leaves what a cut-short enqueue leaves (a
record not marked queued: enqueueing its id again completes it). A refused push (the
tenant's queue is full) deletes the record it would have queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError

from schemas.requests import JobSpec
from worker.store.batch import BatchSender, Command
from worker.store.jobs import JobIndex
from worker.store.records import QUEUED_TO_TENANT, Records, as_text
from worker.store.scheduler import Push, Scheduler, Waiting


@dataclass(frozen=True, slots=True)
class Job:
    """A validated job as the bulk enqueue writes it: its record's fields and its tenant
    queue entry. The validated request itself is not kept: a large call holds one object
    per job instead of the nine of its model (the collector's cost, decision 66)."""

    id: str
    fields: dict[str, str]
    waiting: Waiting  # its tenant, upstream and tokens
    priority: str

    @classmethod
    def of(cls, spec: JobSpec, fields: dict[str, str]) -> Job:
        waiting = Waiting.of(spec.request, spec.tenant, spec.upstream, len(fields["request"]))
        return cls(spec.id, fields, waiting, spec.priority)

    @property
    def push(self) -> Push:
        """What the push script takes of it."""
        return self.id, self.waiting, self.priority


PUSH_CHUNK = 50  # jobs per push script call (Redis runs a call whole: about 1 ms for 50)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A job's commands, built before they are sent."""

    job: Job
    create: Command
    shard: int
    created_at: float


@dataclass(frozen=True, slots=True)
class Created:
    prepared: Prepared
    state: str  # created | unqueued (the record was there, its enqueue cut short)


@dataclass(frozen=True, slots=True)
class Pushed:
    job: Job
    queued: bool  # else refused: the tenant's queue is full
    ours: bool  # this call created its record


@dataclass(slots=True)
class BulkResult:
    queued: list[str]  # ids now queued (new, or already waiting: the same job), in order
    refused: list[tuple[Job, int]]  # the tenant's queue was full: (job, waiting)


class BulkEnqueue:
    def __init__(
        self,
        sender: BatchSender,
        records: Records,
        index: JobIndex,
        scheduler: Scheduler,
        max_queued: int | None,
    ) -> None:
        self.sender = sender
        self.records = records
        self.index = index
        self.scheduler = scheduler
        self.max_queued = max_queued
        self._scripts = [records.create_script, scheduler.push_script, index.add_script]

    async def run(self, batches: Sequence[Sequence[Job]]) -> BulkResult:
        """The batches' steps overlapped: each round trip carries one batch's creates, the
        previous batch's pushes and the marks of the one before, so Redis and this process
        work at the same time. After a refused push nothing more is pushed, and the records
        the next batch created are deleted again."""
        result = BulkResult([], [])
        created: list[Created] = []  # the last round's creates, to push
        pushed: list[Pushed] = []  # the last round's pushes, to mark queued (or discard)
        following = list(batches)
        batch = self._prepare(following.pop(0)) if following else []
        while batch or created or pushed:
            stop = bool(result.refused)
            batch = [] if stop else batch
            undo = self._undo(created) if stop else []
            to_push, created = ([] if stop else created), []
            commands = [job.create for job in batch]
            pushes, order = self._pushes(to_push)
            commands += pushes
            commands += self.index.add_commands(
                [(c.prepared.job.id, c.prepared.created_at) for c in to_push]
            )
            commands += self._settle(pushed, result) + undo
            after = following.pop(0) if following and not stop else []
            # the next batch's commands are built while Redis runs these
            replies, upcoming = await asyncio.gather(self._send(commands), self._later(after))
            push_replies = _in_order(order, replies[len(batch) : len(batch) + len(pushes)])
            pushed = self._pushed(to_push, push_replies, result)
            created = self._created(batch, replies[: len(batch)], result)
            batch = upcoming
        position = {job.id: n for n, job in enumerate(job for b in batches for job in b)}
        result.queued.sort(key=position.__getitem__)
        return result

    def _created(
        self, batch: Sequence[Prepared], replies: list[Any], result: BulkResult
    ) -> list[Created]:
        """The jobs to push: those whose record is new or not yet queued (``exists``: the
        same job is queued already)."""
        fresh: list[Created] = []
        for prepared, reply in zip(batch, replies, strict=True):
            state = as_text(reply)
            if state == "exists":
                result.queued.append(prepared.job.id)
            else:
                fresh.append(Created(prepared, state))
        return fresh

    @staticmethod
    def _pushed(to_push: list[Created], replies: list[Any], result: BulkResult) -> list[Pushed]:
        """Refusals recorded in ``result``; what to mark queued or discard next round."""
        pushed: list[Pushed] = []
        for created, reply in zip(to_push, replies, strict=True):
            job = created.prepared.job
            full = as_text(reply[0]) == "full"
            if full:
                result.refused.append((job, int(reply[1])))
            pushed.append(Pushed(job, queued=not full, ours=created.state == "created"))
        return pushed

    def _settle(self, pushed: list[Pushed], result: BulkResult) -> list[Command]:
        """Mark the pushed jobs queued; delete the records of refused ones this created."""
        commands: list[Command] = []
        for push in pushed:
            if push.queued:
                result.queued.append(push.job.id)
                job = self.records.keys.job(push.job.id)
                commands.append(("HSET", job, "queue_entry", QUEUED_TO_TENANT))
            elif push.ours:
                commands += self._discard(push.job.id)
        return commands

    def _undo(self, created: list[Created]) -> list[Command]:
        """After a refusal: the records created but never pushed, deleted."""
        keys = self.records.keys
        return [("DEL", keys.job(c.prepared.job.id)) for c in created if c.state == "created"]

    async def _later(self, batch: Sequence[Job]) -> list[Prepared]:
        return self._prepare(batch)

    def _prepare(self, batch: Sequence[Job]) -> list[Prepared]:
        shard_of = self.records.keys.shard_of
        return [
            Prepared(job, self._create(job), shard_of(job.id), float(job.fields["created_at"]))
            for job in batch
        ]

    def _pushes(self, to_push: list[Created]) -> tuple[list[Command], list[int]]:
        """The round's pushes, one script call per shard for up to ``PUSH_CHUNK`` jobs
        (each call's keys are its shard's: one Cluster slot); and the positions in
        ``to_push`` of the calls' replies, flattened."""
        by_shard: dict[int, list[int]] = {}
        for position, created in enumerate(to_push):
            by_shard.setdefault(created.prepared.shard, []).append(position)
        scheduler, commands, order = self.scheduler, [], []
        for shard, positions in by_shard.items():
            keys = scheduler.shard_keys(shard)
            for start in range(0, len(positions), PUSH_CHUNK):
                chunk = positions[start : start + PUSH_CHUNK]
                jobs = [to_push[p].prepared.job.push for p in chunk]
                args = scheduler.push_args(jobs, self.max_queued)
                commands.append(self._eval(scheduler.push_script, keys, args))
                order += chunk
        return commands, order

    def _create(self, job: Job) -> Command:
        flat = [item for pair in job.fields.items() for item in pair]
        keys = self.records.job_keys(job.id)
        return self._eval(self.records.create_script, keys, [self.records.retention, *flat])

    def _discard(self, job_id: str) -> list[Command]:
        return [("DEL", self.records.keys.job(job_id)), self.index.remove_command(job_id)]

    def _eval(self, script: AsyncScript, keys: list[str], args: list[Any]) -> Command:
        return ("EVALSHA", script.sha, len(keys), *keys, *args)

    async def _send(self, commands: list[Command]) -> list[Any]:
        """One round trip; commands refused for a script Redis does not know (restarted)
        are sent again once it is loaded. Any other refusal is raised."""
        if not commands:
            return []
        replies = await self.sender.send(commands)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            for script in self._scripts:
                await self.records.redis.script_load(script.script)
            again = await self.sender.send([commands[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise reply
        return replies


def _in_order(order: list[int], replies: list[Any]) -> list[Any]:
    """The push calls' replies (a list per call), one per job in ``to_push``'s order."""
    flat = [reply for call in replies for reply in call]
    ordered: list[Any] = [None] * len(flat)
    for position, reply in zip(order, flat, strict=True):
        ordered[position] = reply
    return ordered
