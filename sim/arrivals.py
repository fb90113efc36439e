"""When requests arrive and from where: a renewal process over the whole workload,
each arrival given a city and a tenant.

Gaps between arrivals come from a renewal process with the shape's coefficient
of variation (``gap_sampler``): gamma for CV <= 1, a balanced two-phase
hyperexponential above. At CV 13 (the Azure code trace) that hyperexponential
draws 99.7% of its gaps with mean 0.5/rate and 0.3% with mean 169/rate: bursts
of a few hundred requests at twice the mean rate, then long silences.

The total rate is ``rate_rps``; the diurnal curve only moves shares between
cities (``diurnal_factor`` of each city's local hour × its weight). A ``Boost``
multiplies the rate of some cities and/or one tenant over a window, and so
raises the total. Shares are piecewise constant: they are recomputed at every
1/288 of a day (five minutes of local time) and at every boost's edge. The
renewal process runs in "operational time" (unit mean gaps) which the current
total rate turns into seconds, so a boosted window is the same process sped up.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from sim.geography import City

# The diurnal curve: trough at 04:00 local time, peak at 19:00, trough/peak = 0.25
# (residential internet traffic swings about 3-5x over a day).
TROUGH_HOUR = 4.0
PEAK_HOUR = 19.0
TROUGH_FACTOR = 0.25
DIURNAL_STEPS_PER_DAY = 288


def diurnal_factor(local_hour: float) -> float:
    """Relative traffic at a local hour, in [TROUGH_FACTOR, 1]: a raised cosine rising
    from the trough to the peak over 15 h and falling back over 9 h (zero slope at both)."""
    rise = PEAK_HOUR - TROUGH_HOUR
    h = (local_hour - TROUGH_HOUR) % 24.0
    x = h / rise if h < rise else 1.0 - (h - rise) / (24.0 - rise)
    return TROUGH_FACTOR + (1.0 - TROUGH_FACTOR) * (1.0 - math.cos(math.pi * x)) / 2.0


@dataclass(frozen=True)
class Boost:
    """Multiply the arrival rate of ``cities`` (None: every city) and/or ``tenant``
    (None: every tenant) by ``factor`` over ``[start_s, end_s)``."""

    start_s: float
    end_s: float
    factor: float
    cities: frozenset[str] | None = None
    tenant: str | None = None


def balanced_h2(cv: float) -> tuple[float, float, float]:
    """A two-phase hyperexponential of mean 1 and coefficient of variation ``cv`` > 1,
    with balanced means (p/λ1 = (1-p)/λ2 = 1/2, so CV² = 1/(2p(1-p)) - 1):
    (p of the fast phase, mean of the fast phase, mean of the slow phase)."""
    c2 = cv * cv
    p = 0.5 * (1.0 + math.sqrt((c2 - 1.0) / (c2 + 1.0)))
    return p, 1.0 / (2.0 * p), 1.0 / (2.0 * (1.0 - p))


def gap_sampler(cv: float, rng: random.Random) -> Callable[[], float]:
    """Unit-mean gaps of a renewal process with coefficient of variation ``cv``:
    gamma (shape 1/cv²) up to 1, exponential at 1, balanced H2 above."""
    if not cv > 0:
        raise ValueError(f"interarrival_cv must be > 0, got {cv}")
    uniform, log = rng.random, math.log
    if cv > 1.0:
        p_fast, mean_fast, mean_slow = balanced_h2(cv)

        def hyperexponential() -> float:  # exponential phases inlined: the hot path
            mean = mean_fast if uniform() < p_fast else mean_slow
            return -log(1.0 - uniform()) * mean

        return hyperexponential
    if cv == 1.0:
        return lambda: -log(1.0 - uniform())
    shape = 1.0 / (cv * cv)
    return lambda: rng.gammavariate(shape, 1.0 / shape)


class Mixer:
    """Who sends the next request: shares of (city, tenant) pairs at a time, and the
    factor by which boosts raise the total rate (see the module docstring).

    ``set_time(t)`` makes the segment holding ``t`` current; it stays valid until
    ``until`` (inf: for ever). ``pick(u)`` maps a uniform draw to (city, tenant).
    """

    def __init__(
        self,
        cities: Sequence[City],
        tenants: Sequence[tuple[str, float]],
        *,
        boosts: Sequence[Boost] = (),
        diurnal: bool = True,
        start_utc_hour: float = 0.0,
        day_length_s: float = 86_400.0,
    ) -> None:
        self.cities = tuple(cities)
        self.tenant_ids = [tid for tid, _ in tenants]
        total = sum(w for _, w in tenants)
        self.tenant_shares = [w / total for _, w in tenants]
        self.boosts = tuple(boosts)
        self.diurnal = diurnal
        self.start_utc_hour = start_utc_hour
        self.step_s = day_length_s / DIURNAL_STEPS_PER_DAY
        self.hours_per_s = 24.0 / day_length_s
        self.edges = sorted({e for b in self.boosts for e in (b.start_s, b.end_s)})
        self.multiplier = 1.0
        self.until = -math.inf
        self.cum: list[float] = []  # cumulative weights of the (city, tenant) pairs
        self._tenants = len(tenants)
        self._static_city_shares = self._normalised([c.weight for c in self.cities])

    @staticmethod
    def _normalised(weights: list[float]) -> list[float]:
        total = sum(weights)
        return [w / total for w in weights]

    def city_shares(self, t: float) -> list[float]:
        """Each city's share of the unboosted traffic at time ``t`` (sums to 1)."""
        if not self.diurnal:
            return self._static_city_shares
        step = math.floor(t / self.step_s)
        utc = self.start_utc_hour + (step + 0.5) * self.step_s * self.hours_per_s
        return self._normalised(
            [c.weight * diurnal_factor(utc + c.utc_offset_h) for c in self.cities]
        )

    def set_time(self, t: float) -> None:
        shares = self.city_shares(t)
        active = [b for b in self.boosts if b.start_s <= t < b.end_s]
        joint: list[float] = []
        for city, share in zip(self.cities, shares, strict=True):
            for tid, tshare in zip(self.tenant_ids, self.tenant_shares, strict=True):
                w = share * tshare
                for b in active:
                    if (b.cities is None or city.name in b.cities) and b.tenant in (None, tid):
                        w *= b.factor
                joint.append(w)
        self.cum = list(accumulate(joint))
        self.multiplier = self.cum[-1]
        self.until = self._next_edge(t)

    def _next_edge(self, t: float) -> float:
        until = math.inf
        if self.diurnal:
            until = (math.floor(t / self.step_s) + 1) * self.step_s
            if until <= t:  # float rounding at a step's edge
                until += self.step_s
        i = bisect.bisect_right(self.edges, t)
        if i < len(self.edges):
            until = min(until, self.edges[i])
        return until

    def pick(self, u: float) -> tuple[int, int]:
        """(city index, tenant index) for a uniform draw ``u`` in [0, 1)."""
        cum = self.cum
        i = bisect.bisect_right(cum, u * cum[-1])
        if i >= len(cum):
            i = len(cum) - 1
        return divmod(i, self._tenants)


