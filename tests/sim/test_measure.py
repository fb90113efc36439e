"""Recorder: every figure of a PolicyResult against one computed here from the same inputs."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from dataclasses import dataclass, field

import pytest

from common.basics.geo import GeoPoint
from sim.measure import Crowd, PolicyResult, Recorder, Slo
from sim.requests import SimRequest

PARIS = GeoPoint(48.86, 2.35)


@dataclass(frozen=True)
class FakeCfg:
    max_concurrency: int


@dataclass
class FakeGpu:
    """What Recorder.finish reads of a SimGpu."""

    name: str
    busy_s: float
    slot_s: float
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    cfg: FakeCfg = field(default_factory=lambda: FakeCfg(16))


def request(i: int, at: float, *, tenant: str = "acme", city: str = "Paris") -> SimRequest:
    return SimRequest(
        i, at, city, PARIS, tenant, prompt_tokens=100, output_tokens=10, max_tokens=10
    )


def serve(
    rec: Recorder,
    req: SimRequest,
    ttft: float,
    e2e: float,
    *,
    region: str = "eu-west",
    home: str = "eu-west",
    rtt_ms: float = 10.0,
    attempts: int = 1,
) -> None:
    rec.served(
        req,
        region=region,
        zone=f"{region}-a",
        gpu="g0",
        home_region=home,
        rtt_ms=rtt_ms,
        ttft_s=ttft,
        e2e_s=e2e,
        cached_tokens=0,
        attempts=attempts,
    )


def fail(rec: Recorder, req: SimRequest, code: str = "UNAVAILABLE") -> None:
    rec.failed(req, code=code, home_region="eu-west", elapsed_s=0.1, attempts=2)


def pct(values: list[float], q: int) -> float:
    """The q-th percentile by the standard library (inclusive = linear interpolation)."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


GPUS = [FakeGpu("g0", busy_s=50.0, slot_s=400.0)]


def random_run(seed: int, n: int = 2000) -> tuple[Recorder, list[tuple[float, float]], int]:
    rng = random.Random(seed)
    rec = Recorder(slo=Slo(ttft_s=1.0, e2e_s=8.0))
    pairs = []
    failed = 0
    for i in range(n):
        req = request(i, rng.uniform(0, 100))
        if rng.random() < 0.05:
            fail(rec, req, rng.choice(["UNAVAILABLE", "RESOURCE_EXHAUSTED"]))
            failed += 1
            continue
        ttft = rng.lognormvariate(-1.0, 0.8)
        e2e = ttft + rng.lognormvariate(1.2, 0.6)
        serve(rec, req, ttft, e2e)
        pairs.append((ttft, e2e))
    return rec, pairs, failed


def test_percentiles_are_exact_over_every_offered_request_a_failure_infinitely_late() -> None:
    rec, pairs, failed = random_run(1)
    result = rec.finish(GPUS, duration_s=100.0)
    ttft, e2e = [p[0] for p in pairs], [p[1] for p in pairs]
    # About 5 % failed: P50 and P90 fall among the served (a failure ranks above every
    # time, as a huge one would), the P99 among the failures.
    assert 0.02 < failed / (failed + len(pairs)) < 0.08
    for name, values in (("ttft", ttft), ("e2e", e2e)):
        for q in (50, 90):
            expected = pct(values + [1e9] * failed, q)
            assert getattr(result, f"{name}_p{q}_s") == pytest.approx(expected, rel=1e-12)
        assert getattr(result, f"{name}_p99_s") == math.inf


def test_a_percentile_below_the_failures_is_the_served_one_and_survives_json() -> None:
    rec = Recorder(slo=Slo())
    for i in range(99):
        serve(rec, request(i, 1.0), 0.1, 1.0 + i / 100)
    fail(rec, request(99, 1.0))
    result = rec.finish(GPUS, duration_s=10.0)
    assert result.e2e_p50_s == pytest.approx(1.495)
    # Rank 98.01 of 0..99: between the last served (1.98 s) and the failure.
    assert result.e2e_p99_s == math.inf and result.tenants["acme"].e2e_p99_s == math.inf
    back = PolicyResult.from_json(json.loads(json.dumps(result.to_json(), allow_nan=False)))
    assert back.e2e_p99_s == math.inf and back.e2e_p50_s == result.e2e_p50_s


