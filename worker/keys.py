"""Every Redis key and name chatstream uses, built in one place.

Per-job keys share the hash tag ``{<job id>}`` so a job's record and events stream live in
one Redis Cluster slot and can be written by one script.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "workers"


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "chatstream"

    @property
    def queue(self) -> str:
        return f"{self.prefix}:queue"

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
    def jobs(self) -> str:
        """Sorted set: job id -> enqueue time (Unix seconds); the index ``jobs`` lists."""
        return f"{self.prefix}:jobs"

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
