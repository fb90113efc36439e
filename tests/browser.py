"""The headless Chromium of ``bench.browser`` as the dashboard tests use it.

Outside CI a machine without Chromium skips these tests; on CI (``CI=true``) a
missing Chromium is a failure, so a broken set-up cannot pass unnoticed.
"""

from __future__ import annotations

import os

import pytest

from bench.browser import chromium, missing, show_trace, wait_for

__all__ = ["chromium", "require_chromium", "show_trace", "wait_for"]


def require_chromium() -> None:
    """Skip (or on CI fail) unless Chromium, chromedriver and Selenium are all there."""
    absent = missing()
    if not absent:
        return
    reason = f"headless Chromium test needs {', '.join(absent)}; `make browser` installs it"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"on CI: {reason}")
    pytest.skip(reason)
