"""The worker process: one job's data flow and everything around it.

=============== ======================================================================
``worker``      ``Worker``: startup, consuming into slots, graceful shutdown; ``serve``
``slots``       at most ``concurrency`` jobs at once; a job waiting for a down upstream
                gives its slot back meanwhile
``entries``     ``HeldEntry`` and ``EntryFate``: what becomes of a queue entry once its
                attempt is over (acked, left to a newer delivery, requeued)
``upkeep``      heartbeats and taking over dead workers' entries, lease renewal,
                stranded entries, cancel requests
``pipeline``    ``run_job()``: one attempt's whole data flow, top to bottom
``notices``     ``waiting`` entries: a job's readers learn that (and why) it waits
``ticks``       ``WakeCoalescer``: while jobs run, stream reads and the publisher's
                replies are handled once per tick (``CHATSTREAM_WAKE_TICK_MS``) and share
                wake-ups; a job's start, its end and requests go through at once
``metrics``     Prometheus metrics
``tracing``     OpenTelemetry: the attempt's span and the GenAI metrics (or nothing)
``health``      ``/metrics``, ``/healthz``, ``/readyz`` on ``CHATSTREAM_METRICS_PORT``
``runtime``     the start-up line: configuration without secrets, loop, parser
``supervisor``  ``chatstream worker --processes N``: restarts crashed workers
=============== ======================================================================
"""
