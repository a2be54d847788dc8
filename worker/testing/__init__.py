"""Tools for tests, the demo and the benchmarks: public, as users' own tests want them.

=================== ==================================================================
``mock_upstream``   ``MockUpstream``: an OpenAI-compatible fake streaming server
=================== ==================================================================
"""
