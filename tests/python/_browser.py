"""A headless Chromium page for the HTML report's tests (playwright driving the system's
chromium); the test is skipped, with the reason, where either cannot be had."""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest


def chromium() -> str | None:
    """The browser binary: $TRAINSAN_CHROMIUM, else the first chromium on PATH."""
    env = os.environ.get("TRAINSAN_CHROMIUM")
    if env:
        return env
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


@contextlib.contextmanager
def headless_page(width: int = 1200, height: int = 900):
    """A new page of a headless Chromium, closed afterwards."""
    try:
        from playwright import sync_api
    except ImportError as exc:
        pytest.skip(f"playwright is not installed or does not import ({exc}); "
                    "pip install playwright==1.55.0")
    exe = chromium()
    if not exe:
        pytest.skip("no chromium binary (apt-get install chromium); playwright's own browser "
                    "download is not used")
    with sync_api.sync_playwright() as pw:
        try:
            browser = pw.chromium.launch(executable_path=exe, headless=True,
                                         args=["--no-sandbox", "--disable-gpu",
                                               "--disable-dev-shm-usage"])
        except Exception as exc:  # noqa: BLE001 - a browser that cannot start here
            pytest.skip(f"chromium at {exe} could not be launched by playwright: {exc}")
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()
