"""GpuResilience: ejection after consecutive failures, return through slow start, forget."""

from __future__ import annotations

from common.request.resilience import OutlierConfig, SlowStartConfig
from local_lb.resilience import GpuResilience
from local_lb.state import GpuChild, LocalView
from tests.local_lb.parts import Clock, gpus


def rig(n: int = 2) -> tuple[GpuResilience, LocalView, Clock, list[tuple[str, bool]]]:
    clock = Clock()
    view = LocalView(tuple(gpus(n)))
    changes: list[tuple[str, bool]] = []

    def on_ejection(gpu: GpuChild, ejected: bool) -> None:
        changes.append((gpu.name, ejected))

    resilience = GpuResilience(
        view,
        OutlierConfig(consecutive_failures=3, base_ejection_s=30.0),
        SlowStartConfig(window_s=10.0),
        on_ejection=on_ejection,
        clock=clock,
    )
    return resilience, view, clock, changes


def test_consecutive_failures_eject_the_gpu_and_tell_the_owner() -> None:
    resilience, view, _, changes = rig()
    for _ in range(3):
        resilience.record_failure("g0")
    assert view.by_name["g0"].ejected and changes == [("g0", True)]
    assert resilience.ejected_keys() == {"g0"}


def test_a_success_between_failures_resets_the_run() -> None:
    resilience, view, _, changes = rig()
    for _ in range(2):
        resilience.record_failure("g0")
    resilience.record_success("g0")
    resilience.record_failure("g0")
    assert not view.by_name["g0"].ejected and changes == []


def test_an_ejection_runs_out_at_refresh_and_the_gpu_ramps_up_through_slow_start() -> None:
    resilience, view, clock, changes = rig()
    g0 = view.by_name["g0"]
    for _ in range(3):
        resilience.record_failure("g0")
    clock.now += 30.0
    resilience.refresh(g0)
    assert not g0.ejected and changes == [("g0", True), ("g0", False)]
    assert g0.share < 1.0
    clock.now += 10.0
    resilience.refresh(g0)
    assert g0.share == 1.0


def test_a_recovered_gpu_starts_slow_start_once_per_recovery() -> None:
    resilience, view, clock, _ = rig()
    g0 = view.by_name["g0"]
    g0.healthy_since = clock.now
    resilience.refresh(g0)
    assert g0.share < 1.0 and g0.last_seen_healthy == clock.now
    clock.now += 10.0
    resilience.refresh(g0)  # same recovery: no new ramp
    assert g0.share == 1.0


def test_a_forgotten_gpu_is_no_longer_ejected_or_ramping() -> None:
    resilience, *_ = rig()
    for _ in range(3):
        resilience.record_failure("g0")
    resilience.slow_start.start("g0")
    resilience.forget("g0")
    assert resilience.ejected_keys() == frozenset()
    assert resilience.slow_start.factor("g0") == 1.0


def test_the_ejection_cap_follows_set_total() -> None:
    resilience, _, _, changes = rig(n=2)
    resilience.set_total(2)  # 10 % of 2: still one may always be ejected
    for name in ("g0", "g1"):
        for _ in range(3):
            resilience.record_failure(name)
    assert changes == [("g0", True)]  # the second would exceed the cap
