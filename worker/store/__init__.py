"""Everything chatstream keeps in Redis, and the only modules (with the gateway's hub and
limits) that talk to it.

================= ====================================================================
``keys``          every key name, built in one place (hash tags for Cluster)
``redis_client``  connecting: one server, a Cluster or Sentinel; foreign errors mapped
``records``       the job record and events stream: fenced scripts
``queue``         the consumer group on every queue shard: read, claim, renew, ack
``liveness``      heartbeats: which workers are dead
``replication``   ``WAIT`` for replicas after the writes that must outlive a failover
``publisher``     coalescing, paced publishing of every job's events, gapless per job
``batch``         the publisher's round trip: one packed write, one reply per command
``cluster_batch`` the same on a Cluster: one packed write per master, MOVED/ASK followed
``jobs``          the jobs index and a running job's progress
``stats``         ``chatstream stats``: the queue and the fleet at a glance
``fleet``         the dashboard's reads: shards, tenants, limits and their use, workers
``activity``      the per-minute counts the workers keep (the dashboard's charts)
``lua/``          the Lua scripts, one ``.lua`` file each, loaded once
================= ====================================================================
"""
