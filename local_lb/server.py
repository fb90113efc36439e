"""Local tier wiring: one zone's GPUs behind a V2 endpoint, publishing the zone's capacity."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from common.basics.ticker import Ticker
from common.capacity.streams import zone_stream
from common.config.gpu import GpuConfig
from common.config.identity import local
from common.config.node import ConfigError
from common.config.redis_layout import RedisKeys
from common.config.tls import GpuCredentials, TierTls, tier_tls
from common.config.topology import Topology, ZoneConfig
from common.gen.meridian.v1 import capacity_pb2
from common.observability.tier_metrics import EjectionCounter, add_local_metrics
from common.observability.tracing import Telemetry, setup_tracing
from common.operations.ops_http import OpsAccess, OpsAdditions
from common.request.children import Child, ChildSet
from common.request.forwarding import ForwardingPolicy
from common.request.proxy import TierSpec
from common.request.resilience import SlowStartConfig
from common.request.routing import RouteHints
from common.tenancy.admission import inner_admission
from common.tier.server import TierServer, source_id
from common.tier.wiring import summary_publisher, tier_children
from local_lb.admin import LocalAdmin, local_admin
from local_lb.balancer import LocalBalancer
from local_lb.cost import A100_WORK_PER_S, capacity_work_per_s, drain_rps
from local_lb.ext_proc import extproc_services
from local_lb.load import BackendMonitor, MonitoredGpu
from local_lb.openai_stub import OpenAIPool, stub_for
from local_lb.policies import picker_factory
from local_lb.publication import LateBoundCallback
from local_lb.queue import CentralQueue
from local_lb.readiness import ReadinessRules, connection_ready
from local_lb.state import GpuChild, LocalView


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


def zone_summary(
    view: LocalView,
    queue: CentralQueue,
    *,
    source: str,
    sequence: int,
    region: str,
    zone: str,
    now: float | None = None,
) -> capacity_pb2.CapacitySummary:
    """The zone's capacity per model, from this tier's view of its GPUs; ``now`` is the
    view's clock (default: the monotonic clock the servers use).

    Runs on every publication (the cadence and each poke: ~0.25 per request on a busy
    fleet) over every GPU, so the sums are kept in plain numbers per model and written
    to the message once, and a zone whose GPUs all serve the same models (the usual
    one) is summed in one pass without per-model bookkeeping. ``estimated_wait_s`` is
    the queue's wait plus the work in flight over the zone's hardware throughput. A GPU's
    slots count whole, only this process's requests busy (``GpuChild.whole_slots``)."""
    now = time.monotonic() if now is None else now
    gpus = view.gpus
    models = gpus[0].models if gpus else frozenset()
    if len(models) == 1 and all(g.models == models for g in gpus):
        sums = {model: _sums_of_one(view, now) for model in models}
    else:
        sums = _sums_per_model(view, now)
    return capacity_pb2.CapacitySummary(
        source_id=source,
        sequence=sequence,
        timestamp_ms=int(time.time() * 1000),
        region=region,
        zone=zone,
        publisher_healthy=any(g.healthy for g in view.gpus),
        models=[_model_capacity(m, sums[m], view, queue) for m in sorted(sums)],
    )


def _sums_of_one(view: LocalView, now: float) -> _ModelSums:
    """``_sums_per_model`` for a zone whose GPUs all serve one model: the same sums,
    in the same order, in locals, with ``GpuChild.usable``, ``LoadBook.get``'s age rule
    and ``drain_rps`` (when the model's GPUs are the zone's, as the view indexed them)
    written out, this being the summary's whole cost."""
    samples, max_age = view.load.newest, view.report_max_age_s
    healthy = slots_total = busy = queued = 0
    throughput = kv = backlog = 0.0
    drain: float = 0  # as sum() starts
    for gpu in view.gpus:
        if not gpu.healthy or gpu.ejected or gpu.drained:
            continue
        healthy += 1
        slots, whole = gpu.slots, gpu.gpu_slots or gpu.slots  # GpuChild.whole_slots
        slots_total += whole
        inflight = gpu.outstanding_requests
        busy += inflight if inflight <= slots else slots
        throughput += capacity_work_per_s(gpu)
        backlog += gpu.outstanding_work
        drain += slots / (gpu.latency_ewma_s or 1.0)
        sample = samples.get(gpu.name)
        if sample is not None and not now - sample.taken_at > max_age:
            queued += int(sample.waiting)
            if sample.kv_cache_usage is not None:
                kv += sample.kv_cache_usage * whole
    sums = _ModelSums(
        len(view.gpus), healthy, slots_total, busy, throughput, queued, kv, backlog
    )
    (model,) = view.gpus[0].models
    if view.by_model.get(model) == view.gpus:
        sums.drain = drain
    return sums


