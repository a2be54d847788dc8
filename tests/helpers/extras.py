"""What depends on an extra (``fast``, ``otel``): parameters and marks that skip where the
extra is not installed (CI's plain cells, docs/decisions.md 78)."""

from __future__ import annotations

from typing import Any

import pytest

from worker import speedups

needs_httptools = pytest.mark.skipif(
    not speedups.httptools_installed(), reason="needs httptools (the fast extra)"
)

# both upstream transports: ours on httptools (where installed) and httpx's own
TRANSPORTS: list[Any] = [pytest.param("httptools", marks=needs_httptools), "httpx"]