def test_goodput_is_a_share_of_the_offered_requests_and_failures_count_against_it() -> None:
    rec, pairs, failed = random_run(2)
    result = rec.finish(GPUS, duration_s=100.0)
    offered = len(pairs) + failed
    assert failed > 50
    assert (result.offered, result.served, result.failed_total) == (offered, len(pairs), failed)
    assert result.goodput_ttft == sum(t <= 1.0 for t, _ in pairs) / offered
    assert result.goodput_e2e == sum(e <= 8.0 for _, e in pairs) / offered
    assert result.goodput == sum(t <= 1.0 and e <= 8.0 for t, e in pairs) / offered
    assert result.goodput < sum(t <= 1.0 and e <= 8.0 for t, e in pairs) / len(pairs)


def test_failures_are_counted_by_code() -> None:
    rec = Recorder(slo=Slo())
    for i, code in enumerate(["UNAVAILABLE", "RESOURCE_EXHAUSTED", "UNAVAILABLE"]):
        fail(rec, request(i, 1.0 + i), code)
    serve(rec, request(9, 2.0), 0.1, 1.0)
    result = rec.finish(GPUS, duration_s=10.0)
    assert result.failed == {"RESOURCE_EXHAUSTED": 1, "UNAVAILABLE": 2}
    assert result.goodput == 1 / 4


def test_requests_arriving_before_the_warm_up_are_not_counted() -> None:
    rec = Recorder(slo=Slo(), warmup_s=10.0)
    serve(rec, request(0, 9.99), 5.0, 50.0)  # would be the P99 and miss both SLOs
    fail(rec, request(1, 3.0))
    later = [(0.2, 3.0), (0.4, 4.0), (0.3, 2.0)]
    for i, (ttft, e2e) in enumerate(later):
        serve(rec, request(2 + i, 10.0 + i), ttft, e2e, attempts=1 + i)
    result = rec.finish(GPUS, duration_s=20.0)
    assert (result.offered, result.served, result.failed_total) == (3, 3, 0)
    assert result.e2e_p99_s == pytest.approx(pct([e for _, e in later], 99))
    assert result.goodput == 1.0
    assert result.retried == 2
    assert result.timeline.start_s == 10.0


def test_utilisation_slot_occupancy_and_prefix_hit_rate_from_the_gpus() -> None:
    duration = 200.0
    gpus = [
        FakeGpu(
            "a", busy_s=100.0, slot_s=1600.0, prompt_tokens_total=1000, cached_tokens_total=400
        ),
        FakeGpu("b", busy_s=160.0, slot_s=900.0, prompt_tokens_total=3000, cached_tokens_total=600),
        FakeGpu("c", busy_s=200.0, slot_s=800.0, cfg=FakeCfg(8)),
        FakeGpu("d", busy_s=40.0, slot_s=0.0),
    ]
    rec = Recorder(slo=Slo())
    serve(rec, request(0, 1.0), 0.1, 1.0)
    result = rec.finish(gpus, duration_s=duration)
    util = [0.5, 0.8, 1.0, 0.2]
    assert result.gpus == 4
    assert result.util_mean == pytest.approx(statistics.fmean(util))
    assert result.util_std == pytest.approx(statistics.pstdev(util))
    # Sorted 0.2, 0.5, 0.8, 1.0: P10 at rank 0.3, P90 at rank 2.7.
    assert result.util_p10 == pytest.approx(0.2 + 0.3 * (0.5 - 0.2))
    assert result.util_p90 == pytest.approx(0.8 + 0.7 * (1.0 - 0.8))
    assert result.utilisation_cdf == sorted(util)
    slots = [1600 / (16 * duration), 900 / (16 * duration), 800 / (8 * duration), 0.0]
    assert result.slot_occupancy_mean == pytest.approx(statistics.fmean(slots))
    assert result.prefix_hit_rate == pytest.approx(1000 / 4000)


def test_utilisation_while_loaded_is_the_windows_shares_and_unknown_without_them() -> None:
    rec = Recorder(slo=Slo())
    serve(rec, request(0, 1.0), 0.1, 1.0)
    result = rec.finish(GPUS, duration_s=20.0, loaded_shares=[0.9, 1.0, 0.6, 0.95])
    assert result.util_loaded_mean == pytest.approx(statistics.fmean([0.9, 1.0, 0.6, 0.95]))
    # Sorted 0.6, 0.9, 0.95, 1.0: P10 at rank 0.3.
    assert result.util_loaded_p10 == pytest.approx(0.6 + 0.3 * (0.9 - 0.6))
    assert result.ratio_to(result)["util_loaded_mean"] == pytest.approx(1.0)
    unknown = rec.finish(GPUS, duration_s=20.0)
    assert unknown.util_loaded_mean is None and unknown.util_loaded_p10 is None
    # Results written before the window was measured still read back, as unknown.
    data = result.to_json()
    del data["util_loaded_mean"], data["util_loaded_p10"]
    back = PolicyResult.from_json(data)
    assert back.util_loaded_mean is None and back.e2e_p99_s == result.e2e_p99_s


