"""Gray failures at the local tier, over real gRPC: hung GPUs and probes that time out.

The local tier runs in-process; each GPU that must hang runs alone in a
``meridian worker`` process of its own, stopped with SIGSTOP (hung, not dead: its
connections stay open and no RST ever comes) and always continued and stopped
in a ``finally``. Emulated GPUs run at the tests' time scale (20x).
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from cli.launcher import tier_ready
from cli.processes import TierProcess
from common.basics.redis_embed import EmbeddedRedis
from common.config.topology import topology_from_mapping
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.observability.metrics import counter_values
from common.request.routing import ROUTE
from common.request.v2 import generate_request
from common.tier.server import TierServer
from local_lb.balancer import LocalBalancer
from local_lb.server import build_local_tier
from sim.topology import one_zone_mapping
from sim.worker import GpuWorker
from tests.conftest import TEST_TIME_SCALE

REGION, ZONE = "r", "r-1a"
DEADLINE_S = 10.0


@dataclass
class Answer:
    route: str
    elapsed_s: float


@dataclass
class Zone:
    """A local tier in-process over GPU worker processes, one GPU each."""

    tier: TierServer
    stub: pb_grpc.GRPCInferenceServiceStub
    workers: dict[str, TierProcess]

    @property
    def balancer(self) -> LocalBalancer:
        balancer = self.tier.balancer
        assert isinstance(balancer, LocalBalancer)
        return balancer

    def pause(self, gpu: str) -> None:
        process = self.workers[gpu].process
        assert process is not None
        os.kill(process.pid, signal.SIGSTOP)

    def resume(self, gpu: str) -> None:
        process = self.workers[gpu].process
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)

    async def infer(self, max_tokens: int = 3) -> Answer:
        started = time.monotonic()
        call = self.stub.ModelInfer(generate_request("m", "hello", max_tokens), timeout=DEADLINE_S)
        await call
        route = dict(await call.trailing_metadata())[ROUTE]
        return Answer(str(route), time.monotonic() - started)

    async def stream(self, max_tokens: int = 3) -> Answer:
        started = time.monotonic()
        call = self.stub.ModelStreamInfer(timeout=DEADLINE_S)
        await call.write(generate_request("m", "hello", max_tokens, stream=True))
        await call.done_writing()
        responses = [r async for r in call]
        # One response per token, unless tokens that came while the relay wrote went as one.
        last = responses[-1].infer_response.parameters["completion_tokens"].int64_param
        assert last == max_tokens and len(responses) <= max_tokens
        route = dict(await call.trailing_metadata())[ROUTE]
        return Answer(str(route), time.monotonic() - started)


def zone_mapping(redis_url: str, **settings: Any) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "health_interval_s": 0.5,
        "slow_start_window_s": 0,
        "time_scale": TEST_TIME_SCALE,
    }
    return one_zone_mapping(redis_url, gpus=2, region=REGION, zone=ZONE, **defaults | settings)


def worker_process(mapping: dict[str, Any], gpu: int, run_dir: Path) -> TierProcess:
    """A ``meridian worker`` process serving only GPU ``gpu`` of the zone."""
    alone = copy.deepcopy(mapping)
    zone = alone["regions"][0]["zones"][0]
    zone["gpus"] = [zone["gpus"][gpu]]
    name = zone["gpus"][0]["name"]
    path = run_dir / f"worker-{name}.yaml"
    path.write_text(yaml.safe_dump(alone))
    argv = [sys.executable, "-m", "cli.main", "worker", "--config", str(path)]
    argv += ["--region", REGION, "--zone", ZONE]
    return TierProcess(name, argv, run_dir / f"worker-{name}.log")


def wait_serving(address: str, process: TierProcess, timeout_s: float = 30.0) -> None:
    """Until the worker serves (blocking: nothing else runs yet)."""
    deadline = time.monotonic() + timeout_s
    while not tier_ready(address):
        assert process.alive(), f"{process.name} exited; see {process.log_path}"
        assert time.monotonic() < deadline, f"{process.name} not serving on {address}"
        time.sleep(0.05)


MakeZone = Callable[..., Awaitable[Zone]]


@pytest.fixture
async def zone_factory(redis_server: EmbeddedRedis, tmp_path: Path) -> AsyncIterator[MakeZone]:
    """Start a zone whose GPUs each run in a worker process; all of it is stopped at the end
    (a stopped worker is continued first, so that it can exit)."""
    workers: list[TierProcess] = []
    tiers: list[TierServer] = []
    channels: list[grpc.aio.Channel] = []

    async def make(**settings: Any) -> Zone:
        mapping = zone_mapping(redis_server.url, **settings)
        topology = topology_from_mapping(mapping)
        started: dict[str, TierProcess] = {}
        for i, gpu in enumerate(topology.zone(REGION, ZONE).gpus):
            process = worker_process(mapping, i, tmp_path)
            workers.append(process)
            process.start()
            started[gpu.name] = process
        for gpu in topology.zone(REGION, ZONE).gpus:
            wait_serving(gpu.endpoint.address, started[gpu.name])
        tier = build_local_tier(topology, REGION, ZONE)
        await tier.start()
        tiers.append(tier)
        channel = grpc.aio.insecure_channel(topology.zone(REGION, ZONE).endpoint.address)
        channels.append(channel)
        return Zone(tier, pb_grpc.GRPCInferenceServiceStub(channel), started)

    try:
        yield make
    finally:
        for process in workers:
            if process.process is not None and process.process.poll() is None:
                os.kill(process.process.pid, signal.SIGCONT)
        for channel in channels:
            await channel.close()
        for tier in tiers:
            await tier.stop(0)
        for process in workers:
            process.stop()


async def eventually(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``predicate`` held; fails after ``timeout_s``."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def warm(zone: Zone) -> None:
    """Both GPUs serve (and both request channels are connected)."""
    routes = {(await zone.infer()).route for _ in range(12)}
    assert routes == {f"{ZONE}/g0", f"{ZONE}/g1"}, routes


# ------------------------------------------------------------------ hung GPU


async def test_requests_on_a_hung_gpu_move_on_at_their_per_try_timeout(
    zone_factory: MakeZone,
) -> None:
    """GPU keepalive at its stock-server default (one ping per 5 minutes): only the
    per-try timeout (1 s floor + 4 x expected) gets requests off the stopped GPU."""
    zone = await zone_factory()
    await warm(zone)
    zone.pause("g0")
    # Concurrent, so the picker spreads them over both GPUs: some go to the hung one.
    answers = await asyncio.gather(
        *(zone.infer() for _ in range(3)), *(zone.stream() for _ in range(3))
    )
    assert {a.route for a in answers} == {f"{ZONE}/g1"}
    slowest = max(a.elapsed_s for a in answers)
    # One waited out its per-try timeout on g0, then was served by g1, long before
    # its 10 s deadline.
    assert 0.9 < slowest < 4.0, [a.elapsed_s for a in answers]
    # Its health checks time out and no request succeeds on it: down for slowness.
    hung = zone.balancer.view.by_name["g0"]
    await eventually(lambda: not hung.healthy, 3.0, "the hung GPU marked down")
    assert "timed out" in hung.last_error, hung.last_error
    answers = [await zone.infer() for _ in range(5)]
    assert all(a.route == f"{ZONE}/g1" and a.elapsed_s < 0.5 for a in answers), answers


async def test_a_long_generation_at_normal_speed_is_not_cut_by_the_per_try_timeout(
    zone_factory: MakeZone,
) -> None:
    """4000 tokens take over a second here, longer than the per-try floor: the limit
    grows with the request's own expected service time, so nothing is cut."""
    zone = await zone_factory(time_scale=TEST_TIME_SCALE * 1.2)
    await warm(zone)
    answers = await asyncio.gather(zone.infer(4000), zone.stream(4000))
    assert all(a.elapsed_s > 1.0 for a in answers), answers
    # Each was served by the first GPU it went to: no attempt was cut and retried.
    assert counter_values(zone.tier.metrics.retries, ("tier",)).get(("local",), 0.0) == 0


