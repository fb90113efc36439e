"""The recorder: what happened to every simulated request, and the figures it adds up to.

The simulator calls ``Recorder.served`` or ``Recorder.failed`` once per request
(a million times a run), so both only append to columns: ``array('d')`` for
times, and one ``array('i')`` of small ints, each naming an interned combination
of strings (served region, home region, tenant, city; or failure code, home
region, tenant) — a few thousand combinations at most, one tuple lookup per
call instead of one per string. Everything else is computed once, in
``finish``, into a ``PolicyResult`` (``sim.results``).

Choices the figures rest on:
- Requests arriving before ``warmup_s`` are not counted anywhere. The GPUs'
  integrals (busy time, slots, prompt and cached tokens) are cumulative, so
  utilisation and the prefix hit rate cover the whole run: ``busy_s / duration_s``;
  ``loaded_shares`` (``sim.busy_window``) gives utilisation while the load lasts.
- Latency percentiles (the run's and each tenant's) are exact over every
  *offered* request, a failed one counting as infinitely late: with more than 1 %
  failed the P99 is inf, which reports print as "failed". Goodput is a share of
  the offered requests too. The timeline's windowed P99 (and so the recovery
  time) is over the served requests of each window; its failures are counted
  beside it.
- The RTT added by leaving home is ``rtt_ms`` minus the RTT from the client's city
  to its home region: ``rtt_home_ms(city, home_region)`` when given, else the
  least RTT seen from that city (its requests served at home set it).
- The timeline's P99 is over a trailing window of ``window_buckets`` buckets; a
  recovery ends at the first bucket from which a whole window of arrivals has its
  P99 within 1.2× of the median windowed P99 of the 60 s before the event.
- A flash crowd is the one given as ``crowd``, else the first event whose label
  says "crowd": it lasts as long as the label says ("for 60 s", else 60 s) but
  not past the next event, and its region is the one the label names, else the
  home region whose share of the arrivals rose most.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict

from sim.flash import Crowd, crowd_from_events, herding_of
from sim.requests import SimRequest
from sim.results import PolicyResult, TenantStats
from sim.stats import downsample, percentile, pstdev
from sim.timeline import Columns, build_timeline, recovery_after

__all__ = ["Crowd", "GpuTotals", "PolicyResult", "Recorder", "Slo"]

CDF_POINTS = 200


@dataclass(frozen=True)
class Slo:
    """The latency targets goodput counts against (client-perceived, RTT included).

    The defaults, 2 s to the first token and 20 s end to end, suit interactive chat
    of a few hundred output tokens; a scenario may set its own.
    """

    ttft_s: float = 2.0
    e2e_s: float = 20.0

    def __post_init__(self) -> None:
        for name in ("ttft_s", "e2e_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"Slo.{name} must be a positive number of seconds, got {value!r}")


class _Latency(TypedDict):
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None
    e2e_p99_s: float | None
    goodput_ttft: float | None
    goodput_e2e: float | None


class _Utilisation(TypedDict):
    util_mean: float | None
    util_p10: float | None
    util_p90: float | None
    util_std: float | None
    slot_occupancy_mean: float | None
    utilisation_cdf: list[float]
    prefix_hit_rate: float | None


class _Geography(TypedDict):
    served_by_region: dict[str, int]
    cross_region_share: float | None
    added_rtt_ms: float | None


class _HasConcurrency(Protocol):
    @property
    def max_concurrency(self) -> int: ...


class GpuTotals(Protocol):
    """What ``finish`` reads of a GPU (``sim.gpu_model.SimGpu`` has it)."""

    @property
    def name(self) -> str: ...
    @property
    def busy_s(self) -> float: ...
    @property
    def slot_s(self) -> float: ...
    @property
    def prompt_tokens_total(self) -> int: ...
    @property
    def cached_tokens_total(self) -> int: ...
    @property
    def cfg(self) -> _HasConcurrency: ...


class Recorder:
    """Receives every request's outcome; ``finish`` turns them into a ``PolicyResult``.

    ``bucket_s`` is the timeline's resolution and ``window_buckets`` how many buckets
    its P99 (and so the recovery time) is taken over: at 1 s and 10, a window holds
    enough requests of a fleet for a P99, and recovery reads to the second.
    """

    def __init__(
        self, *, slo: Slo, warmup_s: float = 0.0, bucket_s: float = 1.0, window_buckets: int = 10
    ) -> None:
        if not (math.isfinite(warmup_s) and warmup_s >= 0):
            raise ValueError(f"Recorder warmup_s must be >= 0 seconds, got {warmup_s!r}")
        if not (math.isfinite(bucket_s) and bucket_s > 0):
            raise ValueError(f"Recorder bucket_s must be > 0 seconds, got {bucket_s!r}")
        if window_buckets < 1:
            raise ValueError(f"Recorder window_buckets must be >= 1, got {window_buckets!r}")
        self.slo = slo
        self.warmup_s = warmup_s
        self.bucket_s = bucket_s
        self.window_buckets = window_buckets
        # Served: (region, home region, tenant, city) -> id; failed: (code, home, tenant).
        self._routes: dict[tuple[str, str, str, str], int] = {}
        self._faults: dict[tuple[str, str, str], int] = {}
        self._at = array("d")
        self._ttft = array("d")
        self._e2e = array("d")
        self._rtt = array("d")
        self._route = array("i")
        self._f_at = array("d")
        self._f_key = array("i")
        self._retried = 0

    def served(
        self,
        req: SimRequest,
        *,
        region: str,
        zone: str,
        gpu: str,
        home_region: str,
        rtt_ms: float,
        ttft_s: float,
        e2e_s: float,
        cached_tokens: int,
        attempts: int,
    ) -> None:
        """One request answered in full. ``zone``, ``gpu`` and ``cached_tokens`` are
        accepted for the simulator's convenience but not kept: per-GPU figures come
        from the GPUs' own integrals."""
        at = req.at_s
        if at < self.warmup_s:
            return
        routes = self._routes
        key = (region, home_region, req.tenant, req.city)
        route = routes.get(key)
        if route is None:
            route = routes[key] = len(routes)
        self._at.append(at)
        self._ttft.append(ttft_s)
        self._e2e.append(e2e_s)
        self._rtt.append(rtt_ms)
        self._route.append(route)
        if attempts > 1:
            self._retried += 1

    def failed(
        self, req: SimRequest, *, code: str, home_region: str, elapsed_s: float, attempts: int
    ) -> None:
        """One request that ended with gRPC status ``code`` (e.g. "UNAVAILABLE").
        ``elapsed_s`` and ``attempts`` are accepted but not kept: a failure counts by
        its arrival, like every other request."""
        at = req.at_s
        if at < self.warmup_s:
            return
        key = (code, home_region, req.tenant)
        fault = self._faults.get(key)
        if fault is None:
            fault = self._faults[key] = len(self._faults)
        self._f_at.append(at)
        self._f_key.append(fault)

    def finish(
        self,
        gpus: Sequence[GpuTotals],
        *,
        duration_s: float,
        events: Sequence[tuple[float, str]] = (),
        rtt_home_ms: Callable[[str, str], float] | None = None,
        crowd: Crowd | None = None,
        loaded_shares: Sequence[float] | None = None,
    ) -> PolicyResult:
        """Every figure of the run (see the module docstring for what each rests on)."""
        if not (math.isfinite(duration_s) and duration_s > self.warmup_s):
            raise ValueError(
                f"finish duration_s must be after warmup_s ({self.warmup_s} s), got {duration_s!r}"
            )
        offered = len(self._at) + len(self._f_at)
        fault_counts = Counter(self._f_key)
        fault_keys = list(self._faults)
        failed_by: Counter[str] = Counter()
        for fault, count in fault_counts.items():
            failed_by[fault_keys[fault][0]] += count
        tenants, good = self._tenants(fault_counts)
        timeline = build_timeline(
            Columns(self._at, self._e2e, self._route, [k[0] for k in self._routes]),
            self._f_at,
            start_s=math.floor(self.warmup_s / self.bucket_s) * self.bucket_s,
            duration_s=duration_s,
            bucket_s=self.bucket_s,
            window=self.window_buckets,
        )
        if crowd is None:
            homes = Columns(self._at, self._e2e, self._route, [k[1] for k in self._routes])
            crowd = crowd_from_events(events, end_s=duration_s, homes=homes)
        return PolicyResult(
            offered=offered,
            served=len(self._at),
            failed=dict(sorted(failed_by.items())),
            retried=self._retried,
            slo_ttft_s=self.slo.ttft_s,
            slo_e2e_s=self.slo.e2e_s,
            warmup_s=self.warmup_s,
            duration_s=duration_s,
            **self._latency(offered),
            goodput=_share(good, offered),
            gpus=len(gpus),
            **_utilisation(gpus, duration_s),
            **self._geography(rtt_home_ms),
            tenants=tenants,
            timeline=timeline,
            recoveries=[recovery_after(timeline, at, label) for at, label in events],
            herding=herding_of(timeline, crowd) if crowd else None,
            util_loaded_mean=_mean(loaded_shares) if loaded_shares else None,
            util_loaded_p10=percentile(sorted(loaded_shares), 0.1) if loaded_shares else None,
        )

    def _latency(self, offered: int) -> _Latency:
        ttft, e2e = sorted(self._ttft), sorted(self._e2e)
        good_ttft = bisect.bisect_right(ttft, self.slo.ttft_s)
        good_e2e = bisect.bisect_right(e2e, self.slo.e2e_s)
        failed = [math.inf] * len(self._f_at)
        ttft += failed
        e2e += failed
        return {
            "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p90_s": percentile(ttft, 0.9),
            "ttft_p99_s": percentile(ttft, 0.99),
            "e2e_p50_s": percentile(e2e, 0.5),
            "e2e_p90_s": percentile(e2e, 0.9),
            "e2e_p99_s": percentile(e2e, 0.99),
            "goodput_ttft": _share(good_ttft, offered),
            "goodput_e2e": _share(good_e2e, offered),
        }

    def _tenants(self, fault_counts: Counter[int]) -> tuple[dict[str, TenantStats], int]:
        """Per tenant: counts, e2e P99 and goodput (within both SLOs, of its offered);
        and how many requests in all were within both SLOs."""
        names = sorted({k[2] for k in self._routes} | {k[2] for k in self._faults})
        index = {name: i for i, name in enumerate(names)}
        of_route = [index[k[2]] for k in self._routes]
        e2e: list[list[float]] = [[] for _ in names]
        good = [0] * len(names)
        ttft_slo, e2e_slo = self.slo.ttft_s, self.slo.e2e_s
        for route, t, e in zip(self._route, self._ttft, self._e2e, strict=True):
            tenant = of_route[route]
            e2e[tenant].append(e)
            if t <= ttft_slo and e <= e2e_slo:
                good[tenant] += 1
        failed = [0] * len(names)
        fault_keys = list(self._faults)
        for fault, count in fault_counts.items():
            failed[index[fault_keys[fault][2]]] += count
        out = {}
        for i, name in enumerate(names):
            values = sorted(e2e[i])
            served = len(values)
            values += [math.inf] * failed[i]
            offered = len(values)
            out[name] = TenantStats(
                served=served,
                failed=failed[i],
                e2e_p99_s=percentile(values, 0.99),
                goodput=_share(good[i], offered),
            )
        return out, sum(good)

    def _geography(self, rtt_home_ms: Callable[[str, str], float] | None) -> _Geography:
        """Where requests were served: per region, the share served away from home, and
        the mean RTT those added over their home region's."""
        routes = list(self._routes)
        count = [0] * len(routes)
        rtt_sum = [0.0] * len(routes)
        rtt_min = [math.inf] * len(routes)
        for route, rtt in zip(self._route, self._rtt, strict=True):
            count[route] += 1
            rtt_sum[route] += rtt
            if rtt < rtt_min[route]:
                rtt_min[route] = rtt
        city_min: dict[str, float] = {}
        for (_, _, _, city), low in zip(routes, rtt_min, strict=True):
            city_min[city] = min(city_min.get(city, math.inf), low)
        by_region: Counter[str] = Counter()
        away, added = 0, 0.0
        for i, (region, home, _, city) in enumerate(routes):
            by_region[region] += count[i]
            if region != home and count[i]:
                home_rtt = rtt_home_ms(city, home) if rtt_home_ms else city_min[city]
                away += count[i]
                added += rtt_sum[i] - count[i] * home_rtt
        return {
            "served_by_region": dict(sorted(by_region.items())),
            "cross_region_share": _share(away, len(self._at)),
            "added_rtt_ms": added / away if away else None,
        }


def _share(part: float, whole: int) -> float | None:
    return part / whole if whole else None


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def _utilisation(gpus: Sequence[GpuTotals], duration_s: float) -> _Utilisation:
    """Per GPU, busy time over the run's duration: mean, P10, P90, spread, its CDF;
    slot occupancy; the prefix-cache hit rate over every GPU's prompt tokens."""
    util = sorted(g.busy_s / duration_s for g in gpus)
    slots = [g.slot_s / (g.cfg.max_concurrency * duration_s) for g in gpus]
    prompt = sum(g.prompt_tokens_total for g in gpus)
    return {
        "util_mean": _mean(util),
        "util_p10": percentile(util, 0.1),
        "util_p90": percentile(util, 0.9),
        "util_std": pstdev(util),
        "slot_occupancy_mean": math.fsum(slots) / len(slots) if slots else None,
        "utilisation_cdf": downsample(util, CDF_POINTS),
        "prefix_hit_rate": _share(sum(g.cached_tokens_total for g in gpus), prompt),
    }
