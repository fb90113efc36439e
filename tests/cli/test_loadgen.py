"""``meridian loadgen``: plain progress lines when piped, a non-zero exit when requests
failed (and no ``nan`` percentiles), TLS to a real emulated GPU server."""

from __future__ import annotations

import io
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from cli.loadgen import LoadReport, LoadTls, Progress, run_loadgen
from common.basics.redis_embed import free_port
from common.config.access import GpuTls
from common.config.gpu import GpuConfig
from common.config.identity import gpu_servers
from common.config.node import Endpoint
from common.config.pki import generate_pki
from common.config.tls import TierTls
from sim.worker import GpuWorker

ROOT = Path(__file__).resolve().parents[2]


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_piped_run_whose_requests_all_failed_exits_1_without_carriage_returns() -> None:
    target = f"127.0.0.1:{closed_port()}"
    argv = ["loadgen", "--target", target, "--requests", "6", "--concurrency", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert "\r" not in done.stdout + done.stderr
    assert "nan" not in done.stdout
    assert "status   UNAVAILABLE 6" in done.stdout
    assert "latency  none: no request succeeded" in done.stdout
    assert "6 of 6 requests failed" in done.stderr
    assert "loadgen: 6/6 done, 6 failed" in done.stderr  # the last progress line, plain


def test_progress_off_a_terminal_is_a_line_every_few_seconds() -> None:
    now = [0.0]
    out = io.StringIO()
    progress = Progress(100, out, every_s=5.0, clock=lambda: now[0])
    report = LoadReport()
    for i in range(100):
        now[0] = i * 0.2  # 20 s in all
        report.statuses["OK" if i % 10 else "UNAVAILABLE"] += 1
        progress.update(report)
    progress.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 4  # at 5, 10, 15 s and the end
    assert lines[-1] == "loadgen: 100/100 done, 10 failed, 19.8 s"


def test_a_report_without_successes_has_no_percentiles() -> None:
    report = LoadReport()
    report.statuses["DEADLINE_EXCEEDED"] = 3
    assert report.failed == 3 and report.total == 3
    assert "nan" not in report.render()


@pytest.fixture
async def tls_gpu(tmp_path: Path) -> AsyncIterator[tuple[GpuWorker, str]]:
    """An emulated GPU serving TLS with a certificate of a fresh CA: (it, the CA file)."""
    identity = gpu_servers("eu", "eu-1a")
    tls = generate_pki(tmp_path / "pki", [identity])
    gpu = GpuConfig(
        name="eu-1a-gpu0",
        endpoint=Endpoint("127.0.0.1", 0),
        metrics_endpoint=Endpoint("127.0.0.1", free_port()),
        hardware="A100",
        models=("demo-llm",),
        tls=GpuTls(),
    )
    keys = TierTls.load(tls, identity).server_credentials(require_client_cert=False)
    worker = GpuWorker(gpu, region="eu", zone="eu-1a", time_scale=0.02, tls=keys)
    await worker.start()
    try:
        yield worker, tls.ca
    finally:
        await worker.stop(0)


async def test_loadgen_talks_tls_verified_by_a_ca(tls_gpu: tuple[GpuWorker, str]) -> None:
    worker, ca = tls_gpu
    target = f"127.0.0.1:{worker.port}"
    report = await run_loadgen(
        target, requests=8, concurrency=4, max_tokens=2, quiet=True, tls=LoadTls(ca=ca)
    )
    assert report.statuses == {"OK": 8} and report.failed == 0
    plain = await run_loadgen(target, requests=2, concurrency=1, max_tokens=2, quiet=True)
    assert plain.statuses["OK"] == 0 and plain.failed == 2  # a plaintext client is refused


async def test_a_certificate_for_another_name_is_refused(tls_gpu: tuple[GpuWorker, str]) -> None:
    worker, ca = tls_gpu
    tls = LoadTls(ca=ca, server_name="not-this-host.example")
    report = await run_loadgen(
        f"127.0.0.1:{worker.port}", requests=2, concurrency=1, quiet=True, tls=tls
    )
    assert report.statuses == {grpc.StatusCode.UNAVAILABLE.name: 2}
