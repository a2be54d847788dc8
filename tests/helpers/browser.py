"""A real headless Chromium (Debian's ``chromium``, driven by Playwright) for the page tests:
the gateway's page and the dashboard (the ``browser`` fixture of tests/conftest.py).

A page's Content-Security-Policy forbids eval, so tests wait with Playwright's ``expect``
(which runs in its own isolated world) rather than ``wait_for_function``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from playwright.async_api import Browser, Page, async_playwright

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
HAVE_CHROMIUM = os.path.exists(CHROMIUM)
# headless as root in a closed network: no sandbox (needs user namespaces), nothing that
# phones home
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-dev-shm-usage",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
]


@asynccontextmanager
async def launched_browser() -> AsyncIterator[Browser]:
    if not HAVE_CHROMIUM:
        if os.environ.get("CI"):
            pytest.fail("CI needs Debian's chromium (.ci/run installs it)")
        pytest.skip("needs chromium (apt-get install chromium)")
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        await browser.close()


async def text(page: Page, selector: str) -> str:
    return await page.text_content(selector) or ""
