"""What the test modules share (the fixtures are in ``tests/conftest.py``).

=================== ==================================================================
``servers``         redis-server subprocesses of the tests' own (one with a password)
``harness``         in-process workers (the ``harness`` fixture's, ``consuming``) and the
                    jobs and queues tests make
``checks``          a job's stream against its record, the queue drained, readiness;
                    ``eventually``
``processes``       ``chatstream`` subprocesses: the command, environments, the mock
``fleet``           the ``chatstream worker`` processes of a test (the ``fleet`` fixture)
``fakes``           a server that never answers, the upstream gates' instant clock
``gateway_env``     a running gateway (in-process worker, uvicorn on loopback), SSE
                    reading, upstream chunks shaped like OpenAI's
``tls``             a throw-away CA, certificates, a TLS-only redis-server
``deployments``     real Redis Cluster and Sentinel deployments on free ports
=================== ==================================================================
"""
