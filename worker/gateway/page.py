"""The small page at ``/``: send a prompt, watch the reply stream in, reload to resume.

Plain HTML, CSS and JavaScript in ``static/`` (no build step, nothing from another
origin). The page creates a job with ``Prefer: respond-async`` and reads it with
``EventSource`` through the job's events token; it keeps the job, the last entry id and
the text so far in ``sessionStorage``, so a reload resumes after that id.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from importlib import resources
from importlib.resources.abc import Traversable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

STATIC = resources.files("worker.gateway") / "static"
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/page.js": ("page.js", "text/javascript; charset=utf-8"),
    "/page.css": ("page.css", "text/css; charset=utf-8"),
}


def page_routes() -> list[Route]:
    return static_routes(STATIC, FILES)


def static_routes(folder: Traversable, files: Mapping[str, tuple[str, str]]) -> list[Route]:
    """A route per file (path -> (file name, media type)), served with the headers above."""
    routes = []
    for path, (name, media_type) in files.items():
        body = (folder / name).read_bytes()
        routes.append(Route(path, _serve(body, media_type), methods=["GET"]))
    return routes


def _serve(body: bytes, media_type: str) -> Callable[[Request], Awaitable[Response]]:
    async def serve(request: Request) -> Response:
        return Response(body, media_type=media_type, headers=SECURITY_HEADERS)

    return serve
