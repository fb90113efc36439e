"""The local tier's side of the Admin API: GPUs as nodes, weights, topology reload.

A drained GPU is out of the free pools at once (``GpuChild.usable``), so no
new request and no queued one is bound to it, while the requests it runs
finish and its health keeps being checked; the zone's summary counts it as
having no capacity. A weight scales the GPU's hardware speed in the default
picker's cost. On reload a new GPU starts as down and joins once the monitor
finds it serving (then ramps up through slow start); a removed one is
drained, and once its requests have ended it is forgotten everywhere (monitor,
outlier detector, circuit breaker, slow start, load reports, prefix index).
A kept GPU takes over changed models, speed, ``max_concurrency``, hardware,
versions and metrics endpoint (the monitor checks the new models and scrapes
the new endpoint); an address or ``tls`` change is not applied
(``common.operations.reload``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.config.gpu import GpuConfig
from common.config.node import ConfigError
from common.config.topology import Topology
from common.gen.meridian.v1 import admin_pb2 as apb
from common.operations.admin import AdminService, TierHooks
from common.operations.reload import reload_children
from common.request.children import Child, ChildSet
from local_lb.balancer import LocalBalancer
from local_lb.load import BackendMonitor, MonitoredGpu
from local_lb.state import GpuChild, LocalView


@dataclass(kw_only=True)
class LocalAdmin:
    """TierHooks of one local tier."""

    region: str
    zone: str
    children: ChildSet
    view: LocalView
    balancer: LocalBalancer
    monitor: BackendMonitor
    make_gpu: Callable[[GpuConfig], GpuChild]

    def describe(self, child: Child) -> apb.Node:
        assert isinstance(child, GpuChild)
        node = apb.Node(
            name=child.name,
            kind="gpu",
            endpoint=child.endpoint.address,
            healthy=child.healthy,
            drained=child.drained,
            weight=child.weight,
            outstanding_requests=max(0, child.outstanding_requests),
            last_error=child.last_error,
            healthy_gpus=int(child.usable),
            total_gpus=1,
            total_slots=child.slots,
            free_slots=max(0, child.free_slots) if child.usable else 0,
            utilisation=min(1.0, max(0, child.outstanding_requests) / child.slots),
            hardware=child.hardware,
            rate=child.rate,
            ejected=child.ejected,
            reported_running=-1.0,
            reported_waiting=-1.0,
            kv_cache_usage=-1.0,
        )
        sample = self.view.load.get(child.name, time.monotonic(), self.view.report_max_age_s)
        if sample is not None:
            node.reported_running = sample.running
            node.reported_waiting = sample.waiting
            node.queued_requests = int(sample.waiting)
            if sample.kv_cache_usage is not None:
                node.kv_cache_usage = sample.kv_cache_usage
        return node

    def set_weight(self, child: Child, weight: float) -> None:
        assert isinstance(child, GpuChild)
        child.weight = weight

    async def reload(self, topology: Topology) -> apb.TierReload:
        try:
            configs = {g.name: g for g in topology.zone(self.region, self.zone).gpus}
        except ConfigError:  # this zone is gone: keep serving what it has
            return apb.TierReload()
        report = await reload_children(
            self.children,
            [self.make_gpu(cfg) for cfg in configs.values()],
            on_added=lambda gpu: self.monitor.add(
                MonitoredGpu.from_config(configs[gpu.name], gpu.credentials)
            ),
            on_gone=self._gone,
        )
        changed = bool(report.added or report.changed)
        for gpu in self._gpus():
            cfg = configs.get(gpu.name)
            if (
                cfg is not None
                and cfg.name not in report.added
                and not self.children.leaving(gpu.name)
            ):
                if gpu.tls != cfg.tls:  # its channel is open: like its address, not applied
                    report.not_applied.append(f"{gpu.name}: tls (add it under a new name instead)")
                if gpu.protocol != cfg.protocol:  # its stub is made: not applied either
                    report.not_applied.append(f"{gpu.name}: protocol (add it under a new name)")
                changes = await self._take_settings(gpu, cfg)
                if changes:
                    changed = True
                    report.changed.append(f"{gpu.name}: {', '.join(changes)}")
        if changed:  # a no-op reload leaves pools and picker alone
            self.balancer.set_gpus(self._gpus())
        return report

    async def _take_settings(self, gpu: GpuChild, cfg: GpuConfig) -> list[str]:
        """The GPU-only settings of a kept GPU (models and speed: reload_children), and
        what its monitor checks: the GPU's models at its current address (an address
        change is not applied), and the new metrics endpoint."""
        watched = MonitoredGpu.from_config(cfg, gpu.credentials)
        watched = dataclasses.replace(
            watched, address=gpu.endpoint.address, models=gpu.models, protocol=gpu.protocol
        )
        before = self.monitor.watched(gpu.name)
        changes: list[str] = []
        if before is not None and before.metrics_url != watched.metrics_url:
            changes.append(f"metrics {before.metrics_url} -> {watched.metrics_url}")
        await self.monitor.update(watched)
        if gpu.whole_slots != cfg.max_concurrency or gpu.slots != cfg.slots:
            changes.append(f"max_concurrency {gpu.whole_slots} -> {cfg.max_concurrency}")
            gpu.slots = cfg.slots  # this worker's share of them under --workers
            gpu.gpu_slots = cfg.max_concurrency if cfg.held_slots is not None else 0
        if gpu.hardware != cfg.hardware:
            changes.append(f"hardware {gpu.hardware} -> {cfg.hardware}")
            gpu.hardware = cfg.hardware
        if dict(gpu.versions) != dict(cfg.versions):
            changes.append("versions")
            gpu.versions = dict(cfg.versions)
        return changes

    def _gpus(self) -> list[GpuChild]:
        return [g for g in self.children if isinstance(g, GpuChild)]

    async def _gone(self, child: Child) -> None:
        """A removed GPU finished its last request: stop watching it (no health
        callback follows), then forget it everywhere at once, so no timer (an
        ejection running out) and no later lookup names a GPU the view lost."""
        await self.monitor.remove(child.name)
        self.balancer.forget(child.name)
        self.balancer.set_gpus([g for g in self._gpus() if g is not child])


def local_admin(
    hooks: LocalAdmin, topology: Topology, source: Callable[[], Topology] | None
) -> AdminService:
    return AdminService(
        "local",
        hooks.zone,
        hooks.children,
        topology,
        TierHooks(hooks.describe, hooks.reload, hooks.set_weight),
        source=source,
    )
