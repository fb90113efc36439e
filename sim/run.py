"""One simulation run: a fleet, a workload, a scenario and one policy, in simulated time.

Every policy of a comparison gets the same arrivals (the workload's stream for
one seed) and the same fleet events; only the routing differs. A tiered policy
routes through a ``SimDeployment`` (``sim.flow``); the greedy clairvoyant
reference dispatches over the same ``SimGpu`` models directly (``sim.greedy``);
the ``bound`` row is computed per request with no GPU simulated (``sim.bound``).
Arrivals are fed as they fall due, so at most the requests in flight are held in
memory.

Requests ask for the models the topology serves: the workload's ``models`` mix
when it names one (each must be served), else every served model in proportion
to the GPUs serving it. A run in which a policy serves no request fails, naming
the policy and how its requests ended: a comparison of nothing is no result.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from common.basics.geo import GeoPoint, rtt_estimate_ms
from common.config.topology import Topology
from sim.bound import BOUND, LowerBound
from sim.busy_window import BusyWindow
from sim.capacity import fleet_capacity_rps
from sim.clock import run_simulated
from sim.deployment import SimDeployment, SimSettings
from sim.flash import Crowd
from sim.flow import RequestFlow
from sim.gpu_model import SimGpu
from sim.greedy import GreedyClairvoyant, PlacedGpu
from sim.measure import PolicyResult, Recorder, Slo
from sim.policies import GREEDY, policy_set
from sim.requests import SimRequest
from sim.scenarios import Scenario, apply, target_region
from sim.stats import cumulative_shares
from sim.workload import Boost, WorkloadSpec, generate

Progress = Callable[[int], None]
Serve = Callable[[SimRequest], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class RunSpec:
    """What one run simulates; ``requests`` bounds the arrivals."""

    topology: Topology
    workload: WorkloadSpec
    scenario: Scenario
    policy: str
    requests: int
    seed: int = 1
    settings: SimSettings = field(default_factory=SimSettings)
    slo: Slo = field(default_factory=Slo)
    warmup_fraction: float = 0.1
    # A CSV trace to replay instead of the workload's arrivals (its own times and rate).
    trace: Path | None = None


class Geography:
    """RTTs from client origins to regions, and each city's home (nearest) region."""

    def __init__(self, topology: Topology) -> None:
        self.locations = {r.name: r.location for r in topology.regions}
        self._home: dict[GeoPoint, str] = {}

    def rtt_ms(self, origin: GeoPoint, region: str) -> float:
        return rtt_estimate_ms(origin, self.locations[region])

    def home(self, origin: GeoPoint) -> str:
        home = self._home.get(origin)
        if home is None:
            home = self._home[origin] = min(self.locations, key=lambda r: self.rtt_ms(origin, r))
        return home


def arrival_rate(spec: RunSpec) -> float:
    """The scenario's load as requests per second of this fleet and workload."""
    prompt, output = spec.workload.mean_tokens()
    gpus = [g for r in spec.topology.regions for z in r.zones for g in z.gpus]
    return spec.scenario.load * fleet_capacity_rps(gpus, prompt, output)


def scenario_workload(spec: RunSpec, geography: Geography) -> WorkloadSpec:
    """The workload at the scenario's rate, with its flash crowd or flood as boosts, and
    a compressed day's diurnal curve spanning the run."""
    rate = arrival_rate(spec)
    duration = spec.requests / rate
    boosts: list[Boost] = []
    crowd, flood = spec.scenario.crowd, spec.scenario.flood
    if crowd is not None:
        region = target_region(spec.topology).name
        cities = frozenset(
            c.name for c in spec.workload.cities if geography.home(c.location) == region
        )
        start = crowd.at * duration
        boosts.append(Boost(start, start + crowd.seconds, crowd.factor, cities=cities))
    if flood is not None:
        start = flood.at * duration
        tenant = spec.workload.tenants[0].id
        boosts.append(Boost(start, start + flood.seconds, flood.factor, tenant=tenant))
    start_utc, day_s = spec.workload.start_utc_hour, spec.workload.day_length_s
    if spec.scenario.compressed_day:
        # One whole day per run, from midnight UTC: every region's peak passes.
        start_utc, day_s = 0.0, duration
    return replace(
        spec.workload,
        models=workload_models(spec.workload.models, spec.topology),
        rate_rps=rate,
        max_requests=spec.requests,
        # The run is its requests, however long they take to arrive (the workload's
        # own default stops at 60 s: 282 000 requests at 90 % of 1024 GPUs).
        duration_s=None,
        boosts=tuple(boosts),
        seed=spec.seed,
        start_utc_hour=start_utc,
        day_length_s=day_s,
    )


