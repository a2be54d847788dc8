"""The operator's dashboard (``chatstream dashboard``): the fleet at a glance, live, from
Redis alone.

=============== ======================================================================
``app``         the endpoints and ``create_app()`` (Starlette; mountable in any ASGI app)
``core``        the dashboard's state: Redis, operators' keys, the read loop's caches
``live``        one read loop per process, whatever the number of open pages
``overview``    the overview: shards, tenants, upstream rows, workers, charts (pure)
``jobs``        the jobs index, a job's record and attempts, dead letters (content only
                with a key)
``page``        the page (``static/``: one HTML file, plain JS and CSS, no build step)
``server``      serving it with uvicorn
=============== ======================================================================

See docs/dashboard.md.
"""

from worker.dashboard.app import create_app
from worker.dashboard.server import run_dashboard, serve_dashboard

__all__ = ["create_app", "run_dashboard", "serve_dashboard"]
