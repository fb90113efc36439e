"""Fixtures of the CLI tests: processes started by a test are stopped by it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.cli.procs import CliProcess

Launch = Callable[[list[str], str], CliProcess]


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launch]:
    """Start ``meridian ARGV`` as a process (output in ``tmp_path/NAME.*``); every one
    started is stopped at the end, newest first, however the test ends."""
    started: list[CliProcess] = []

    def start(argv: list[str], name: str) -> CliProcess:
        started.append(CliProcess(argv, tmp_path / name))
        return started[-1]

    try:
        yield start
    finally:
        for proc in reversed(started):
            proc.stop()