def workload_models(
    asked: tuple[tuple[str, float], ...], topology: Topology
) -> tuple[tuple[str, float], ...]:
    """The model mix requests draw from: ``asked`` when given (ValueError naming a model
    no GPU serves), else every model the topology serves, by its GPU count."""
    served = topology.models
    if not served:
        raise ValueError("the topology serves no model: none of its GPUs lists one")
    for model, _ in asked:
        if model not in served:
            raise ValueError(
                f"the workload asks for model {model!r}, which no GPU of the topology "
                f"serves; it serves: {', '.join(sorted(served))}"
            )
    if asked:
        return asked
    gpus = [g for r in topology.regions for z in r.zones for g in z.gpus]
    return tuple((m, float(sum(m in g.models for g in gpus))) for m in sorted(served))


def run(spec: RunSpec, progress: Progress | None = None) -> PolicyResult:
    """Simulate ``spec`` to the last request's end; the recorder's result."""
    return run_with_events(spec, progress)[0]


def run_with_events(
    spec: RunSpec, progress: Progress | None = None, recorder: Recorder | None = None
) -> tuple[PolicyResult, list[tuple[float, str]]]:
    """``run``, and the scenario's events as (simulated time, label). ``recorder``: the
    one to report to (default: one at ``spec``'s SLO and warm-up)."""
    return run_simulated(_run(spec, progress, recorder))


def _arrivals(spec: RunSpec, geography: Geography) -> tuple[Iterator[SimRequest], float]:
    """The requests to feed and the simulated time they span."""
    if spec.trace is not None:
        from sim.trace_csv import read_trace  # only a replay needs the CSV reader

        models = workload_models(spec.workload.models, spec.topology)
        trace = read_trace(spec.trace, seed=spec.seed, model=models[0][0], caps=spec.workload.caps)
        replay = list(itertools.islice(trace, spec.requests))
        if not replay:
            raise ValueError(f"{spec.trace}: the trace holds no request")
        if len(models) > 1:
            replay = _spread_models(replay, models, spec.seed)
        return iter(replay), max(replay[-1].at_s, 1e-3)
    workload = scenario_workload(spec, geography)
    return generate(workload), spec.requests / workload.rate_rps


def _spread_models(
    replay: list[SimRequest], models: tuple[tuple[str, float], ...], seed: int
) -> list[SimRequest]:
    """A trace's requests, each asking for a model drawn from ``models`` (a trace names
    none)."""
    shares = cumulative_shares(models)
    rng = random.Random(f"models:{seed}")
    out = []
    for req in replay:
        u = rng.random()
        out.append(replace(req, model=next(m for share, m in shares if u < share)))
    return out


def _bound_result(
    spec: RunSpec,
    arrivals: Iterator[SimRequest],
    duration: float,
    recorder: Recorder,
    progress: Progress | None,
) -> PolicyResult:
    """The lower bound of every request (``sim.bound``), recorded as a policy's would be."""
    bound = LowerBound(spec.topology, rtt_estimate_ms)
    geography = Geography(spec.topology)
    end, n = duration, 0
    for n, req in enumerate(arrivals, 1):
        if progress is not None and n % 1000 == 0:
            progress(n)
        floor = bound.latency(req)
        recorder.served(
            req,
            region=floor.region,
            zone="",
            gpu="",
            home_region=geography.home(req.origin),
            rtt_ms=floor.rtt_ms,
            ttft_s=floor.ttft_s,
            e2e_s=floor.e2e_s,
            cached_tokens=0,
            attempts=1,
        )
        end = max(end, req.at_s + floor.e2e_s)
    if progress is not None and n % 1000:
        progress(n)
    return recorder.finish([], duration_s=end, events=_event_labels(spec, duration))


