"""chatstream's Lua scripts, one ``.lua`` file each, read once at import.

A folder per owner: ``records/`` (the job record and events stream, fenced), ``queue/``
(leases, claims, take-over), ``sched/`` (tenants' queues, fair picks, upstream limits),
``liveness/`` (heartbeats and the workers' reports), ``jobs/`` (the jobs index),
``replication/`` (the replica check), ``limits/`` (the gateway's rate limiter) and
``activity/`` (the per-minute counts). Each file opens with what its ``KEYS`` and
``ARGV`` are and what it returns. Every script touches the keys of one Cluster slot only.
Scripts that need the scheduler's shared functions get ``SCHEDULER_LIB`` prepended.
"""

from __future__ import annotations

from importlib import resources

SCHEDULER_LIB = ("sched/lib", "sched/routes", "sched/dispatch")


def script(name: str, *, with_lib: bool = False) -> str:
    """The text of ``<name>.lua`` (for example ``"records/start"``); with ``with_lib``,
    after the scheduler's shared functions (``SCHEDULER_LIB``, in that order)."""
    text = _read(name)
    if not with_lib:
        return text
    return "\n".join([*(_read(part) for part in SCHEDULER_LIB), text])


def _read(name: str) -> str:
    return (resources.files(__package__) / f"{name}.lua").read_text(encoding="utf-8")