class Arrivals:
    """Arrival times at ``rate_rps`` (times the boost multiplier) with gaps of CV ``cv``,
    each with the (city, tenant) pair it comes from as ``city * tenants + tenant``."""

    def __init__(self, mixer: Mixer, *, rate_rps: float, cv: float, rng: random.Random) -> None:
        self.mixer = mixer
        self.rate_rps = rate_rps
        self.rng = rng
        self._draw = gap_sampler(cv, rng)
        self.t = 0.0
        mixer.set_time(0.0)

    def chunk(self, count: int) -> list[tuple[float, int]]:
        """The next ``count`` arrivals as (time, pair index), times non-decreasing.

        One tight loop per chunk rather than a call per arrival: this is the
        workload's hot path."""
        mixer, draw, uniform = self.mixer, self._draw, self.rng.random
        t, rate, until = self.t, self.rate_rps * mixer.multiplier, mixer.until
        cum, last = mixer.cum, len(mixer.cum) - 1
        top = cum[-1]
        out = []
        for _ in range(count):
            op = draw()
            dt = op / rate
            while t + dt >= until:  # the segment ends first: spend its share, move on
                op = max(0.0, op - (until - t) * rate)
                t = until
                mixer.set_time(t)
                rate, until, cum = self.rate_rps * mixer.multiplier, mixer.until, mixer.cum
                top = cum[-1]
                dt = op / rate
            t += dt
            i = bisect.bisect_right(cum, uniform() * top)
            out.append((t, i if i < last else last))
        self.t = t
        return out
