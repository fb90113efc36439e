"""The synthetic workload: shapes as published, bursty arrivals, diurnal shares,
boosts, shared prefixes and sessions, determinism, and every bad spec's message."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import statistics
from collections import Counter, defaultdict
from typing import Any

import pytest

from common.basics.vocabulary import Priority
from common.request.prefix import BLOCK_TOKENS
from sim.arrivals import balanced_h2, diurnal_factor
from sim.geography import CITIES, City, GeoPoint
from sim.requests import SimRequest
from sim.sessions import MIN_MESSAGE_TOKENS
from sim.shapes import TokenStats, fit_tokens, request_shape
from sim.workload import (
    CODE,
    CONVERSATION,
    KV_CAP_TOKENS,
    Boost,
    TenantMix,
    WorkloadSpec,
    generate,
    mean_request_shape,
)

# The Azure LLM inference traces 2023 as published (mean, median, P99).
PUBLISHED = {
    ("code", "prompt"): (2048, 1469, 7436),
    ("code", "output"): (28, 13, 252),
    ("conversation", "prompt"): (1155, 1020, 4142),
    ("conversation", "output"): (211, 129, 601),
}


def figures(values: list[int]) -> tuple[float, float, float]:
    ordered = sorted(values)
    n = len(ordered)
    return statistics.fmean(ordered), ordered[n // 2], ordered[math.ceil(0.99 * n) - 1]


def assert_within(measured: tuple[float, ...], published: tuple[float, ...], rel: float) -> None:
    for got, want in zip(measured, published, strict=True):
        assert abs(got - want) <= rel * want, (measured, published)


def spec(**overrides: Any) -> WorkloadSpec:
    base: dict[str, Any] = {"rate_rps": 200.0, "duration_s": None, "max_requests": 20_000}
    return WorkloadSpec(**{**base, **overrides})


# ------------------------------------------------------------------ shapes


@pytest.mark.parametrize("key", sorted(PUBLISHED))
def test_sampled_mean_median_and_p99_are_within_10_percent_of_the_published(
    key: tuple[str, str],
) -> None:
    shape = {"code": CODE, "conversation": CONVERSATION}[key[0]]
    dist = getattr(shape, key[1])
    rng = random.Random(7)
    assert_within(figures([dist.sample(rng) for _ in range(200_000)]), PUBLISHED[key], 0.10)


@pytest.mark.parametrize("shape", [CONVERSATION, CODE], ids=lambda s: s.name)
def test_the_generated_stream_keeps_the_published_shape_with_sessions_and_prefixes_on(
    shape: Any,
) -> None:
    requests = list(generate(spec(shape=shape, max_requests=100_000, rate_rps=1000.0)))
    assert sum(r.session is not None for r in requests) > 15_000  # sessions are really on
    prompts = figures([r.prompt_tokens for r in requests])
    outputs = figures([r.output_tokens for r in requests])
    assert_within(prompts, PUBLISHED[(shape.name, "prompt")], 0.10)
    assert_within(outputs, PUBLISHED[(shape.name, "output")], 0.10)


def test_prompt_plus_output_never_exceeds_the_smallest_kv_cache() -> None:
    assert KV_CAP_TOKENS == 16_384  # a V100's KV cache (common.config.gpu)
    for shape in (CODE, CONVERSATION):
        assert shape.prompt.ceiling + shape.output.ceiling <= KV_CAP_TOKENS
        worst = max(shape.prompt.table) + max(shape.output.table)
        assert worst <= KV_CAP_TOKENS


def test_a_fit_that_cannot_meet_its_figures_says_which_and_why() -> None:
    with pytest.raises(ValueError, match=r"x prompt: a mean of 5000 cannot go with median 100"):
        fit_tokens(TokenStats(5000, 100, 200), ceiling=400, what="x prompt")
    with pytest.raises(ValueError, match=r"y: need 1 <= median < P99, got median 300 and P99 200"):
        fit_tokens(TokenStats(250, 300, 200), ceiling=400, what="y")
    with pytest.raises(ValueError, match=r"z prompt: the P99 16000 must stay below the cap"):
        request_shape(
            "z",
            prompt=TokenStats(9000, 8000, 16000),
            output=TokenStats(200, 100, 600),
            interarrival_cv=1.0,
        )


# ------------------------------------------------------------------ arrivals


@pytest.mark.parametrize("shape", [CONVERSATION, CODE], ids=lambda s: s.name)
def test_interarrival_cv_is_the_shapes_within_25_percent(shape: Any) -> None:
    times = [r.at_s for r in generate(spec(shape=shape, max_requests=200_000, diurnal=False))]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert abs(cv - shape.interarrival_cv) <= 0.25 * shape.interarrival_cv
    # The rate is the asked one.
    assert len(times) / times[-1] == pytest.approx(200.0, rel=0.1 if shape is CODE else 0.02)


@pytest.mark.parametrize("cv", [1.1, 3.0, 13.0])
def test_the_hyperexponential_has_mean_1_the_asked_cv_and_balanced_phases(cv: float) -> None:
    p, fast, slow = balanced_h2(cv)
    assert p * fast + (1 - p) * slow == pytest.approx(1.0)
    second_moment = 2 * (p * fast**2 + (1 - p) * slow**2)  # exponential: E[X²] = 2 mean²
    assert math.sqrt(second_moment - 1.0) == pytest.approx(cv)
    assert p * fast == pytest.approx((1 - p) * slow)


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_an_asked_interarrival_cv_overrides_the_shapes(cv: float) -> None:
    s = spec(interarrival_cv=cv, max_requests=50_000, diurnal=False, session_fraction=0.0)
    times = [r.at_s for r in generate(s)]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.1)


def test_code_arrivals_come_in_bursts_and_conversation_arrivals_do_not() -> None:
    def dispersion(shape: Any) -> float:
        times = [r.at_s for r in generate(spec(shape=shape, max_requests=100_000))]
        window = 100 / 200.0  # a hundred mean gaps
        counts = Counter(int(t / window) for t in times)
        per = [counts.get(i, 0) for i in range(int(times[-1] / window))]
        return statistics.pvariance(per) / statistics.fmean(per)

    # Poisson counts have variance = mean (dispersion 1).
    assert dispersion(CODE) > 20
    assert dispersion(CONVERSATION) < 2


@pytest.mark.parametrize(
    ("hour", "factor"),
    [(4.0, 0.25), (19.0, 1.0), (11.5, 0.625), (23.5, 0.625), (28.0, 0.25), (-5.0, 1.0)],
)
def test_diurnal_factor_is_a_day_curve_with_trough_at_4_and_peak_at_19(
    hour: float, factor: float
) -> None:
    assert diurnal_factor(hour) == pytest.approx(factor)


def day_curve(hour: float) -> float:
    """The documented curve, written out again: 0.25 at 04:00 rising as a raised cosine
    to 1 at 19:00, falling back over the 9 h to 04:00."""
    h = hour % 24
    if 4 <= h <= 19:
        x = (h - 4) / 15
    else:
        x = 1 - ((h - 19) % 24) / 9
    return 0.25 + 0.75 * (1 - math.cos(math.pi * x)) / 2


def test_diurnal_shares_move_with_each_citys_local_time() -> None:
    day = 1200.0  # a compressed day: 50 s per hour
    cities = (City("A", GeoPoint(0, 0), 0, 1.0), City("B", GeoPoint(0, 100), 12, 3.0))
    run = spec(
        cities=cities,
        day_length_s=day,
        start_utc_hour=18.0,
        rate_rps=100.0,
        max_requests=None,
        duration_s=day,
    )
    requests = list(generate(run))
    flat = list(generate(dataclasses.replace(run, diurnal=False)))
    for utc in (1.0, 7.0, 13.0, 19.0, 22.5):
        center = ((utc - 18.0) % 24) * 50.0
        near = [r for r in requests if abs(r.at_s - center) < 12.5]
        a, b = day_curve(utc) * 1.0, day_curve(utc + 12) * 3.0
        share = sum(r.city == "A" for r in near) / len(near)
        assert share == pytest.approx(a / (a + b), abs=0.03), utc
        near = [r for r in flat if abs(r.at_s - center) < 12.5]
        assert sum(r.city == "A" for r in near) / len(near) == pytest.approx(0.25, abs=0.03)
    # The total rate does not follow the curve: only the shares do.
    assert len(requests) / day == pytest.approx(100.0, rel=0.02)


def _counts(requests: list[SimRequest], by: str) -> dict[str, list[int]]:
    """Requests per city or tenant in [0, 100), [100, 200), [200, 300)."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for r in requests:
        counts[getattr(r, by)][int(r.at_s // 100)] += 1
    return counts


def test_a_flash_crowd_multiplies_its_cities_rate_in_its_window_only() -> None:
    crowd = frozenset({"Tokyo", "Seoul"})
    s = spec(
        interarrival_cv=1.0,
        diurnal=False,
        max_requests=None,
        duration_s=299.99,
        boosts=(Boost(100.0, 200.0, 3.0, cities=crowd),),
    )
    counts = _counts(list(generate(s)), "city")
    total = sum(c.weight for c in CITIES)
    for name in crowd:  # each crowded city: 3x in the window, 1x around it
        expected = 200.0 * 100 * next(c.weight for c in CITIES if c.name == name) / total
        before, during, after = counts[name]
        assert (before, during, after) == pytest.approx(
            (expected, 3 * expected, expected), rel=0.1
        ), name
    rest = [sum(counts[c.name][w] for c in CITIES if c.name not in crowd) for w in range(3)]
    expected_rest = 200.0 * 100 * sum(c.weight for c in CITIES if c.name not in crowd) / total
    assert rest == pytest.approx([expected_rest] * 3, rel=0.05)


def test_a_tenant_flood_multiplies_that_tenants_rate_only_and_raises_the_total() -> None:
    s = spec(
        interarrival_cv=1.0,
        max_requests=None,
        duration_s=299.99,
        boosts=(Boost(100.0, 200.0, 10.0, tenant="free-tier"),),
    )
    counts = _counts(list(generate(s)), "tenant")
    total = sum(t.weight for t in s.tenants)
    for tenant in s.tenants:
        expected = 200.0 * 100 * tenant.weight / total
        factor = 10.0 if tenant.id == "free-tier" else 1.0
        before, during, after = counts[tenant.id]
        assert before == pytest.approx(expected, rel=0.1), tenant.id
        assert during == pytest.approx(expected * factor, rel=0.1), tenant.id
        assert after == pytest.approx(expected, rel=0.1), tenant.id


def test_a_boost_naming_cities_and_a_tenant_multiplies_only_that_tenant_there() -> None:
    s = spec(
        interarrival_cv=1.0,
        diurnal=False,
        rate_rps=600.0,
        max_requests=None,
        duration_s=199.99,
        boosts=(Boost(100.0, 200.0, 5.0, cities=frozenset({"Tokyo"}), tenant="team"),),
    )
    requests = list(generate(s))
    pairs = Counter((r.city, r.tenant, int(r.at_s // 100)) for r in requests)
    assert pairs["Tokyo", "team", 1] == pytest.approx(5 * pairs["Tokyo", "team", 0], rel=0.15)
    assert pairs["Tokyo", "enterprise", 1] == pytest.approx(
        pairs["Tokyo", "enterprise", 0], rel=0.15
    )
    assert pairs["Delhi", "team", 1] == pytest.approx(pairs["Delhi", "team", 0], rel=0.15)


# ------------------------------------------------------------------ the stream


def test_ids_count_up_times_never_go_back_and_the_stream_stops_where_asked() -> None:
    by_count = list(generate(spec(max_requests=5000)))
    assert [r.id for r in by_count] == list(range(5000))
    assert all(a.at_s <= b.at_s for a, b in itertools.pairwise(by_count))
    by_time = list(generate(spec(max_requests=None, duration_s=10.0)))
    assert by_time[-1].at_s <= 10.0
    assert len(by_time) == pytest.approx(2000, rel=0.1)
    both = list(generate(spec(max_requests=100, duration_s=10.0)))
    assert len(both) == 100


def test_requests_are_drawn_lazily() -> None:
    stream = generate(spec(max_requests=10**9))
    assert [next(stream).id for _ in range(3)] == [0, 1, 2]


def test_the_same_seed_gives_the_same_stream_and_another_seed_another() -> None:
    one = list(generate(spec(max_requests=3000, seed=5)))
    assert one == list(generate(spec(max_requests=3000, seed=5)))
    other = list(generate(spec(max_requests=3000, seed=6)))
    assert [r.at_s for r in one] != [r.at_s for r in other]
    assert [r.prompt_tokens for r in one] != [r.prompt_tokens for r in other]


def test_every_request_has_one_block_per_whole_16_tokens_and_its_tenants_fields() -> None:
    tenants = {t.id: t for t in WorkloadSpec().tenants}
    cities = {c.name: c for c in CITIES}
    for r in generate(spec(max_requests=20_000)):
        assert len(r.prefix_blocks) == r.prompt_tokens // BLOCK_TOKENS
        assert r.priority is tenants[r.tenant].priority
        assert r.origin == cities[r.city].location


def test_a_sessions_turns_extend_the_previous_turns_blocks() -> None:
    s = spec(max_requests=60_000, rate_rps=500.0, think_time_s=2.0)
    turns: dict[str, list[SimRequest]] = defaultdict(list)
    for r in generate(s):
        if r.session is not None:
            turns[r.session].append(r)
    multi = [t for t in turns.values() if len(t) > 1]
    assert len(multi) > 1000
    gaps = []
    for session in multi:
        assert len({(r.city, r.tenant) for r in session}) == 1
        for prev, cur in itertools.pairwise(session):
            assert cur.prompt_tokens >= prev.prompt_tokens + prev.output_tokens + MIN_MESSAGE_TOKENS
            assert cur.prefix_blocks[: len(prev.prefix_blocks)] == prev.prefix_blocks
            assert len(cur.prefix_blocks) >= len(prev.prefix_blocks)
            gaps.append(cur.at_s - prev.at_s)
    # Turns are spaced by an exponential think time of mean 2 s, plus the wait for
    # an arrival long enough to continue the session.
    assert statistics.fmean(gaps) >= 2.0 * 0.95


def test_blocks_are_shared_only_through_system_prompts_and_sessions() -> None:
    s = spec(max_requests=20_000)
    owner: dict[int, tuple[str, str]] = {}
    across: dict[str, set[int]] = defaultdict(set)
    for r in generate(s):
        group = r.session or f"request {r.id}"
        for position, block in enumerate(r.prefix_blocks):
            tenant, first_group = owner.setdefault(block, (r.tenant, group))
            assert tenant == r.tenant  # never shared across tenants
            if first_group != group:
                # Shared outside its session: a system prompt's block (at most 1024
                # tokens, so within the first 64 blocks).
                assert position < 1024 // BLOCK_TOKENS
                across[r.tenant].add(block)
    assert set(across) == {t.id for t in s.tenants}
    for blocks in across.values():
        assert len(blocks) <= 4 * 1024 // BLOCK_TOKENS  # 4 system prompts per tenant


def test_without_system_prompts_or_sessions_no_block_is_shared() -> None:
    s = spec(max_requests=5000, system_prompts_per_tenant=0, session_fraction=0.0)
    blocks = [b for r in generate(s) for b in r.prefix_blocks]
    assert len(blocks) == len(set(blocks)) > 100_000


def test_a_fresh_prompt_begins_with_one_of_its_tenants_system_prompts_or_with_nothing_shared() -> (
    None
):
    s = spec(max_requests=20_000, session_fraction=0.0)
    leads: dict[str, Counter[int]] = defaultdict(Counter)
    for r in generate(s):
        leads[r.tenant][r.prefix_blocks[0]] += 1
    for counter in leads.values():
        reused = [block for block, n in counter.items() if n > 1]
        assert len(reused) == 4  # the tenant's 4 system prompts; every other lead is fresh
        with_system = sum(counter[b] for b in reused)
        # Prompts at least a system prompt + a message long carry one: most of them.
        assert with_system / sum(counter.values()) > 0.5


def test_mean_request_shape_is_the_published_means_and_the_measured_shared_fraction() -> None:
    s = spec(max_requests=None, duration_s=30.0, rate_rps=500.0)
    prompt, output, shared = mean_request_shape(s)
    assert prompt == pytest.approx(1155, rel=0.01)
    assert output == pytest.approx(211, rel=0.01)
    # Independently: the leading blocks of each request that an earlier request had.
    seen: set[int] = set()
    shared_tokens = total = 0
    stream = generate(dataclasses.replace(s, duration_s=None, max_requests=50_000))
    for r in stream:
        lead = 0
        for block in r.prefix_blocks:
            if block not in seen:
                break
            lead += 1
        shared_tokens += lead * BLOCK_TOKENS
        total += r.prompt_tokens
        seen.update(r.prefix_blocks)
    assert shared == pytest.approx(shared_tokens / total, abs=0.01)
    assert 0.25 < shared < 0.6  # system prompts and sessions share a good part


def test_sessions_hold_about_the_asked_share_of_requests_once_warmed_up() -> None:
    # The first think times (30 s) have no follow-up turns yet; after 120 s the share
    # is steady. Sessions that outgrow the shape's prompts end early, so it stays
    # below the asked 0.3.
    requests = generate(spec(max_requests=150_000, rate_rps=500.0))
    late = [r for r in requests if r.at_s > 120.0]
    share = sum(r.session is not None for r in late) / len(late)
    assert 0.24 < share <= 0.3
    none = list(generate(spec(max_requests=10_000, session_fraction=0.0)))
    assert all(r.session is None for r in none)


# ------------------------------------------------------------------ bad specs

BAD_SPECS: list[tuple[dict[str, Any], str]] = [
    ({"rate_rps": 0}, "WorkloadSpec.rate_rps must be a number > 0, got 0"),
    ({"rate_rps": math.nan}, "WorkloadSpec.rate_rps must be a number > 0, got nan"),
    (
        {"duration_s": None, "max_requests": None},
        "WorkloadSpec.duration_s and max_requests are both None: set one",
    ),
    ({"duration_s": -1.0}, "WorkloadSpec.duration_s must be a number > 0, got -1.0"),
    ({"max_requests": 0}, "WorkloadSpec.max_requests must be an integer >= 1, got 0"),
    ({"day_length_s": 0}, "WorkloadSpec.day_length_s must be a number > 0, got 0"),
    ({"start_utc_hour": 24}, "WorkloadSpec.start_utc_hour must be in [0, 24), got 24"),
    ({"interarrival_cv": 0}, "WorkloadSpec.interarrival_cv must be a number > 0, got 0"),
    ({"model": ""}, "WorkloadSpec.model must be a model name"),
    ({"cities": ()}, "WorkloadSpec.cities must list at least one city"),
    ({"cities": (CITIES[0], CITIES[0])}, "WorkloadSpec.cities has duplicate names: ['New York']"),
    (
        {"cities": (City("X", GeoPoint(0, 0), 0, 0.0),)},
        "WorkloadSpec.cities weight of 'X' must be > 0, got 0.0",
    ),
    ({"tenants": ()}, "WorkloadSpec.tenants must list at least one tenant"),
    (
        {"tenants": (TenantMix("a", 1), TenantMix("a", 2))},
        "WorkloadSpec.tenants ids must be non-empty and distinct, got ['a', 'a']",
    ),
    (
        {"tenants": (TenantMix("a", -1, Priority.CRITICAL),)},
        "WorkloadSpec.tenants weight of 'a' must be > 0, got -1",
    ),
    (
        {"system_prompts_per_tenant": -1},
        "WorkloadSpec.system_prompts_per_tenant must be >= 0, got -1",
    ),
    (
        {"system_prompt_tokens": (8, 100)},
        "WorkloadSpec.system_prompt_tokens must be (low, high) with 16 <= low <= high",
    ),
    ({"session_fraction": 1.0}, "WorkloadSpec.session_fraction must be in [0, 1), got 1.0"),
    ({"mean_turns": 1.5}, "WorkloadSpec.mean_turns must be >= 2"),
    ({"think_time_s": 0}, "WorkloadSpec.think_time_s must be a number > 0, got 0"),
    (
        {"boosts": (Boost(50.0, 10.0, 3.0),)},
        "WorkloadSpec.boosts[0] needs 0 <= start_s < end_s, got 50.0 and 10.0",
    ),
    ({"boosts": (Boost(0.0, 10.0, 0.0),)}, "WorkloadSpec.boosts[0].factor must be a number > 0"),
    (
        {"boosts": (Boost(0.0, 10.0, 3.0, cities=frozenset({"Atlantis"})),)},
        "WorkloadSpec.boosts[0].cities must name known cities, got unknown ['Atlantis']",
    ),
    (
        {"boosts": (Boost(0.0, 10.0, 3.0, tenant="nobody"),)},
        "WorkloadSpec.boosts[0].tenant must name a tenant of the workload, got 'nobody'",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_SPECS, ids=[m for _, m in BAD_SPECS])
def test_a_bad_spec_names_the_field_and_what_to_fix(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        WorkloadSpec(**overrides)
    assert message in str(info.value)
