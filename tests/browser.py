"""A real headless browser for the tests of pages (the console, the audit report):
Debian's Chromium driven by Playwright for Python. ``tools/test`` installs both; where
either is missing the tests that need them skip, saying which.

Screenshots go to ``tests/screenshots/`` (not committed; ``SERVICEBUS_SCREENSHOTS``
names another folder) so that a person can look at what the run saw.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["browser", "page", "screenshot", "SHOTS"]

SHOTS = Path(os.environ.get("SERVICEBUS_SCREENSHOTS") or Path(__file__).parent / "screenshots")
CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUM) if p), None)


# Per module, not per session: Playwright's sync API runs an event loop in this thread for
# as long as it is open, and every later test calling asyncio.run() here would fail.
@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("Playwright for Python is not installed (pip install playwright; tools/test does)")
    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium on PATH (apt-get install chromium; tools/test does)")
    with sync_playwright() as pw:
        # --no-sandbox: the suite runs as root, where Chromium refuses its sandbox.
        b = pw.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser) -> Iterator[object]:
    """A new page 1,300 x 900 px (the width the issues' screenshots were taken at); the
    browser's console errors fail the test."""
    context = browser.new_context(viewport={"width": 1300, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    # A request the server refused to connect is the test's own doing (it stopped the
    # server while the page still polls); any other error the page logs is a defect.
    pg.on("console", lambda msg: errors.append(msg.text) if msg.type == "error"
          and "ERR_CONNECTION_REFUSED" not in msg.text else None)
    pg.errors = errors  # type: ignore[attr-defined]
    try:
        yield pg
    finally:
        context.close()
    assert not errors, f"the page reported errors: {errors}"


def screenshot(pg, name: str) -> Path:
    """Save the whole page as SHOTS/NAME.png, and return the path."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    pg.screenshot(path=str(path), full_page=True)
    return path
