"""Local tier wiring: one zone's GPUs behind a V2 endpoint, publishing the zone's capacity."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import grpc

from common.basics.ticker import Ticker
from common.config.gpu import GpuConfig
from common.config.identity import local
from common.config.node import ConfigError
from common.config.tls import GpuCredentials, TierTls, tier_tls
from common.config.topology import Topology, ZoneConfig
from common.observability.tier_metrics import EjectionCounter, add_local_metrics
from common.observability.tracing import Telemetry, setup_tracing
from common.operations.ops_http import OpsAccess, OpsAdditions
from common.request.children import Child, ChildSet
from common.request.forwarding import ForwardingPolicy
from common.request.proxy import TierSpec
from common.request.resilience import SlowStartConfig
from common.request.routing import RouteHints
from common.tenancy.admission import inner_admission
from common.tier.client_entry import client_front
from common.tier.server import TierServer
from common.tier.wiring import tier_children
from local_lb.admin import LocalAdmin, local_admin
from local_lb.balancer import LocalBalancer
from local_lb.cost import A100_WORK_PER_S
from local_lb.ext_proc import extproc_services
from local_lb.load import BackendMonitor, MonitoredGpu
from local_lb.openai_stub import OpenAIPool, stub_for
from local_lb.policies import picker_factory
from local_lb.publication import LateBoundCallback
from local_lb.readiness import ReadinessRules, connection_ready
from local_lb.state import GpuChild, LocalView
from local_lb.zone_summary import zone_publisher


def gpu_child(cfg: GpuConfig, credentials: grpc.ChannelCredentials | None = None) -> GpuChild:
    """The local tier's view of one GPU, dialled with ``credentials`` (None: plaintext)."""
    return GpuChild(
        name=cfg.name,
        endpoint=cfg.endpoint,
        models=frozenset(cfg.models),
        speed=cfg.speed,
        hardware=cfg.hardware,
        slots=cfg.slots,
        gpu_slots=cfg.max_concurrency if cfg.held_slots is not None else 0,
        versions=dict(cfg.versions),
        rate=cfg.speed * A100_WORK_PER_S,
        tls=cfg.tls,
        credentials=credentials,
        protocol=cfg.protocol,
    )


def zone_gpus(
    tls: TierTls | None, zone_cfg: ZoneConfig, pool: OpenAIPool | None = None
) -> tuple[Callable[[GpuConfig], GpuChild], tuple[GpuChild, ...]]:
    """How to build the view of a GPU (at start and on reload), each dialled as its entry
    says (an OpenAI GPU over ``pool``), and the zone's GPUs built so."""
    dial = GpuCredentials(tls)

    def make_gpu(cfg: GpuConfig) -> GpuChild:
        gpu = gpu_child(cfg, dial(cfg))
        gpu.stub = stub_for(cfg, pool)  # None: its channel's gRPC stub
        return gpu

    return make_gpu, tuple(make_gpu(g) for g in zone_cfg.gpus)


def gpu_details(view: LocalView, gpu: Child) -> dict[str, Any]:
    """What ``/api/state`` adds per GPU: hardware, slots, ejection and what the GPU
    itself last reported (``reported`` is None when that is unknown or stale)."""
    out: dict[str, Any] = {}
    if isinstance(gpu, GpuChild):
        out.update(
            hardware=gpu.hardware,
            slots=gpu.slots,
            ejected=gpu.ejected,
            share=gpu.share,
            weight=gpu.weight,
        )
    now = time.monotonic()
    sample = view.load.get(gpu.name, now, view.report_max_age_s)
    out["reported"] = (
        None
        if sample is None
        else {
            "running": sample.running,
            "waiting": sample.waiting,
            "kv_cache_usage": sample.kv_cache_usage,
            "age_s": sample.age(now),
        }
    )
    return out


def local_balancer(
    topology: Topology,
    view: LocalView,
    children: ChildSet,
    policy: str,
    on_significant_change: Callable[[], None],
    *,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    connected: Callable[[GpuChild], bool] = connection_ready,
) -> LocalBalancer:
    """The zone's balancer with the policy named ``policy`` (ConfigError naming the
    known ones when there is none of that name). The fleet simulator builds the same
    balancer on its simulated ``clock``, with a seeded ``rng`` and no channels
    (``connected``)."""
    rng = rng or random.Random()
    try:
        make = picker_factory(policy, rng)
    except ValueError as exc:
        raise ConfigError(f"--policy: {exc}") from None
    liveness = topology.liveness
    return LocalBalancer(
        view=view,
        picker_factory=make,
        children=children,
        slow_start_config=SlowStartConfig(window_s=topology.slow_start_window_s),
        readiness_rules=ReadinessRules(
            panic_threshold=liveness.panic_threshold,
            slow_probes_before_down=liveness.slow_probes_before_down,
            evidence_s=2 * topology.health_interval_s,
        ),
        tenant_headroom=topology.tenant_headroom,
        tenant_weights={t.id: t.weight for t in topology.auth.tenants},
        on_significant_change=on_significant_change,
        connected=connected,
        clock=clock,
        rng=rng,
    )


