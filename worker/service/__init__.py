"""The worker process: one job's data flow and everything around it.

=============== ======================================================================
``worker``      ``Worker``: startup, consuming into slots, graceful shutdown; ``serve``
``pipeline``    ``run_job()``: one attempt's whole data flow, top to bottom
``metrics``     Prometheus metrics
``runtime``     the start-up line: configuration without secrets, loop, parser
``supervisor``  ``chatstream worker --processes N``: restarts crashed workers
=============== ======================================================================
"""