def _sums_per_model(view: LocalView, now: float) -> dict[str, _ModelSums]:
    sums: dict[str, _ModelSums] = {}
    load, max_age = view.load, view.report_max_age_s
    for gpu in view.gpus:
        usable = gpu.usable
        sample = load.get(gpu.name, now, max_age) if usable else None
        for model in gpu.models:
            acc = sums.get(model)
            if acc is None:
                acc = sums[model] = _ModelSums()
            acc.total_gpus += 1
            if not usable:
                continue
            acc.healthy_gpus += 1
            acc.total_slots += gpu.whole_slots
            acc.busy += min(gpu.outstanding_requests, gpu.slots)
            acc.throughput += capacity_work_per_s(gpu)
            acc.backlog += gpu.outstanding_work
            if sample is not None:
                acc.queued += int(sample.waiting)
                if sample.kv_cache_usage is not None:
                    acc.kv += sample.kv_cache_usage * gpu.whole_slots
    return sums


@dataclass(slots=True)
class _ModelSums:
    """One model's running totals over a zone's GPUs (``zone_summary``)."""

    total_gpus: int = 0
    healthy_gpus: int = 0
    total_slots: int = 0
    busy: int = 0
    throughput: float = 0.0
    queued: int = 0
    kv: float = 0.0
    backlog: float = 0.0
    # drain_rps of the model's GPUs when summed with the rest (else computed apart).
    drain: float | None = None


def _model_capacity(
    model: str, acc: _ModelSums, view: LocalView, queue: CentralQueue
) -> capacity_pb2.ModelCapacity:
    tier_queued = queue.depth_for_model(model)
    queued = acc.queued + tier_queued
    entry = capacity_pb2.ModelCapacity(
        model=model,
        healthy_gpus=acc.healthy_gpus,
        total_gpus=acc.total_gpus,
        total_slots=acc.total_slots,
        free_slots=acc.total_slots - acc.busy,
        queued_requests=queued,
        token_throughput_capacity=acc.throughput,
        busy_slots=acc.busy,
        tier_queued_requests=tier_queued,
    )
    if acc.total_slots:
        entry.utilisation = acc.busy / acc.total_slots
        entry.kv_cache_usage = acc.kv / acc.total_slots
    drain = acc.drain if acc.drain is not None else drain_rps(view.by_model.get(model, ()))
    if queued and drain:
        entry.estimated_wait_s = queued / drain
    if acc.throughput:
        # The work in flight, drained at the zone's capacity (local_lb.cost), so under
        # continuous batching a busier zone is a slower one before a request must queue.
        entry.estimated_wait_s += acc.backlog / acc.throughput
    return entry


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
) -> TierServer:
    """The zone's local tier (for its regional tier only, mutual TLS; Envoy's endpoint picker
    too with ``ext_proc``); ``reload_from`` re-reads the topology; ``telemetry``: not OTel's."""
    zone_cfg, tls = topology.zone(region, zone), tier_tls(topology, local(region, zone))
    make_gpu, gpus = zone_gpus(tls, zone_cfg, pool := OpenAIPool.for_zone(zone_cfg.gpus))
    children, view = tier_children(topology, gpus, "GPU", probe=False), local_view(topology, gpus)
    poke_publisher = LateBoundCallback()  # the publisher reads the balancer's queue
    balancer = local_balancer(topology, view, children, policy, poke_publisher)
    monitor = gpu_monitor(topology, zone_cfg, balancer)
    source = source_id("local", region, zone)  # one per process incarnation
    publisher = summary_publisher(
        topology,
        zone_stream(region, zone),
        lambda seq: zone_summary(
            view, balancer.queue, source=source, sequence=seq, region=region, zone=zone
        ),
        RedisKeys.ZONE_SUMMARIES,
        region,
    )
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
    )
