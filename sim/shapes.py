"""Request shapes from published traces: token-count distributions fitted to
(mean, median, P99), and the inter-arrival variability that goes with them.

The Azure LLM inference traces 2023 publish, per workload, the mean, median and
P99 of the prompt ("context") and output ("generated") token counts, and the
arrivals' burstiness. A lognormal cannot hold all three figures: the
conversation output (median 129, P99 601, mean 211) has far more mass between
median and P99 than any lognormal with that median and P99. So each count is
drawn from a three-piece quantile function that holds median and P99 exactly
by construction and has one free parameter fitted to the mean:

- below the median (u < 0.5): log-uniform from ``floor`` (median / 16, at least
  one token) up to the median;
- median to P99 (0.5 <= u < 0.99): in log space a truncated exponential,
  ``x = median · (P99/median)^g(v)`` with ``v = (u - 0.5) / 0.49`` and
  ``g(v) = expm1(-c·v) / expm1(-c)``; ``c < 0`` piles mass near the median (a
  truncated Pareto), ``c > 0`` near the P99, ``c = 0`` is log-uniform. ``c`` is
  found by bisection so that the mean of the rounded counts is the published mean;
- the top 1%: log-uniform from the P99 up to ``ceiling`` (twice the P99, the
  traces' maxima not being published), lowered so that prompt + output never
  exceeds ``KV_CAP_TOKENS``.

``KV_CAP_TOKENS`` = 16 384 is the KV cache of the smallest GPU class (V100,
``common.config.gpu.HARDWARE_KV_TOKENS``): a request whose prompt + output
reservation exceeded it could not run on every GPU of a fleet.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

from common.config.gpu import HARDWARE_KV_TOKENS

KV_CAP_TOKENS = min(HARDWARE_KV_TOKENS.values())
# Quadrature points for the mean of the fitted distribution (midpoint rule over u).
_QUADRATURE_POINTS = 1024
_FIT_ITERATIONS = 32
_C_BOUND = 60.0
TABLE_BITS = 15


@dataclass(frozen=True)
class TokenStats:
    """Published figures of a token count: mean, median, 99th percentile."""

    mean: float
    median: float
    p99: float


@dataclass(frozen=True)
class TokenDistribution:
    """A token count's distribution (see the module docstring); sample with ``sample``."""

    published: TokenStats
    floor: float
    ceiling: float
    c: float
    mean: float = field(init=False)
    # The quantile function's constants, precomputed: sampling is on the hot path.
    _ln_floor: float = field(init=False, repr=False)
    _ln_low: float = field(init=False, repr=False)
    _ln_med: float = field(init=False, repr=False)
    _ln_mid: float = field(init=False, repr=False)
    _ln_p99: float = field(init=False, repr=False)
    _ln_tail: float = field(init=False, repr=False)
    _den: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        med, p99 = self.published.median, self.published.p99
        constants = {
            "_ln_floor": math.log(self.floor),
            "_ln_low": math.log(med / self.floor),
            "_ln_med": math.log(med),
            "_ln_mid": math.log(p99 / med),
            "_ln_p99": math.log(p99),
            "_ln_tail": math.log(self.ceiling / p99),
            "_den": math.expm1(-self.c) if abs(self.c) > 1e-9 else 0.0,
        }
        for name, value in constants.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "mean", quadrature_mean(self))

    def quantile(self, u: float) -> int:
        """The token count at probability ``u`` in [0, 1): at least one token."""
        if u < 0.5:
            x = math.exp(self._ln_floor + self._ln_low * (u * 2.0))
        elif u < 0.99:
            v = (u - 0.5) / 0.49
            g = math.expm1(-self.c * v) / self._den if self._den else v
            x = math.exp(self._ln_med + self._ln_mid * g)
        else:
            x = math.exp(self._ln_p99 + self._ln_tail * ((u - 0.99) / 0.01))
        n = int(x + 0.5)
        return n if n >= 1 else 1

    @cached_property
    def table(self) -> tuple[int, ...]:
        """The quantile function at the midpoints of ``2**TABLE_BITS`` equal slices of
        [0, 1): ``table[int(u * len(table))]`` samples it (within 1/32768 in probability)
        at the cost of an index, which is what a million-request workload needs."""
        size = 1 << TABLE_BITS
        return tuple(self.quantile((i + 0.5) / size) for i in range(size))

    def sample(self, rng: random.Random) -> int:
        table = self.table
        return table[int(rng.random() * len(table))]