def dial_of(balancer: LocalBalancer, gpu: GpuConfig) -> grpc.ChannelCredentials | None:
    """How the tier dials ``gpu`` (its child's credentials; None: plaintext)."""
    return balancer.children.by_name[gpu.name].credentials


def gpu_monitor(
    topology: Topology, zone_cfg: ZoneConfig, balancer: LocalBalancer
) -> BackendMonitor:
    """Health of the zone's GPU servers, told to the balancer's readiness, and their
    own load reports, kept in the view's load book."""
    return BackendMonitor(
        # Health checks dial each GPU as its requests do.
        (MonitoredGpu.from_config(g, dial_of(balancer, g)) for g in zone_cfg.gpus),
        on_health=balancer.readiness.probed,
        up_at=balancer.readiness.up_at,  # a recent success stands in for a check
        book=balancer.view.load,
        interval_s=topology.health_interval_s,
        keepalive=topology.liveness.gpu_keepalive,
    )


def local_ops(view: LocalView, balancer: LocalBalancer, ejections: EjectionCounter) -> OpsAdditions:
    """The local tier's own metrics (queue depth, ejections) and ops state (per GPU)."""
    return OpsAdditions(
        metrics=(lambda m: add_local_metrics(m, balancer.queue_depths, ejections),),
        child_details=lambda gpu: gpu_details(view, gpu),
        extra_state=lambda: {
            "queue": balancer.queue_depths(),
            "panic": balancer.readiness.panicking,
        },
    )


def local_view(topology: Topology, gpus: tuple[GpuChild, ...]) -> LocalView:
    """What the pickers read; a GPU's own report older than four health intervals is stale."""
    return LocalView(gpus, report_max_age_s=4 * topology.health_interval_s)


def no_origin(hints: RouteHints) -> None:
    return None  # the local tier's choice does not depend on geography


# A GPU that sheds load is reported up, so the regional tier can try another zone.
LOCAL_FORWARDING_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


def local_policy(topology: Topology, zone: str) -> ForwardingPolicy:
    """How the zone forwards to its GPUs: which codes fail over, the per-try timeout."""
    return ForwardingPolicy(
        kind="GPU",
        route_prefix=zone,
        failover_codes=LOCAL_FORWARDING_CODES,
        per_try=topology.liveness.per_try_timeout,
    )


def build_local_tier(
    topology: Topology,
    region: str,
    zone: str,
    *,
    policy: str = "default",
    reload_from: Callable[[], Topology] | None = None,
    telemetry: Telemetry | None = None,
    replicas: int = 1,
) -> TierServer:
    """The zone's local tier (for its regional tier only, mutual TLS; Envoy's endpoint picker
    too with ``ext_proc``; with the zone's ``openai_listen``, OpenAI HTTP for clients, as an
    edge: common.tier.client_entry); ``reload_from`` re-reads the topology; ``telemetry``:
    not OTel's; ``replicas``: its processes (``--workers``), sharing that edge's quotas."""
    zone_cfg, tls = topology.zone(region, zone), tier_tls(topology, local(region, zone))
    make_gpu, gpus = zone_gpus(tls, zone_cfg, pool := OpenAIPool.for_zone(zone_cfg.gpus))
    children, view = tier_children(topology, gpus, "GPU", probe=False), local_view(topology, gpus)
    poke_publisher = LateBoundCallback()  # the publisher reads the balancer's queue
    balancer = local_balancer(topology, view, children, policy, poke_publisher)
    monitor = gpu_monitor(topology, zone_cfg, balancer)
    publisher = zone_publisher(topology, view, balancer.queue, region, zone)
    poke_publisher.connect(publisher.poke)
    ejections = EjectionCounter(balancer.ejected_gpus)
    hooks = LocalAdmin(
        region=region, zone=zone, children=children, view=view, balancer=balancer,
        monitor=monitor, make_gpu=make_gpu,
    )  # fmt: skip
    return TierServer(
        TierSpec(tier="local", trust_internal=True, resolve_origin=no_origin, gpu_children=True),
        local_policy(topology, zone),
        children,
        balancer,
        zone_cfg.endpoint,
        publisher=publisher,
        services=[
            pool,
            monitor,
            Ticker(balancer.refresh_all, topology.health_interval_s / 2),
            Ticker(ejections.poll, topology.health_interval_s / 2),
            *extproc_services(zone_cfg.ext_proc, balancer, children, topology.limits),
        ],
        tls=tls,
        admission=inner_admission(topology.auth),
        limits=topology.limits,
        keepalive=topology.liveness.keepalive,
        ops=zone_cfg.ops,
        ops_additions=local_ops(view, balancer, ejections),
        name=zone,
        tenants=topology.auth.tenant_ids,
        ops_access=OpsAccess.of(topology.auth),
        telemetry=telemetry or setup_tracing("meridian-local"),
        admin=local_admin(hooks, topology, reload_from),
        openai=client_front(topology, region, zone=zone, replicas=replicas),
    )
