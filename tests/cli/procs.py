"""A ``python -m cli.main`` process for tests, its stdout and stderr in files."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class CliProcess:
    """One ``meridian`` command run as a process; stopped with SIGTERM, killed after
    ``grace_s`` more."""

    def __init__(self, argv: list[str], out: Path, grace_s: float = 30.0) -> None:
        self.stdout, self.stderr = out.with_suffix(".out"), out.with_suffix(".err")
        self.grace_s = grace_s
        with self.stdout.open("wb") as o, self.stderr.open("wb") as e:
            cmd = [sys.executable, "-m", "cli.main", *argv]
            self.popen = subprocess.Popen(cmd, cwd=ROOT, stdout=o, stderr=e)

    def lines(self, *, strict: bool = False) -> list[dict[str, Any]]:
        """Its JSON log lines; ``strict``: every line must be one (else this raises)."""
        out = []
        for line in self.stderr.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                if strict:
                    raise
        return out

    def events(self, event: str) -> list[dict[str, Any]]:
        return [line for line in self.lines() if line.get("event") == event]

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode
