"""A third-party OpenAI server behind the local tier: xpyd-sim (PyPI), beside a V2 GPU.

xpyd-sim runs from its own virtualenv (``make xpyd``: ``.venv-xpyd``); without it these
tests skip, saying so. Its metrics are its own (``xpyd_sim_*``), none of the vLLM or
SGLang names the tier reads, so its load stays *unknown* (never idle) and what is
tested against it is health (``/health``, ``/v1/models``), forwarding (unary and
streamed, usage read back as token counts) and failover when it is killed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from common.basics.redis_embed import EmbeddedRedis, free_port
from common.config.topology import topology_from_mapping
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.routing import ROUTE
from common.request.tokens import TokenCount
from common.request.v2 import generate_request, response_text
from common.tier.server import TierServer
from local_lb.server import build_local_tier
from sim.topology import one_zone_mapping
from sim.worker import ZoneWorkers

ROOT = Path(__file__).resolve().parents[2]
XPYD = ROOT / ".venv-xpyd" / "bin" / "xpyd-sim"
REGION, ZONE = "r", "r-1a"
FAST = ("--prefill-delay-ms", "1", "--decode-delay-per-token-ms", "2")

pytestmark = pytest.mark.skipif(
    not XPYD.exists(), reason=f"xpyd-sim is not installed ({XPYD}); `make xpyd` installs it"
)


def serving(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=0.5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@pytest.fixture
def xpyd() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    proc = subprocess.Popen(
        [str(XPYD), "serve", "--host", "127.0.0.1", "--port", str(port), "--model", "m", *FAST],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not serving(port):
            assert proc.poll() is None, "xpyd-sim exited at start"
            assert time.monotonic() < deadline, "xpyd-sim did not serve within 30 s"
            time.sleep(0.1)
        yield proc, port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Zone:
    proc: subprocess.Popen[bytes]
    tier: TierServer
    stub: pb_grpc.GRPCInferenceServiceStub


@pytest.fixture
async def zone(
    xpyd: tuple[subprocess.Popen[bytes], int], redis_server: EmbeddedRedis
) -> AsyncIterator[Zone]:
    proc, port = xpyd
    raw = one_zone_mapping(
        redis_server.url, gpus=2, region=REGION, zone=ZONE, health_interval_s=0.2
    )
    g0 = raw["regions"][0]["zones"][0]["gpus"][0]
    g0.update(protocol="openai", listen=f"127.0.0.1:{port}")
    del g0["metrics_listen"]
    topo = topology_from_mapping(raw)
    zone_cfg = topo.zone(REGION, ZONE)
    # Only g1 is emulated; g0 is xpyd-sim.
    workers = ZoneWorkers(
        dataclasses.replace(zone_cfg, gpus=zone_cfg.gpus[1:]), region=REGION, time_scale=0.05
    )
    await workers.start()
    tier = build_local_tier(topo, REGION, ZONE)
    await tier.start()
    try:
        for _ in range(200):
            if all(c.healthy for c in tier.children):
                break
            await asyncio.sleep(0.02)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{tier.port}") as channel:
            yield Zone(proc, tier, pb_grpc.GRPCInferenceServiceStub(channel))
    finally:
        await tier.stop(0)
        await workers.stop(0)


def only_xpyd(zone: Zone) -> None:
    zone.tier.children.set_drained(zone.tier.children.by_name["g1"], True)


async def test_xpyd_is_healthy_and_its_load_unknown(zone: Zone) -> None:
    g0 = zone.tier.children.by_name["g0"]
    assert g0.healthy, g0.last_error
    await asyncio.sleep(0.5)  # a few scrapes
    book, now = zone.tier.balancer.view.load, asyncio.get_running_loop().time()
    assert book.get("g0", now, 10.0) is None  # xpyd_sim_* names: unknown, never idle
    assert book.get("g1", now, 10.0) is not None  # the emulated vLLM names: read


async def test_unary_and_streamed_through_xpyd(zone: Zone) -> None:
    only_xpyd(zone)
    call = zone.stub.ModelInfer(generate_request("m", "hello there", 5), timeout=10)
    response = await call
    assert dict(await call.trailing_metadata())[ROUTE] == f"{ZONE}/g0"
    assert response_text(response)
    count = TokenCount()
    count.add(response)
    assert count.prompt == 2 and count.completion is not None and 1 <= count.completion <= 5

    stream = zone.stub.ModelStreamInfer(timeout=10)
    await stream.write(generate_request("m", "hello there", 4, request_id="s", stream=True))
    await stream.done_writing()
    responses = []
    while (r := await stream.read()) is not grpc.aio.EOF:
        responses.append(r.infer_response)
    assert all(r.id == "s" for r in responses)
    assert responses[-1].parameters["triton_final_response"].bool_param
    texts = [response_text(r) for r in responses if r.outputs]
    count = TokenCount()
    for r in responses:
        count.add(r)
    assert texts and count.completion == len(texts)  # its usage chunk, on the last


async def test_a_killed_xpyd_is_failed_over_to_the_v2_gpu(zone: Zone) -> None:
    zone.proc.kill()
    zone.proc.wait()
    for _ in range(10):
        call = zone.stub.ModelInfer(generate_request("m", "hello", 3), timeout=10)
        await call
        assert dict(await call.trailing_metadata())[ROUTE] == f"{ZONE}/g1"
    for _ in range(100):
        if not zone.tier.children.by_name["g0"].healthy:
            break
        await asyncio.sleep(0.02)
    assert not zone.tier.children.by_name["g0"].healthy