def quadrature_mean(dist: TokenDistribution, points: int = _QUADRATURE_POINTS) -> float:
    """Mean of the rounded counts: the midpoint rule over the quantile function."""
    return sum(dist.quantile((i + 0.5) / points) for i in range(points)) / points


def fit_tokens(stats: TokenStats, *, ceiling: float, what: str = "tokens") -> TokenDistribution:
    """Fit ``c`` so that the distribution's mean is ``stats.mean``; median and P99 hold
    by construction. ``ValueError`` naming ``what`` when the figures cannot be met."""
    if not 1 <= stats.median < stats.p99:
        raise ValueError(
            f"{what}: need 1 <= median < P99, got median {stats.median} and P99 {stats.p99}"
        )
    if ceiling <= stats.p99:
        raise ValueError(f"{what}: the P99 {stats.p99} must stay below the cap {ceiling:g}")
    floor = max(1.0, stats.median / 16)
    lo, hi = -_C_BOUND, _C_BOUND
    low_mean = TokenDistribution(stats, floor, ceiling, lo).mean
    high_mean = TokenDistribution(stats, floor, ceiling, hi).mean
    if not low_mean <= stats.mean <= high_mean:
        raise ValueError(
            f"{what}: a mean of {stats.mean} cannot go with median {stats.median} and "
            f"P99 {stats.p99}; reachable means are {low_mean:.1f} to {high_mean:.1f}"
        )
    for _ in range(_FIT_ITERATIONS):
        mid = (lo + hi) / 2
        if TokenDistribution(stats, floor, ceiling, mid).mean < stats.mean:
            lo = mid
        else:
            hi = mid
    return TokenDistribution(stats, floor, ceiling, (lo + hi) / 2)


@dataclass(frozen=True)
class RequestShape:
    """A workload's request shape: prompt and output token counts, arrival burstiness.

    ``interarrival_cv`` is the coefficient of variation of the gaps between
    arrivals (1 = Poisson). Prompt + output never exceeds ``KV_CAP_TOKENS``.
    """

    name: str
    prompt: TokenDistribution
    output: TokenDistribution
    interarrival_cv: float


def request_shape(
    name: str, *, prompt: TokenStats, output: TokenStats, interarrival_cv: float
) -> RequestShape:
    """Fit a shape to published figures; the top 1% reaches up to twice the P99,
    lowered so that the largest prompt plus the largest output fits ``KV_CAP_TOKENS``."""
    if not interarrival_cv > 0:
        raise ValueError(f"{name}: interarrival_cv must be > 0, got {interarrival_cv}")
    out = fit_tokens(output, ceiling=2 * output.p99, what=f"{name} output")
    prompt_ceiling = min(2 * prompt.p99, KV_CAP_TOKENS - out.ceiling)
    inp = fit_tokens(prompt, ceiling=prompt_ceiling, what=f"{name} prompt")
    return RequestShape(name, inp, out, interarrival_cv)


# Azure LLM inference traces 2023 (Patel et al., "Splitwise", ISCA 2024; the
# AzurePublicDataset's AzureLLMInferenceDataset2023): coding assistant and chat.
CODE = request_shape(
    "code",
    prompt=TokenStats(mean=2048, median=1469, p99=7436),
    output=TokenStats(mean=28, median=13, p99=252),
    interarrival_cv=13.0,
)
CONVERSATION = request_shape(
    "conversation",
    prompt=TokenStats(mean=1155, median=1020, p99=4142),
    output=TokenStats(mean=211, median=129, p99=601),
    interarrival_cv=1.1,
)
SHAPES: Mapping[str, RequestShape] = MappingProxyType({s.name: s for s in (CODE, CONVERSATION)})