async def test_keepalive_finds_a_hung_gpu_and_fails_its_requests_over(
    zone_factory: MakeZone,
) -> None:
    """Per-try timeout off, GPU keepalive at 1 s + 0.5 s: keepalive alone closes the
    stopped GPU's connections, its calls fail UNAVAILABLE and go to the other GPU."""
    zone = await zone_factory(
        gpu_keepalive={"time_s": 1.0, "timeout_s": 0.5, "without_calls": True},
        per_try_timeout={"enabled": False},
    )
    await warm(zone)
    hung = zone.balancer.view.by_name["g0"]
    zone.pause("g0")
    paused = time.monotonic()
    answers = await asyncio.gather(
        *(zone.infer() for _ in range(3)), *(zone.stream() for _ in range(3))
    )
    assert {a.route for a in answers} == {f"{ZONE}/g1"}
    assert max(a.elapsed_s for a in answers) < 3.0, [a.elapsed_s for a in answers]
    await eventually(lambda: not hung.healthy, 3.0 - (time.monotonic() - paused), "g0 down")
    zone.resume("g0")
    # Continued, it answers its health checks again and takes requests again (four at
    # a time, so the picker uses both GPUs).
    for _ in range(50):
        answers = await asyncio.gather(*(zone.infer() for _ in range(4)))
        if f"{ZONE}/g0" in {a.route for a in answers}:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("g0 never served again after SIGCONT")


