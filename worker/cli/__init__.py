"""The ``chatstream`` command.

=============== ======================================================================
``main``        the commands and their arguments (``main()`` is the entry point)
``output``      what the commands and the demo print: events, records, job lists
``demo``        ``chatstream demo``: the whole product with nothing but Python
``gateway_demo`` ``chatstream demo --gateway``: the reply through the HTTP gateway
=============== ======================================================================
"""

from worker.cli.main import main

__all__ = ["main"]