def test_the_utilisation_cdf_keeps_at_most_200_points_first_and_last_included() -> None:
    gpus = [FakeGpu(f"g{i}", busy_s=float(i), slot_s=0.0) for i in range(1024)]
    result = Recorder(slo=Slo()).finish(gpus, duration_s=1024.0)
    cdf = result.utilisation_cdf
    assert len(cdf) == 200
    assert cdf == sorted(cdf)
    assert (cdf[0], cdf[-1]) == (0.0, 1023 / 1024)


def test_cross_region_share_and_the_rtt_leaving_home_added() -> None:
    rec = Recorder(slo=Slo())
    for i, rtt in enumerate([10.0, 12.0, 11.0]):
        serve(rec, request(i, 1.0), 0.1, 1.0, rtt_ms=rtt)
    serve(rec, request(3, 1.0), 0.1, 1.0, region="us-east", rtt_ms=90.0)
    serve(rec, request(4, 1.0), 0.1, 1.0, region="eu-north", rtt_ms=40.0)
    serve(rec, request(5, 1.0, city="Boston"), 0.1, 1.0, region="us-east", home="us-east")
    result = rec.finish(GPUS, duration_s=10.0)
    assert result.cross_region_share == pytest.approx(2 / 6)
    # Without the home RTT: each request's RTT over the least seen from its city (10 ms).
    assert result.added_rtt_ms == pytest.approx(((90 - 10) + (40 - 10)) / 2)
    assert result.served_by_region == {"eu-north": 1, "eu-west": 3, "us-east": 2}
    told = rec.finish(GPUS, duration_s=10.0, rtt_home_ms=lambda city, home: 5.0)
    assert told.added_rtt_ms == pytest.approx(((90 - 5) + (40 - 5)) / 2)


def test_per_tenant_counts_p99_and_goodput() -> None:
    rng = random.Random(3)
    rec = Recorder(slo=Slo(ttft_s=1.0, e2e_s=5.0))
    seen: dict[str, list[float]] = {"acme": [], "flood": []}
    for i in range(600):
        tenant = "flood" if i % 3 else "acme"
        e2e = rng.uniform(0.5, 3.0) * (3.0 if tenant == "flood" else 1.0)
        serve(rec, request(i, rng.uniform(0, 50), tenant=tenant), 0.2, e2e)
        seen[tenant].append(e2e)
    fail(rec, request(900, 5.0, tenant="flood"))
    result = rec.finish(GPUS, duration_s=50.0)
    assert set(result.tenants) == {"acme", "flood"}
    for tenant, values in seen.items():
        stats = result.tenants[tenant]
        assert stats.served == len(values)
        # The flood's one failure ranks above every served time (as a huge one would).
        assert stats.e2e_p99_s == pytest.approx(pct(values + [1e9] * (tenant == "flood"), 99))
        offered = len(values) + (tenant == "flood")
        assert stats.goodput == pytest.approx(sum(v <= 5.0 for v in values) / offered)
    assert (result.tenants["acme"].failed, result.tenants["flood"].failed) == (0, 1)


def steady_run(
    latency: dict[int, float], *, rate: int = 20, seconds: int = 300, region_of: object = None
) -> Recorder:
    """``rate`` arrivals per second for ``seconds``; the e2e of an arrival in second s is
    ``latency.get(s, 1.0)`` times a small deterministic jitter."""
    rec = Recorder(slo=Slo())
    rng = random.Random(4)
    i = 0
    for s in range(seconds):
        for k in range(rate):
            at = s + k / rate
            e2e = latency.get(s, 1.0) * rng.uniform(0.95, 1.05)
            region = region_of(s, k) if callable(region_of) else "eu-west"
            serve(rec, request(i, at), 0.1, e2e, region=region)
            i += 1
    return rec


