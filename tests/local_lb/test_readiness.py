"""GpuReadiness: what marks a GPU down, what a slow probe is, and the panic threshold.

Real GPUs, a real ChildSet and view, an injected clock and connection state; one
named test per rule of ``local_lb/readiness.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.request.children import ChildSet
from common.request.health import GpuCheck
from local_lb.readiness import GpuReadiness, ReadinessRules
from local_lb.state import GpuChild, LocalView
from tests.local_lb.parts import Clock, gpus

SERVING = GpuCheck(True, "SERVING, 1/1 models ready", frozenset({"m"}))
NOT_SERVING = GpuCheck(False, "health check: NOT_SERVING")
UNREACHABLE = GpuCheck(False, "health check: UNAVAILABLE: refused", answered=False)
SLOW = GpuCheck(False, "health check: DEADLINE_EXCEEDED", answered=False, slow=True)


@dataclass
class Zone:
    readiness: GpuReadiness
    view: LocalView
    clock: Clock
    up: set[str] = field(default_factory=set)  # GPUs whose connection is READY
    notified: list[int] = field(default_factory=list)

    def gpu(self, name: str) -> GpuChild:
        return self.view.by_name[name]

    def healthy(self) -> set[str]:
        return {g.name for g in self.view.gpus if g.healthy}


def zone(n: int = 4, **rules: float) -> Zone:
    clock = Clock()
    members = gpus(n)
    view = LocalView(tuple(members))
    children = ChildSet(members, probe_interval_s=1, summary_ttl_s=3, probe=False, clock=clock)
    made = Zone(None, view, clock)  # type: ignore[arg-type]
    made.readiness = GpuReadiness(
        view,
        children,
        ReadinessRules(**rules),  # type: ignore[arg-type]
        connected=lambda gpu: gpu.name in made.up,
        clock=clock,
    )
    children.add_listener(lambda: made.notified.append(1))
    return made


def slow_checks(z: Zone, name: str, n: int) -> None:
    for _ in range(n):
        z.clock.now += 0.5
        z.readiness.probed(name, SLOW)


def test_an_answered_not_serving_marks_the_gpu_down_at_once() -> None:
    z = zone()
    z.readiness.probed("g0", NOT_SERVING)
    assert "g0" not in z.healthy() and z.gpu("g0").last_error == "health check: NOT_SERVING"


def test_a_failed_health_call_marks_the_gpu_down_at_once() -> None:
    z = zone()
    z.readiness.probed("g0", UNREACHABLE)
    assert "g0" not in z.healthy()


def test_a_serving_check_brings_a_gpu_back() -> None:
    z = zone()
    z.readiness.probed("g0", NOT_SERVING)
    z.readiness.probed("g0", SERVING)
    assert "g0" in z.healthy() and z.gpu("g0").last_error == ""


def test_slow_checks_below_the_threshold_are_no_verdict() -> None:
    z = zone()
    slow_checks(z, "g0", 2)
    assert z.healthy() == {"g0", "g1", "g2", "g3"}


def test_slow_checks_in_a_row_without_a_success_mark_the_gpu_down() -> None:
    z = zone()
    slow_checks(z, "g0", 3)
    assert "g0" not in z.healthy()
    assert z.gpu("g0").last_error.startswith("3 health checks in a row timed out")


def test_a_success_between_slow_checks_starts_the_run_again() -> None:
    z = zone()
    slow_checks(z, "g0", 2)
    z.readiness.request_succeeded(z.gpu("g0"))
    slow_checks(z, "g0", 2)
    assert "g0" in z.healthy()
    slow_checks(z, "g0", 1)
    assert "g0" not in z.healthy()


def test_a_success_brings_back_a_gpu_down_for_slowness() -> None:
    z = zone()
    slow_checks(z, "g0", 3)
    z.readiness.request_succeeded(z.gpu("g0"))
    assert "g0" in z.healthy()


def test_a_serving_check_ends_a_run_of_slow_ones() -> None:
    z = zone()
    slow_checks(z, "g0", 2)
    z.readiness.probed("g0", SERVING)
    slow_checks(z, "g0", 2)
    assert "g0" in z.healthy()


def test_a_failed_request_marks_the_gpu_down() -> None:
    z = zone()
    z.readiness.request_failed(z.gpu("g0"), "UNAVAILABLE: connection reset")
    assert "g0" not in z.healthy()
    assert z.gpu("g0").last_error == "UNAVAILABLE: connection reset"


def test_at_half_the_gpus_ready_there_is_no_panic() -> None:
    z = zone()
    z.up = {"g0", "g1", "g2", "g3"}
    for name in ("g0", "g1"):
        slow_checks(z, name, 3)
    assert not z.readiness.panicking and z.healthy() == {"g2", "g3"}


def test_below_the_threshold_gpus_up_by_their_connection_are_routed_to() -> None:
    z = zone()
    z.up = {"g0", "g1"}  # g2's connection is down too
    for name in ("g0", "g1", "g2"):
        slow_checks(z, name, 3)
    assert z.readiness.panicking
    assert z.healthy() == {"g0", "g1", "g3"}
    assert z.gpu("g0").last_error.startswith("panic: routed to although 3 health checks")


def test_in_panic_a_recent_success_is_evidence_enough() -> None:
    z = zone(n=2, evidence_s=1.0)
    for name in ("g0", "g1"):
        z.readiness.request_failed(z.gpu(name), "UNAVAILABLE: reset")
    assert z.readiness.panicking and z.healthy() == set()
    z.clock.now += 0.1
    z.readiness.request_succeeded(z.gpu("g0"))  # an in-flight request finished fine
    z.readiness.settle()
    assert z.healthy() == {"g0"}
    z.clock.now += 1.5  # the evidence ages out
    z.readiness.settle()
    assert z.healthy() == set()


def test_in_panic_a_success_older_than_a_failure_is_no_evidence() -> None:
    z = zone(n=2, evidence_s=1.0)
    z.readiness.request_succeeded(z.gpu("g0"))
    z.clock.now += 0.1
    z.readiness.probed("g0", UNREACHABLE)  # killed right after
    z.readiness.probed("g1", UNREACHABLE)
    assert z.readiness.panicking and z.healthy() == set()


def test_in_panic_a_gpu_that_says_it_is_not_serving_stays_down() -> None:
    z = zone(n=2)
    z.up = {"g0", "g1"}
    z.readiness.probed("g0", NOT_SERVING)
    z.readiness.probed("g1", NOT_SERVING)
    assert z.readiness.panicking and z.healthy() == set()


def test_panic_ends_when_enough_gpus_are_ready_again() -> None:
    z = zone(n=2)
    z.up = {"g0", "g1"}
    for name in ("g0", "g1"):
        slow_checks(z, name, 3)
    assert z.readiness.panicking and z.healthy() == {"g0", "g1"}
    z.readiness.probed("g0", SERVING)
    assert not z.readiness.panicking
    assert z.healthy() == {"g0"}  # g1 is down for slowness again, without panic


def test_a_panic_threshold_of_zero_never_panics() -> None:
    z = zone(n=2, panic_threshold=0.0)
    z.up = {"g0", "g1"}
    for name in ("g0", "g1"):
        slow_checks(z, name, 3)
    assert not z.readiness.panicking and z.healthy() == set()


def test_drained_gpus_are_not_counted_for_panic() -> None:
    z = zone(n=4)
    z.up = {"g0", "g1", "g2", "g3"}
    for name in ("g0", "g1"):
        z.gpu(name).drained = True
    slow_checks(z, "g2", 3)
    # One of the two GPUs in rotation is ready: 50 %, no panic.
    assert not z.readiness.panicking and "g2" not in z.healthy()


def test_listeners_hear_of_a_settle_once_whatever_it_changed() -> None:
    z = zone(n=4)
    z.up = {"g0", "g1", "g2", "g3"}
    for name in ("g0", "g1", "g2"):
        slow_checks(z, name, 2)
    z.notified.clear()
    for name in ("g0", "g1", "g2"):
        slow_checks(z, name, 1)
    # g0 went down, then g1 (2 of 4 ready: no panic yet), then g2 started the panic,
    # which brought three back at once: one notification each time.
    assert len(z.notified) == 3 and z.healthy() == {"g0", "g1", "g2", "g3"}


def test_a_removed_gpu_is_forgotten_and_its_late_check_ignored() -> None:
    z = zone(n=2)
    z.readiness.forget("g9")
    z.readiness.probed("g9", NOT_SERVING)  # not in the zone: nothing happens
    assert z.healthy() == {"g0", "g1"}
