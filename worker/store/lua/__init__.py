"""chatstream's Lua scripts, one ``.lua`` file each, read once at import.

A folder per owner: ``records/`` (the job record and events stream, fenced), ``queue/``
(leases, claims, take-over), ``liveness/`` (heartbeats), ``jobs/`` (the jobs index),
``replication/`` (the replica check) and ``limits/`` (the gateway's rate limiter). Each
file opens with what its ``KEYS`` and ``ARGV`` are and what it returns. Every script
touches the keys of one Cluster slot only.
"""

from __future__ import annotations

from importlib import resources


def script(name: str) -> str:
    """The text of ``<name>.lua`` (for example ``"records/start"``)."""
    return (resources.files(__package__) / f"{name}.lua").read_text(encoding="utf-8")