def test_recovery_time_after_latency_doubles_for_30_seconds() -> None:
    rec = steady_run({s: 2.0 for s in range(150, 180)})
    result = rec.finish(GPUS, duration_s=300.0, events=[(150.0, "zone lost")])
    (recovery,) = result.recoveries
    assert recovery.label == "zone lost"
    assert recovery.baseline_p99_s == pytest.approx(1.05, abs=0.01)
    assert recovery.peak_p99_s == pytest.approx(2.1, abs=0.02)
    assert recovery.recovery_s == pytest.approx(30.0, abs=1.0)


def test_recovery_is_none_when_the_tail_never_comes_back() -> None:
    rec = steady_run({s: 2.0 for s in range(150, 300)})
    result = rec.finish(GPUS, duration_s=300.0, events=[(150.0, "region lost")])
    assert result.recoveries[0].recovery_s is None
    assert result.recoveries[0].peak_p99_s == pytest.approx(2.1, abs=0.02)


def test_an_event_that_changes_nothing_recovers_at_once() -> None:
    result = steady_run({}).finish(GPUS, duration_s=300.0, events=[(100.5, "nothing")])
    assert result.recoveries[0].recovery_s == pytest.approx(0.5)


def test_timeline_counts_arrivals_finishes_failures_and_shares() -> None:
    rec = Recorder(slo=Slo(), bucket_s=2.0)
    serve(rec, request(0, 0.5), 0.1, 1.0)  # arrives in bucket 0, finishes at 1.5: bucket 0
    serve(rec, request(1, 1.0), 0.1, 2.5, region="us-east")  # finishes at 3.5: bucket 1
    serve(rec, request(2, 3.0), 0.1, 10.0)  # finishes after the run: in no bucket
    fail(rec, request(3, 5.0))
    tl = rec.finish(GPUS, duration_s=6.0).timeline
    assert (tl.start_s, tl.bucket_s) == (0.0, 2.0)
    assert (tl.arrived, tl.finished, tl.failed) == ([2, 1, 1], [1, 1, 0], [0, 0, 1])
    assert tl.region_share == {"eu-west": [0.5, 1.0, None], "us-east": [0.5, 0.0, None]}
    assert tl.p99_e2e_s[0] == pytest.approx(pct([1.0, 2.5], 99), abs=1e-4)


def alternating(s: int, k: int) -> str:
    """During the crowd (seconds 100-159) eu-west serves 80% of one second's traffic,
    20% of the next's; otherwise half."""
    share = (0.8 if s % 2 else 0.2) if 100 <= s < 160 else 0.5
    return "eu-west" if k < share * 20 else "us-east"


def test_herding_measures_the_crowded_regions_share_swinging() -> None:
    rec = steady_run({}, seconds=200, region_of=alternating)
    result = rec.finish(GPUS, duration_s=200.0, crowd=Crowd("eu-west", 100.0, 160.0))
    series = [sum(alternating(s, k) == "eu-west" for k in range(20)) / 20 for s in range(100, 160)]
    herding = result.herding
    assert herding is not None
    assert herding.share_std == pytest.approx(statistics.pstdev(series), abs=1e-4)
    assert herding.max_swing == pytest.approx(
        max(abs(b - a) for a, b in itertools.pairwise(series))
    )
    assert herding.share_mean == pytest.approx(0.5)


def test_herding_finds_the_crowd_in_the_events() -> None:
    rec = steady_run({}, seconds=200, region_of=alternating)
    events = [(100.0, "flash crowd: eu-west clients x3"), (160.0, "flash crowd ends")]
    herding = rec.finish(GPUS, duration_s=200.0, events=events).herding
    assert herding is not None
    assert (herding.region, herding.start_s, herding.end_s) == ("eu-west", 100.0, 160.0)
    assert herding.max_swing == pytest.approx(0.6)
    assert rec.finish(GPUS, duration_s=200.0, events=[(100.0, "zone lost")]).herding is None


def crowded_from_boston() -> Recorder:
    """200 s of two arrivals a second; from 100 s on three in four are from Boston."""
    rec = Recorder(slo=Slo())
    for i in range(400):
        at = i * 0.5
        boston = i % 4 != 0 if at >= 100 else i % 4 == 0
        home = "us-east" if boston else "eu-west"
        serve(rec, request(i, at), 0.1, 1.0, region=home, home=home)
    return rec


