"""The validation bench's simulated side: the same zone and shots through the simulator.

``run_sim`` builds a ``sim.deployment.SimDeployment`` of the same topology (its
one region and zone, the local tier's real ``LocalBalancer`` over one ``SimGpu``
per GPU at the topology's time scale) and routes every shot through
``sim.flow.RequestFlow`` on a ``sim.clock`` simulated loop, with the servers'
own pickers at every tier (the ``meridian`` set of ``sim.policies``). The client
stands at the region's location, so the flow adds no RTT. As the real side
waits for the tier's first health check before sending, arrivals here start
``WARM_S`` after the deployment, once the first summaries have gone up.

``replay`` takes the routing out: each shot straight onto the ``SimGpu`` the
real local tier chose, which tests the GPU model alone.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bench.sim_validation_workload import Shot
from common.config.topology import Topology
from sim.clock import run_simulated
from sim.deployment import SimDeployment, SimSettings, TierPolicies
from sim.flow import RequestFlow
from sim.gpu_model import SimGpu, SimJob
from sim.policies import MERIDIAN, policy_set
from sim.requests import SimRequest

WARM_S = 1.0


@dataclass
class _Kept:
    """The flow's recorder: each served request's end-to-end time, and the failures."""

    latencies_s: dict[int, float] = field(default_factory=dict)
    gpu_of: dict[int, str] = field(default_factory=dict)
    failures: Counter[str] = field(default_factory=Counter)

    retried: int = 0

    def served(self, req: SimRequest, **fate: Any) -> None:
        self.latencies_s[req.id] = fate["e2e_s"]
        self.gpu_of[req.id] = fate["gpu"]
        self.retried += fate["attempts"] > 1

    def failed(self, req: SimRequest, **fate: Any) -> None:
        self.failures[fate["code"]] += 1


@dataclass
class SimResult:
    latencies_s: dict[int, float]  # id -> end-to-end, served requests
    gpu_of: dict[int, str]
    failed: dict[str, int]
    retried: int  # served requests that took more than one attempt (per-try timeouts)
    requests_per_gpu: dict[str, int]
    prefix_hit_share: float
    mean_batch: dict[str, float]  # per GPU: running sequences, averaged over the run


def replay(
    topology: Topology, shots: Sequence[Shot], gpu_of: Mapping[int, str]
) -> dict[int, float]:
    """Each shot on ``SimGpu`` alone, on the GPU ``gpu_of`` names (the real local tier's
    choice), at its arrival: the GPU model's latencies with the routing taken out. A
    request the real tier retried is put straight on the GPU that served it."""
    return run_simulated(_replay(topology, shots, gpu_of))


async def _replay(
    topology: Topology, shots: Sequence[Shot], gpu_of: Mapping[int, str]
) -> dict[int, float]:
    loop = asyncio.get_running_loop()
    gpus = {
        g.name: SimGpu(g, loop, time_scale=topology.time_scale)
        for r in topology.regions
        for z in r.zones
        for g in z.gpus
    }
    jobs: dict[int, SimJob] = {}
    for shot in shots:
        if shot.id not in gpu_of:
            continue  # not served on the real side: nothing to place
        delay = shot.at_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        jobs[shot.id] = gpus[gpu_of[shot.id]].submit(
            shot.prompt_tokens, shot.max_tokens, shot.blocks
        )
    await asyncio.gather(*(job.done for job in jobs.values()))
    at = {s.id: s.at_s for s in shots}
    return {i: job.finished_at - at[i] for i, job in jobs.items()}


def run_sims(
    topology: Topology, shots: Sequence[Shot], *, runs: int, jitter_s: float, seed: int = 1
) -> list[SimResult]:
    """The first run on the exact arrivals, each further one on arrivals moved later by
    up to ``jitter_s`` (seeded): how far the simulated quantiles move when the timing
    moves as little as the real client's sends do. A router whose choices follow the
    GPUs' state is chaotic: a millisecond sends one request elsewhere, and what follows
    differs. One real run is one such draw; so is one simulated run."""
    rng = random.Random(seed)
    out = [run_sim(topology, shots, seed=seed)]
    for i in range(1, runs):
        moved = sorted(
            (replace(s, at_s=s.at_s + rng.uniform(0.0, jitter_s)) for s in shots),
            key=lambda s: s.at_s,
        )
        out.append(run_sim(topology, moved, seed=seed + i))
    return out


def run_sim(
    topology: Topology,
    shots: Sequence[Shot],
    *,
    seed: int = 1,
    policies: TierPolicies | None = None,
) -> SimResult:
    """Route ``shots`` through the simulated deployment of ``topology``."""
    return run_simulated(_run(topology, shots, seed, policies or policy_set(MERIDIAN)))


async def _run(
    topology: Topology, shots: Sequence[Shot], seed: int, policies: TierPolicies
) -> SimResult:
    loop = asyncio.get_running_loop()
    deployment = SimDeployment(topology, policies, loop, SimSettings(seed=seed))
    kept = _Kept()
    flow = RequestFlow(deployment, kept)
    deployment.start()
    tasks = []
    for shot in shots:
        req = shot.sim_request(WARM_S)
        delay = req.at_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(flow.serve(req)))
    await asyncio.gather(*tasks)
    span = loop.time() - WARM_S
    deployment.stop()
    gpus = deployment.gpus
    prompt = sum(g.prompt_tokens_total for g in gpus)
    return SimResult(
        latencies_s=kept.latencies_s,
        gpu_of=kept.gpu_of,
        failed=dict(kept.failures),
        retried=kept.retried,
        requests_per_gpu=dict(Counter(kept.gpu_of.values())),
        prefix_hit_share=sum(g.cached_tokens_total for g in gpus) / prompt if prompt else 0.0,
        mean_batch={g.name: g.slot_s / span for g in gpus},
    )