# ------------------------------------------------------------------ slow probes


class SlowReadiness(GpuWorker):
    """The emulated GPU, whose ModelReady answers only after 5 s: every readiness
    probe times out while inference goes at normal speed."""

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> Any:
        await asyncio.sleep(5.0)
        return await super().ModelReady(request, context)


@pytest.fixture
async def slow_probe_zone(redis_server: EmbeddedRedis) -> AsyncIterator[Zone]:
    topology = topology_from_mapping(zone_mapping(redis_server.url, health_interval_s=0.2))
    zone_cfg = topology.zone(REGION, ZONE)
    workers = [
        SlowReadiness(g, region=REGION, zone=ZONE, time_scale=TEST_TIME_SCALE)
        for g in zone_cfg.gpus
    ]
    for worker in workers:
        await worker.start()
    tier = build_local_tier(topology, REGION, ZONE)
    await tier.start()
    try:
        async with grpc.aio.insecure_channel(zone_cfg.endpoint.address) as channel:
            yield Zone(tier, pb_grpc.GRPCInferenceServiceStub(channel), {})
    finally:
        await tier.stop(0)
        for worker in workers:
            await worker.stop(0)


async def test_probes_that_time_out_never_empty_a_zone(slow_probe_zone: Zone) -> None:
    zone = slow_probe_zone
    # While requests succeed on them, slow probes are slowness: no GPU is marked down.
    # (Four at a time, so the picker keeps both GPUs busy.)
    until = time.monotonic() + 1.5
    while time.monotonic() < until:
        answers = await asyncio.gather(*(zone.infer() for _ in range(4)))
        assert {a.route for a in answers} == {f"{ZONE}/g0", f"{ZONE}/g1"}
        assert all(g.healthy for g in zone.balancer.view.gpus)
    # Idle, the slow probes mark both down; below the panic threshold every GPU whose
    # connection is up is routed to anyway, and the tier still says it serves.
    await eventually(lambda: zone.balancer.readiness.panicking, 3.0, "panic")
    state = zone.tier.ops_additions.extra_state
    assert state is not None and state()["panic"] is True  # what /api/state shows
    answers = [await zone.infer() for _ in range(10)]
    assert {a.route for a in answers} <= {f"{ZONE}/g0", f"{ZONE}/g1"}
    ready = await zone.stub.ServerReady(pb.ServerReadyRequest(), timeout=1)
    assert ready.ready
