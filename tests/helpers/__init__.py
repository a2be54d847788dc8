"""What the test modules share (the fixtures are in ``tests/conftest.py``).

=================== ==================================================================
``servers``         redis-server subprocesses of the tests' own, free ports
``harness``         the in-process worker of the ``harness`` fixture, the jobs tests make
``checks``          a job's stream against its record, the queue drained; ``eventually``
``processes``       ``chatstream`` subprocesses: the command, environments, the mock
``fakes``           a server that never answers, the upstream gates' instant clock
``gateway_env``     a running gateway (in-process worker, uvicorn on loopback)
``deployments``     real Redis Cluster and Sentinel deployments on free ports
=================== ==================================================================
"""
