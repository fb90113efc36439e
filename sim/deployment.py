"""A whole deployment built from a topology, out of the servers' own parts, in simulated time.

For every tier the simulator builds what the tier's wiring builds, minus the
sockets: the global tier's region ``ChildSet`` and ``RankingBalancer`` over the
policy's region picker (for ``meridian``, ``global_lb.server.region_picker``);
per region a zone ``ChildSet``, a ``RankingBalancer`` over its zone picker and a
publisher of ``regional_lb.server.region_summary``; per zone the local tier's
``LocalBalancer`` from ``local_lb.server.local_balancer`` (picker, central
queue, tenant headroom, ejection, readiness), a publisher of
``local_lb.server.zone_summary``, and one ``SimGpu`` per GPU. Each tier process
forwards with the servers' own loop, a ``Forwarder`` with the policy its server
builds and a retry budget of its own (``tier_forwarder``). Every clock is the
simulated loop's. What replaces I/O: summaries reach the parent's
``take_summary`` after a propagation delay (``sim.publishing``); the local
tier's metrics scrape reads each ``SimGpu`` on the health interval; a tier that
is down answers UNAVAILABLE at once, and the parent's probe marks it healthy
again once it is back (the servers' health watch and probe loop).

The request path through these parts is ``sim.flow``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from common.config.topology import RegionConfig, Topology, ZoneConfig
from common.request.balancer import Balancer, RankingBalancer
from common.request.children import Child, ChildSet
from common.request.forwarding import Forwarder, ForwardingPolicy
from common.request.health import GpuCheck
from common.request.pick import Picker
from common.request.resilience import RetryBudget
from global_lb.server import global_policy, region_children
from local_lb.balancer import LocalBalancer
from local_lb.load_book import LoadSample
from local_lb.publication import LateBoundCallback
from local_lb.server import local_balancer, local_policy, local_view, zone_gpus
from local_lb.zone_summary import zone_summary
from regional_lb.server import region_summary, regional_policy, zone_children
from sim.gpu_model import SimGpu
from sim.publishing import SimPublisher, every


class TierPolicies(Protocol):
    """Which picker each tier runs (``sim.policies.PolicySet``)."""

    @property
    def name(self) -> str: ...

    @property
    def region_picker(self) -> Callable[[Topology, random.Random], Picker]: ...

    @property
    def zone_picker(self) -> Callable[[Topology, RegionConfig, random.Random], Picker]: ...

    @property
    def local_policy(self) -> str: ...


@dataclass(frozen=True)
class SimSettings:
    """How the simulated deployment differs from the servers: only in what I/O cost."""

    # Time from a tier building its summary to the parent holding it (Redis XADD + XREAD).
    propagation_s: float = 0.05
    seed: int = 1


def _no_hint(model: str) -> str | None:
    """A tier that publishes no capacity (the global tier): no hint on its answers."""
    return None


def tier_forwarder(
    policy: ForwardingPolicy,
    balancer: Balancer,
    publisher: SimPublisher | None,
    clock: Callable[[], float],
    seed: str,
) -> Forwarder:
    """How one tier process forwards to its children: the servers' ``Forwarder`` with
    the policy the tier's server builds (failover codes, attempts, per-try timeout),
    its balancer, a retry budget of its own at the servers' default settings and the
    capacity hint its publisher holds, on the simulated clock. Its back-off jitter
    draws from a stream of its own (``seed``: the deployment's seed and the tier's
    name), so it depends on no other part's draws. The simulator runs one process per
    tier instance: a deployment of N global replicas or ``--workers`` N has N budgets,
    each with its floor of 3 retries, where this has one."""
    return Forwarder(
        policy,
        balancer,
        budget=RetryBudget(),
        hint_source=publisher.hint if publisher is not None else _no_hint,
        rng=random.Random(seed),
        clock=clock,
    )


@dataclass(eq=False)
class SimZone:
    """One local tier and its GPUs."""

    region: str
    cfg: ZoneConfig
    balancer: LocalBalancer
    gpus: dict[str, SimGpu]
    publisher: SimPublisher
    forwarding: Forwarder
    up: bool = True

    def __post_init__(self) -> None:
        # What a scrape of each GPU that answers says (immutable, so built once).
        self.ready_checks = {
            name: GpuCheck(True, "", frozenset(gpu.cfg.models)) for name, gpu in self.gpus.items()
        }


@dataclass(eq=False)
class SimRegion:
    """One regional tier and the zones behind it."""

    cfg: RegionConfig
    zones: ChildSet
    balancer: RankingBalancer
    local: dict[str, SimZone]
    publisher: SimPublisher
    forwarding: Forwarder
    up: bool = True


@dataclass(eq=False)
class SimDeployment:
    """Every tier of ``topology`` running ``policies``, on ``loop``'s simulated clock."""

    topology: Topology
    policies: TierPolicies
    loop: asyncio.AbstractEventLoop
    settings: SimSettings = field(default_factory=SimSettings)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.settings.seed)
        topo, clock = self.topology, self.loop.time
        self.regions = ChildSet(
            region_children(topo),
            probe_interval_s=topo.health_interval_s,
            summary_ttl_s=topo.summary_ttl_s,
            kind="region",
            probe=False,
            clock=clock,
        )
        self.global_balancer = RankingBalancer(
            self.policies.region_picker(topo, self._rng()), self.regions
        )
        self.global_forwarding = tier_forwarder(
            global_policy(topo), self.global_balancer, None, clock, self._seed("global")
        )
        self.by_region = {r.name: self._region(r) for r in topo.regions}
        self.zones = {z.cfg.name: z for r in self.by_region.values() for z in r.local.values()}
        self.zones_by_gpu = {name: z for z in self.zones.values() for name in z.gpus}
        self.gpus = [g for z in self.zones.values() for g in z.gpus.values()]
        self._stops: list[Callable[[], None]] = []

    def _rng(self) -> random.Random:
        return random.Random(self.rng.getrandbits(64))

    def _seed(self, tier: str) -> str:
        return f"forwarding:{self.settings.seed}:{tier}"

    def _region(self, cfg: RegionConfig) -> SimRegion:
        topo = self.topology
        zones = ChildSet(
            zone_children(cfg),
            probe_interval_s=topo.health_interval_s,
            summary_ttl_s=topo.summary_ttl_s,
            kind="zone",
            probe=False,
            clock=self.loop.time,
        )
        balancer = RankingBalancer(self.policies.zone_picker(topo, cfg, self._rng()), zones)
        publisher = SimPublisher(
            self.loop,
            lambda seq: region_summary(
                zones, source=f"regional:{cfg.name}", sequence=seq, region=cfg.name
            ),
            lambda summary: self.regions.take_summary(cfg.name, summary),
            cadence_s=topo.summary_cadence_s,
            propagation_s=self.settings.propagation_s,
        )
        zones.add_listener(publisher.poke)  # as the tier server wires it
        local = {z.name: self._zone(cfg.name, z, zones) for z in cfg.zones}
        forwarding = tier_forwarder(
            regional_policy(topo, cfg.name),
            balancer,
            publisher,
            self.loop.time,
            self._seed(f"region {cfg.name}"),
        )
        return SimRegion(cfg, zones, balancer, local, publisher, forwarding)

    def _zone(self, region: str, cfg: ZoneConfig, parent: ChildSet) -> SimZone:
        topo = self.topology
        _, gpu_children = zone_gpus(None, cfg)
        children = ChildSet(
            gpu_children,
            probe_interval_s=topo.health_interval_s,
            summary_ttl_s=topo.summary_ttl_s,
            kind="GPU",
            probe=False,
            clock=self.loop.time,
        )
        view = local_view(topo, gpu_children)
        poke = LateBoundCallback()
        balancer = local_balancer(
            topo,
            view,
            children,
            self.policies.local_policy,
            poke,
            clock=self.loop.time,
            rng=self._rng(),
            connected=lambda gpu: True,
        )
        publisher = SimPublisher(
            self.loop,
            lambda seq: zone_summary(
                view,
                balancer.queue,
                source=f"local:{cfg.name}",
                sequence=seq,
                region=region,
                zone=cfg.name,
                now=self.loop.time(),
            ),
            lambda summary: parent.take_summary(cfg.name, summary),
            cadence_s=topo.summary_cadence_s,
            propagation_s=self.settings.propagation_s,
        )
        poke.connect(publisher.poke)
        children.add_listener(publisher.poke)
        gpus = {g.name: SimGpu(g, self.loop, time_scale=topo.time_scale) for g in cfg.gpus}
        forwarding = tier_forwarder(
            local_policy(topo, cfg.name),
            balancer,
            publisher,
            self.loop.time,
            self._seed(f"zone {cfg.name}"),
        )
        return SimZone(region, cfg, balancer, gpus, publisher, forwarding)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Publish every summary once, then run the tiers' periodic work."""
        interval = self.topology.health_interval_s
        for zone in self.zones.values():
            zone.publisher.start()
            self._stops.append(every(self.loop, interval / 2, zone.balancer.refresh_all))
            self._stops.append(every(self.loop, interval, partial(self._scrape, zone)))
        for region in self.by_region.values():
            region.publisher.start()
        self._stops.append(every(self.loop, interval, self._probe))

    def stop(self) -> None:
        for stop in self._stops:
            stop()
        for zone in self.zones.values():
            zone.publisher.stop()
        for region in self.by_region.values():
            region.publisher.stop()

    def _scrape(self, zone: SimZone) -> None:
        """The local tier's BackendMonitor: each GPU's health and its own load report."""
        now = self.loop.time()
        book, readiness = zone.balancer.view.load, zone.balancer.readiness
        with zone.balancer.children.changes():
            for gpu in zone.gpus.values():
                if gpu.up and zone.up:
                    book.update(
                        gpu.name,
                        LoadSample(
                            gpu.running, len(gpu.waiting), gpu.kv_cache_usage, now, "metrics"
                        ),
                    )
                    readiness.probed(gpu.name, zone.ready_checks[gpu.name])
                else:
                    readiness.probed(
                        gpu.name, GpuCheck(False, "connection refused", answered=False)
                    )

    def _probe(self) -> None:
        """The upper tiers' probe loops: a child marked down that answers again is back."""
        for region in self.by_region.values():
            self._probe_child(self.regions, self.regions.by_name[region.cfg.name], region.up)
            for zone in region.local.values():
                self._probe_child(region.zones, region.zones.by_name[zone.cfg.name], zone.up)

    @staticmethod
    def _probe_child(children: ChildSet, child: Child, up: bool) -> None:
        if up and not child.healthy:
            children.mark_healthy(child)
        elif not up and child.healthy:
            children.mark_failed(child, "UNAVAILABLE: connection refused")
