"""A real headless Chromium, driven by Selenium over chromedriver, for whatever needs
the dashboard in a browser: ``bench.screenshot`` and the dashboard tests.

Debian's ``chromium`` and ``chromium-driver`` packages provide both binaries
(``make browser`` installs them). The driver's path is given explicitly, so
Selenium Manager never runs and nothing is downloaded. ``missing()`` says what is
not there; each caller decides what that means (the tests skip, or fail on CI).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM = Path(os.environ.get("MERIDIAN_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("MERIDIAN_CHROMEDRIVER", "/usr/bin/chromedriver"))
# Without the background-networking flags Chromium's own connections fail on a
# closed network and can stall start-up.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
)


def missing() -> list[str]:
    """What driving Chromium needs and this machine lacks (empty: nothing)."""
    absent = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        absent.append("the selenium package (pip install -e '.[dev]')")
    return absent


@contextmanager
def chromium(width: int = 1440, height: int = 1000) -> Iterator[Any]:
    """A fresh headless Chromium (own profile directory), quit however the block ends."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="meridian-chromium-") as profile:
        options = Options()
        options.binary_location = str(CHROMIUM)
        for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
            options.add_argument(flag)
        service = Service(executable_path=str(CHROMEDRIVER))
        driver = webdriver.Chrome(service=service, options=options)
        try:
            driver.set_page_load_timeout(30)
            yield driver
        finally:
            driver.quit()


def wait_for(driver: Any, css: str, count: int = 1, timeout_s: float = 30.0) -> list[Any]:
    """At least ``count`` elements matching ``css``, waiting up to ``timeout_s``."""
    from selenium.webdriver.support.ui import WebDriverWait

    found: list[Any] = []

    def enough(d: Any) -> bool:
        found[:] = d.find_elements("css selector", css)
        return len(found) >= count

    WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(
        enough, f"fewer than {count} elements match {css!r}"
    )
    return found


# A trace row whose every tier answered (a partial one may lack spans).
COMPLETE_TRACE = "#traces tr.trace[data-trace-id][data-complete='true']"


def show_trace(driver: Any, url: str, gpus: int, timeout_s: float = 30.0) -> str:
    """Load the dashboard at ``url``, wait for ``gpus`` GPU tiles and a complete trace,
    click the newest complete trace and wait for its span timeline; returns its id."""
    driver.get(url)
    wait_for(driver, "#fleet .gpu[data-state]", gpus, timeout_s)
    row = wait_for(driver, COMPLETE_TRACE, 1, timeout_s)[0]
    trace_id = str(row.get_attribute("data-trace-id"))
    driver.execute_script("arguments[0].click()", row)  # a re-render may move the row
    wait_for(driver, "#timeline .span-row", 3, timeout_s)
    return trace_id
