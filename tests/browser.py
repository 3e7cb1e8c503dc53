"""Headless Chromium driven by selenium, for the console's browser tests.

Debian's `chromium` and `chromium-driver` (`.ci/run` installs them when missing). The
browser starts closed to the network but loopback: no first-run, no background
networking, no component updates, no sync, no QUIC, and a fresh profile per session.
Without the browser the tests skip, except under CI or TURNSTILE_REQUIRE_KAFKA=1 (the full
suite), where a missing browser fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("TURNSTILE_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("TURNSTILE_CHROMEDRIVER", "/usr/bin/chromedriver")
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1280,900",
)
SCREENSHOTS = Path(__file__).parent.parent / "build" / "screenshots"  # git-ignored


def browser_required() -> bool:
    return bool(os.environ.get("CI")) or os.environ.get("TURNSTILE_REQUIRE_KAFKA") == "1"


def need_browser() -> None:
    """Skip (or fail, where the browser is required) when Chromium or its driver is missing."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not (Path(p).exists() or shutil.which(p))]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip install -e '.[dev]')")
    if missing:
        message = f"the browser tests need {', '.join(missing)} (apt-get install -y chromium chromium-driver)"
        if browser_required():
            pytest.fail(message)
        pytest.skip(message)


@contextlib.contextmanager
def chromium() -> Iterator[object]:
    """A selenium WebDriver on a fresh headless Chromium, quit afterwards."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    need_browser()
    profile = tempfile.mkdtemp(prefix="turnstile-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def screenshot(driver: object, name: str) -> Path:
    """Saves the page as build/screenshots/NAME.png (not checked in)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    driver.save_screenshot(str(path))  # type: ignore[attr-defined]
    return path
