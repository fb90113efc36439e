"""Whether each GPU of the zone is routed to: probe verdicts, slowness, traffic, panic.

``GpuReadiness`` is the one writer of a GPU's ``healthy`` (through
``ChildSet.mark_healthy`` / ``mark_failed``, so the free pools, the zone's summary
and its own grpc.health status follow). The rules:

1. A health check the GPU answered is its own verdict: SERVING with a model ready
   is ready; NOT_SERVING, or no model ready, is down at once. A GPU without
   grpc.health.v1 (MLServer) is checked by V2 ServerReady instead, to the same
   verdicts (``common.request.health``).
2. A check whose call failed (refused, reset, closed by keepalive) is down at once.
3. A check that ran out of time is *slow*, not a verdict: under load the prober's
   own deadline is what fails first. A GPU is down for slowness only after
   ``slow_probes_before_down`` slow checks in a row with no request succeeding on
   it in between; a request that succeeds ends that.
4. A request that fails UNAVAILABLE marks the GPU down (direct evidence).
5. Panic, after Envoy's healthy_panic_threshold: while fewer than
   ``panic_threshold`` of the zone's GPUs (drained ones aside) are ready and not
   ejected, every GPU down by rules 2-4 that is up by direct evidence — its
   connection is READY (keepalive closes a hung GPU's), or a request succeeded on
   it within ``evidence_s`` and nothing failed on it since — is routed to as if
   ready, so slow probes never empty a zone. What a GPU says of itself (rule 1)
   is believed even then.

Caches, per GPU, its last verdict and the evidence behind it (a run of slow
checks, its last success); ``forget`` drops a GPU that left the zone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from common.request.children import ChildSet
from common.request.health import GpuCheck
from local_lb.state import GpuChild, LocalView

log = logging.getLogger(__name__)

# Verdicts. REFUSED is the GPU's own word; the others may be the prober's trouble.
READY, REFUSED, UNREACHABLE, SLOW, FAILED = "ready", "refused", "unreachable", "slow", "failed"


@dataclass(frozen=True)
class ReadinessRules:
    """The thresholds of the rules (see the module docstring)."""

    panic_threshold: float = 0.5
    slow_probes_before_down: int = 3
    # How recent a success must be to count as evidence that a GPU is up.
    evidence_s: float = 1.0


@dataclass(slots=True)
class _Evidence:
    verdict: str = READY
    reason: str = ""
    slow_checks: int = 0  # in a row, with no request succeeding since the first
    served_at: float = float("-inf")
    # The last failed call to it (a request, a health check): newer evidence than a
    # success before it.
    failed_at: float = float("-inf")


def connection_ready(gpu: GpuChild) -> bool:
    """The GPU's request channel is connected (asking an idle one to connect, so the
    next look can tell)."""
    channel = gpu.channel
    if channel is None:
        return False
    return channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY


@dataclass
class GpuReadiness:
    """Turns health checks and request outcomes into each GPU's ``healthy``."""

    view: LocalView
    children: ChildSet
    rules: ReadinessRules = field(default_factory=ReadinessRules)
    connected: Callable[[GpuChild], bool] = connection_ready
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._evidence: dict[str, _Evidence] = {}
        self._settling = False
        self.panicking = False

    def _of(self, name: str) -> _Evidence:
        evidence = self._evidence.get(name)
        if evidence is None:
            evidence = self._evidence[name] = _Evidence()
        return evidence

    # ------------------------------------------------------------------ evidence

    def probed(self, name: str, check: GpuCheck) -> None:
        """A health check of GPU ``name`` ended (rules 1-3)."""
        gpu = self.view.by_name.get(name)
        if gpu is None:  # removed by a reload meanwhile
            return
        evidence = self._of(name)
        if check.slow:
            evidence.slow_checks += 1
            if evidence.slow_checks < self.rules.slow_probes_before_down:
                return
            why = (
                f"{evidence.slow_checks} health checks in a row timed out and no request "
                f"succeeded meanwhile ({check.reason})"
            )
            self._judge(gpu, evidence, SLOW, why)
            return
        evidence.slow_checks = 0
        verdict = READY if check.healthy else REFUSED if check.answered else UNREACHABLE
        if verdict == UNREACHABLE:
            evidence.failed_at = self.clock()
        self._judge(gpu, evidence, verdict, check.reason)

    def request_succeeded(self, gpu: GpuChild) -> None:
        """A request succeeded on ``gpu``: it is up, whatever slow probes said. O(1)
        unless that brings it back."""
        evidence = self._of(gpu.name)
        evidence.served_at = self.clock()
        evidence.slow_checks = 0  # a run of slow checks starts again
        if evidence.verdict == SLOW:
            self._judge(gpu, evidence, READY, "")

    def up_at(self, name: str) -> float:
        """When a request last succeeded on GPU ``name``, if it is ready and nothing failed
        on it since (-inf: no such evidence). The GPU monitor skips an active check of a
        GPU whose success is younger than its interval: that success is the evidence."""
        evidence = self._evidence.get(name)
        if evidence is None or evidence.verdict != READY:
            return float("-inf")
        if evidence.failed_at >= evidence.served_at:
            return float("-inf")
        return evidence.served_at

    def request_failed(self, gpu: GpuChild, reason: str) -> None:
        """A request to ``gpu`` failed UNAVAILABLE (rule 4)."""
        evidence = self._of(gpu.name)
        evidence.failed_at = self.clock()
        self._judge(gpu, evidence, FAILED, reason)

    def _judge(self, gpu: GpuChild, evidence: _Evidence, verdict: str, reason: str) -> None:
        """Record a verdict: a new one re-derives the whole zone (the share of ready GPUs
        may cross the panic threshold), the same one only this GPU (O(1): every check
        of every GPU ends here)."""
        changed = verdict != evidence.verdict
        evidence.verdict, evidence.reason = verdict, reason
        if changed:
            self.settle()
        else:
            self._apply(gpu, evidence, self.clock())

    def forget(self, name: str) -> None:
        self._evidence.pop(name, None)

    # ------------------------------------------------------------------ decision

    def settle(self) -> None:
        """Re-derive every GPU's ``healthy`` from its verdict and, in panic, its evidence
        (rule 5); listeners hear of the changes once, at the end. O(GPUs)."""
        if self._settling:  # a listener of the changes made here
            return
        self._settling = True
        try:
            with self.children.changes():
                self._settle()
        finally:
            self._settling = False

    def _settle(self) -> None:
        pool = [g for g in self.view.gpus if not g.drained]
        ready = sum(1 for g in pool if self._of(g.name).verdict == READY and not g.ejected)
        panic = bool(pool) and ready < self.rules.panic_threshold * len(pool)
        if panic != self.panicking:
            self.panicking = panic
            if panic:
                log.warning(
                    "panic: %d of %d GPUs ready, below %.0f%%: routing over every GPU "
                    "up by direct evidence",
                    ready,
                    len(pool),
                    100 * self.rules.panic_threshold,
                    extra={"event": "panic", "ready": ready, "gpus": len(pool)},
                )
            else:
                fields = {"event": "panic_over", "ready": ready, "gpus": len(pool)}
                log.info("panic over: %d of %d GPUs ready", ready, len(pool), extra=fields)
        now = self.clock()
        for gpu in self.view.gpus:
            self._apply(gpu, self._of(gpu.name), now)

    def _apply(self, gpu: GpuChild, evidence: _Evidence, now: float) -> None:
        """Set one GPU's ``healthy`` from its verdict and, in panic, its evidence."""
        if evidence.verdict == READY:
            self.children.mark_healthy(gpu)
            gpu.last_error = ""  # also a "panic: ..." note once it is ready again
        elif self.panicking and evidence.verdict != REFUSED and self._up(gpu, evidence, now):
            self.children.mark_healthy(gpu)
            gpu.last_error = f"panic: routed to although {evidence.reason}"
        else:
            self.children.mark_failed(gpu, evidence.reason)

    def _up(self, gpu: GpuChild, evidence: _Evidence, now: float) -> bool:
        served = evidence.served_at > evidence.failed_at
        if served and now - evidence.served_at <= self.rules.evidence_s:
            return True
        return self.connected(gpu)
