"""Enqueueing many jobs in a few round trips: what ``Client.enqueue_many`` sends.

The steps of one ``enqueue``, each for the whole batch in one packed write (the batch
senders of ``worker/store/batch.py``; on a Cluster one per master): create the records,
then index the new ones and push them into their tenants' queues, then mark them queued.
Every step is the script a single enqueue runs, so a batch cut short by a crash leaves what
a cut-short enqueue leaves (a record not marked queued: enqueueing its id again completes
it). A refused push (the tenant's queue is full) deletes the record it would have queued.
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
from worker.store.scheduler import Scheduler, Waiting

Job = tuple[JobSpec, dict[str, str]]  # the spec and its record fields


@dataclass(frozen=True, slots=True)
class Prepared:
    """A job's commands, built before they are sent."""

    spec: JobSpec
    create: Command
    push: Command
    created_at: float


@dataclass(frozen=True, slots=True)
class Created:
    job: Prepared
    state: str  # created | unqueued (the record was there, its enqueue cut short)


@dataclass(frozen=True, slots=True)
class Pushed:
    spec: JobSpec
    queued: bool  # else refused: the tenant's queue is full
    ours: bool  # this call created its record


@dataclass(slots=True)
class BulkResult:
    queued: list[str]  # ids now queued (new, or already waiting: the same job), in order
    refused: list[tuple[JobSpec, int]]  # the tenant's queue was full: (job, waiting)


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
            commands += [c.job.push for c in to_push]
            commands += self.index.add_commands(
                [(c.job.spec.id, c.job.created_at) for c in to_push]
            )
            commands += self._settle(pushed, result) + undo
            after = following.pop(0) if following and not stop else []
            # the next batch's commands are built while Redis runs these
            replies, upcoming = await asyncio.gather(self._send(commands), self._later(after))
            pushed = self._pushed(to_push, replies[len(batch) : len(batch) + len(to_push)], result)
            created = self._created(batch, replies[: len(batch)], result)
            batch = upcoming
        position = {spec.id: n for n, (spec, _) in enumerate(j for b in batches for j in b)}
        result.queued.sort(key=position.__getitem__)
        return result

    def _created(
        self, batch: Sequence[Prepared], replies: list[Any], result: BulkResult
    ) -> list[Created]:
        """The jobs to push: those whose record is new or not yet queued (``exists``: the
        same job is queued already)."""
        fresh: list[Created] = []
        for job, reply in zip(batch, replies, strict=True):
            state = as_text(reply)
            if state == "exists":
                result.queued.append(job.spec.id)
            else:
                fresh.append(Created(job, state))
        return fresh

    @staticmethod
    def _pushed(to_push: list[Created], replies: list[Any], result: BulkResult) -> list[Pushed]:
        """Refusals recorded in ``result``; what to mark queued or discard next round."""
        pushed: list[Pushed] = []
        for created, reply in zip(to_push, replies, strict=True):
            spec = created.job.spec
            full = as_text(reply[0]) == "full"
            if full:
                result.refused.append((spec, int(reply[1])))
            pushed.append(Pushed(spec, queued=not full, ours=created.state == "created"))
        return pushed

    def _settle(self, pushed: list[Pushed], result: BulkResult) -> list[Command]:
        """Mark the pushed jobs queued; delete the records of refused ones this created."""
        commands: list[Command] = []
        for push in pushed:
            if push.queued:
                result.queued.append(push.spec.id)
                job = self.records.keys.job(push.spec.id)
                commands.append(("HSET", job, "queue_entry", QUEUED_TO_TENANT))
            elif push.ours:
                commands += self._discard(push.spec)
        return commands

    def _undo(self, created: list[Created]) -> list[Command]:
        """After a refusal: the records created but never pushed, deleted."""
        keys = self.records.keys
        return [("DEL", keys.job(c.job.spec.id)) for c in created if c.state == "created"]

    async def _later(self, batch: Sequence[Job]) -> list[Prepared]:
        return self._prepare(batch)

    def _prepare(self, batch: Sequence[Job]) -> list[Prepared]:
        return [
            Prepared(
                spec,
                self._create(spec, fields),
                self._push(spec, len(fields["request"])),
                float(fields["created_at"]),
            )
            for spec, fields in batch
        ]

    def _create(self, spec: JobSpec, fields: dict[str, str]) -> Command:
        flat = [item for pair in fields.items() for item in pair]
        keys = self.records.job_keys(spec.id)
        return self._eval(self.records.create_script, keys, [self.records.retention, *flat])

    def _push(self, spec: JobSpec, json_length: int) -> Command:
        waiting = Waiting.of(spec.request, spec.tenant, spec.upstream, json_length)
        scheduler = self.scheduler
        keys = scheduler.shard_keys(scheduler.keys.shard_of(spec.id))
        args = scheduler.push_args(spec.id, waiting, spec.priority, self.max_queued)
        return self._eval(scheduler.push_script, keys, args)

    def _discard(self, spec: JobSpec) -> list[Command]:
        return [("DEL", self.records.keys.job(spec.id)), self.index.remove_command(spec.id)]

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
