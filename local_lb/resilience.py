"""Resilience state of the zone's GPUs: outlier ejection, circuit breaker, slow start."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.request.resilience import (
    CircuitBreaker,
    OutlierConfig,
    OutlierDetector,
    SlowStart,
    SlowStartConfig,
)
from local_lb.state import GpuChild, LocalView

log = logging.getLogger(__name__)


def _ignore(gpu: GpuChild, ejected: bool) -> None:
    return None


@dataclass
class GpuResilience:
    """Envoy-style outlier ejection, a circuit breaker and slow start, per GPU.

    Algorithm: the outlier detector ejects a GPU after consecutive failures (never
    more than its cap of the ``set_total`` GPUs) and returns it when its time is up;
    a GPU that returns from ejection or recovers its health ramps its ``share`` up
    through slow start. The breaker caps pending requests per GPU. Each ejection
    change sets ``GpuChild.ejected`` and is then passed to ``on_ejection`` (the
    balancer recounts slots and re-binds the queue there).

    Caches ``GpuChild.share`` (the slow-start factor), refreshed by ``refresh``:
    pickers read it on every pick and the factor moves slowly. Failure mode: an
    ejection runs out only when something asks (``refresh``, the detector's own
    checks), so a GPU may stay out up to one refresh tick longer than its time.
    ``forget`` drops a GPU that left the set, so no timer names it later.
    """

    view: LocalView
    outlier_config: OutlierConfig = field(default_factory=OutlierConfig)
    slow_start_config: SlowStartConfig = field(default_factory=SlowStartConfig)
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    on_ejection: Callable[[GpuChild, bool], None] = _ignore
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.outlier = OutlierDetector(
            self.outlier_config,
            clock=self.clock,
            total_children=len(self.view.gpus),
            on_change=self._ejection_changed,
        )
        self.slow_start = SlowStart(self.slow_start_config, clock=self.clock)

    def record_success(self, name: str) -> None:
        self.outlier.record_success(name)

    def record_failure(self, name: str) -> None:
        self.outlier.record_failure(name)

    def ejected_keys(self) -> frozenset[str]:
        return self.outlier.ejected_keys()

    def set_total(self, n: int) -> None:
        """The number of GPUs the ejection cap is a share of (after a reload)."""
        self.outlier.set_total(n)

    def refresh(self, gpu: GpuChild) -> None:
        """Let an ejection run out, start slow start on a recovery, update the share."""
        if gpu.ejected:
            self.outlier.is_ejected(gpu.name)  # un-ejects (via the callback) when time is up
        if gpu.healthy and gpu.healthy_since > gpu.last_seen_healthy:
            self.slow_start.start(gpu.name)  # recovered: ramp its share up again
            gpu.last_seen_healthy = gpu.healthy_since
        gpu.share = self.slow_start.factor(gpu.name)

    def forget(self, name: str) -> None:
        self.outlier.forget(name)
        self.breaker.forget(name)
        self.slow_start.forget(name)

    def _ejection_changed(self, name: str, ejected: bool) -> None:
        gpu = self.view.by_name.get(name)
        if gpu is None:  # removed by a reload
            return
        gpu.ejected = ejected
        if ejected:
            fields = {"event": "gpu_ejected", "gpu": name}
            log.warning("GPU %s ejected after consecutive failures", name, extra=fields)
        else:
            self.slow_start.start(name)
            gpu.share = self.slow_start.factor(name)
        self.on_ejection(gpu, ejected)