def test_an_unnamed_crowd_is_the_home_region_whose_arrivals_rose_most() -> None:
    rec = crowded_from_boston()
    herding = rec.finish(GPUS, duration_s=200.0, events=[(100.0, "flash crowd 3x")]).herding
    assert herding is not None
    # No end in the label and no later event: the 60 s.
    assert (herding.region, herding.start_s, herding.end_s) == ("us-east", 100.0, 160.0)
    assert herding.share_mean == pytest.approx(0.75)


def test_a_crowd_lasts_as_long_as_its_label_says_but_not_past_the_next_event() -> None:
    rec = crowded_from_boston()
    events = [(100.0, "flash crowd 3x for 30 s")]
    herding = rec.finish(GPUS, duration_s=200.0, events=events).herding
    assert herding is not None and herding.end_s == 130.0
    events = [(100.0, "flash crowd 3x for 90 s"), (120.0, "zone lost")]
    herding = rec.finish(GPUS, duration_s=200.0, events=events).herding
    assert herding is not None and herding.end_s == 120.0


def test_ratio_to_divides_each_headline_figure_by_the_references() -> None:
    mine = random_run(5)[0].finish(GPUS, duration_s=100.0)
    oracle = random_run(6, n=1500)[0].finish(GPUS, duration_s=100.0)
    ratios = mine.ratio_to(oracle)
    assert mine.e2e_p90_s is not None and oracle.e2e_p90_s is not None
    assert ratios["e2e_p90_s"] == pytest.approx(mine.e2e_p90_s / oracle.e2e_p90_s)
    assert mine.goodput is not None and oracle.goodput is not None
    assert ratios["goodput"] == pytest.approx(mine.goodput / oracle.goodput)
    assert ratios["util_mean"] == pytest.approx(1.0)
    # Nobody left home: 0 / 0 is unknown, not 1 or 0.
    assert math.isnan(ratios["cross_region_share"]) and math.isnan(ratios["added_rtt_ms"])


def test_policy_result_survives_a_strict_json_round_trip() -> None:
    rec = steady_run({s: 2.0 for s in range(150, 180)}, region_of=alternating)
    fail(rec, request(10**6, 155.0, tenant="flood"))
    events = [(150.0, "zone lost"), (100.0, "flash crowd eu-west"), (160.0, "crowd ends")]
    result = rec.finish([FakeGpu("g", 10.0, 20.0, 100, 5)], duration_s=300.0, events=events)
    assert result.herding is not None and len(result.recoveries) == 3
    text = json.dumps(result.to_json(), allow_nan=False)
    assert PolicyResult.from_json(json.loads(text)) == result


def test_from_json_names_the_keys_it_does_not_know_or_misses() -> None:
    data = random_run(7, n=50)[0].finish(GPUS, duration_s=100.0).to_json()
    data["p999"] = 1.0
    del data["goodput"]
    with pytest.raises(ValueError, match=r"unknown keys \['p999'\], missing keys \['goodput'\]"):
        PolicyResult.from_json(data)


def test_an_empty_run_reads_unknown_not_zero() -> None:
    result = Recorder(slo=Slo()).finish([], duration_s=10.0)
    assert (result.offered, result.e2e_p99_s, result.goodput, result.util_mean) == (
        0,
        None,
        None,
        None,
    )
    assert result.prefix_hit_rate is None and result.cross_region_share is None


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Slo(ttft_s=0.0), "Slo.ttft_s must be a positive number of seconds, got 0.0"),
        (lambda: Slo(e2e_s=math.inf), "Slo.e2e_s must be a positive number of seconds, got inf"),
        (lambda: Recorder(slo=Slo(), bucket_s=0), "Recorder bucket_s must be > 0 seconds, got 0"),
        (
            lambda: Recorder(slo=Slo(), warmup_s=-1),
            "Recorder warmup_s must be >= 0 seconds, got -1",
        ),
        (
            lambda: Recorder(slo=Slo(), window_buckets=0),
            "Recorder window_buckets must be >= 1, got 0",
        ),
        (
            lambda: Crowd("eu-west", 5.0, 5.0),
            r"Crowd.end_s \(5.0\) must be after Crowd.start_s \(5.0\)",
        ),
        (
            lambda: Recorder(slo=Slo(), warmup_s=30).finish([], duration_s=30.0),
            r"finish duration_s must be after warmup_s \(30 s\), got 30.0",
        ),
    ],
)
def test_bad_settings_fail_naming_what_to_fix(build: object, message: str) -> None:
    assert callable(build)
    with pytest.raises(ValueError, match=message):
        build()
