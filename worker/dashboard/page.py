"""The dashboard's page: one HTML file, one script, one style sheet (``static/``).

Plain HTML, CSS and JavaScript: no build step, nothing loaded from elsewhere (it works
offline), served with the gateway page's strict Content-Security-Policy. The page reads
every URL relative to itself, so it works mounted under any path. The operator's key, when
entered, stays in the tab's ``sessionStorage`` and goes only in a request header.
"""

from __future__ import annotations

from importlib import resources

from starlette.routing import Route

from worker.gateway.page import static_routes

STATIC = resources.files("worker.dashboard") / "static"
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/dash.js": ("dash.js", "text/javascript; charset=utf-8"),
    "/dash.css": ("dash.css", "text/css; charset=utf-8"),
}


def page_routes() -> list[Route]:
    return static_routes(STATIC, FILES)