async def _run(
    spec: RunSpec, progress: Progress | None, recorder: Recorder | None
) -> tuple[PolicyResult, list[tuple[float, str]]]:
    loop = asyncio.get_running_loop()
    geography = Geography(spec.topology)
    arrivals, duration = _arrivals(spec, geography)
    if recorder is None:
        recorder = Recorder(slo=spec.slo, warmup_s=spec.warmup_fraction * duration)
    if spec.policy == BOUND:
        return _bound_result(spec, arrivals, duration, recorder, progress), _event_labels(
            spec, duration
        )
    deployment: SimDeployment | None = None
    if spec.policy == GREEDY:
        gpus = [
            PlacedGpu(SimGpu(g, loop, time_scale=spec.topology.time_scale), r.name, z.name)
            for r in spec.topology.regions
            for z in r.zones
            for g in z.gpus
        ]
        greedy = GreedyClairvoyant(gpus, geography.rtt_ms, recorder, geography.home)
        serve: Serve = greedy.serve
        sim_gpus = [p.gpu for p in gpus]
    else:
        deployment = SimDeployment(
            spec.topology,
            policy_set(spec.policy),
            loop,
            replace(spec.settings, seed=spec.seed),
        )
        flow = RequestFlow(deployment, recorder, rtt_ms=rtt_estimate_ms)
        deployment.start()
        serve = flow.serve
        sim_gpus = deployment.gpus
    events = _schedule_events(spec, duration, sim_gpus, deployment, loop)
    loaded = BusyWindow(sim_gpus, recorder.warmup_s, duration)
    loop.call_at(loaded.start_s, loaded.begin)
    loop.call_at(loaded.end_s, loaded.end)
    await _feed(arrivals, serve, loop, progress)
    if deployment is not None:
        deployment.stop()
    crowd = None
    if spec.scenario.crowd is not None:
        start = spec.scenario.crowd.at * duration
        crowd = Crowd(target_region(spec.topology).name, start, start + spec.scenario.crowd.seconds)
    result = recorder.finish(
        sim_gpus,
        duration_s=loop.time(),
        events=events,
        crowd=crowd,
        loaded_shares=loaded.shares,
    )
    if result.offered and not result.served:
        codes = ", ".join(f"{code} {n}" for code, n in result.failed.items())
        raise RuntimeError(
            f"policy {spec.policy!r} served none of the {result.offered} requests in "
            f"scenario {spec.scenario.name!r} ({codes}): check that its pickers may route "
            "to the topology's regions and that the GPUs serve the requests' models"
        )
    return result, events


def _schedule_events(
    spec: RunSpec,
    duration: float,
    gpus: list[SimGpu],
    deployment: SimDeployment | None,
    loop: asyncio.AbstractEventLoop,
) -> list[tuple[float, str]]:
    rng = random.Random(spec.seed ^ 0x5EED)
    for event in spec.scenario.events:
        loop.call_at(event.at * duration, apply, event, spec.topology, gpus, deployment, rng)
    return _event_labels(spec, duration)


def _event_labels(spec: RunSpec, duration: float) -> list[tuple[float, str]]:
    """The scenario's events as (simulated time, label), boosts included."""
    out = [(e.at * duration, e.label(spec.topology)) for e in spec.scenario.events]
    crowd, flood = spec.scenario.crowd, spec.scenario.flood
    if crowd is not None:
        out.append((crowd.at * duration, f"flash crowd {crowd.factor:g}x"))
    if flood is not None:
        out.append((flood.at * duration, f"tenant flood {flood.factor:g}x"))
    return out


async def _feed(
    requests: Iterator[SimRequest],
    serve: Serve,
    loop: asyncio.AbstractEventLoop,
    progress: Progress | None,
) -> None:
    """Start each request when it falls due; return when every one has ended. A request
    whose routing raised (a bug: every refusal is recorded as a failure) ends the run
    with that exception rather than leaving a hole in the figures."""
    feed = _Feed(requests, serve, loop, progress)
    feed.start_due()
    await feed.fed
    while feed.pending:
        await asyncio.wait(list(feed.pending))
    if feed.broken:
        raise feed.broken[0]


class _Feed:
    """Starts the requests as they fall due, on timers rather than a sleeping task.

    It keeps the event order a task sleeping until each arrival had: a timer at the
    same instant (``loop.time() + delay``, as ``asyncio.sleep`` sets it) whose
    callback takes one more loop turn (as the sleeper's wake-up did) to start the
    request's task — without a future and a task step per arrival."""

    def __init__(
        self,
        requests: Iterator[SimRequest],
        serve: Serve,
        loop: asyncio.AbstractEventLoop,
        progress: Progress | None,
    ) -> None:
        self.requests = enumerate(requests, 1)
        self.serve, self.loop, self.progress = serve, loop, progress
        self.pending: set[asyncio.Task[None]] = set()
        self.broken: list[BaseException] = []
        self.fed: asyncio.Future[None] = loop.create_future()
        self._next: tuple[int, SimRequest] | None = next(self.requests, None)

    def start_due(self) -> None:
        """Start every request due now; arm a timer for the next one (or say all are
        fed, or that feeding stopped because a request's routing raised)."""
        loop, pending = self.loop, self.pending
        while self._next is not None and not self.broken:
            n, req = self._next
            delay = req.at_s - loop.time()
            if delay > 0:
                loop.call_at(loop.time() + delay, self._due)
                return
            task = loop.create_task(self.serve(req))
            pending.add(task)
            task.add_done_callback(self._ended)
            if self.progress is not None and n % 1000 == 0:
                self.progress(n)
            self._next = next(self.requests, None)
            if self._next is None and self.progress is not None and n % 1000:
                self.progress(n)  # the last count too: every arrival was fed
        self.fed.set_result(None)

    def _due(self) -> None:
        self.loop.call_soon(self.start_due)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self.pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.broken.append(task.exception())  # type: ignore[arg-type]
