"""Clients' caps: what a router sees (max_tokens) apart from the true length, case by case."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from sim.caps import (
    CONTEXT_TOKENS,
    DEFAULT_CAPS,
    EXACT,
    CapDraw,
    ClientCaps,
    parse_caps,
    resolve,
)
from sim.workload import WorkloadSpec, generate


def test_a_fixed_cap_cuts_a_longer_answer_and_leaves_a_shorter_one() -> None:
    assert resolve(256, 100, 600) == (256, 256)
    assert resolve(256, 100, 40) == (256, 40)


def test_no_cap_is_the_servers_limit_the_context_less_the_prompt() -> None:
    assert resolve(None, 1000, 300) == (CONTEXT_TOKENS - 1000, 300)


def test_a_cap_that_would_not_fit_is_lowered_to_the_limit() -> None:
    assert resolve(4096, CONTEXT_TOKENS - 100, 500) == (100, 100)


def test_exact_caps_are_the_true_length() -> None:
    draw = CapDraw(EXACT, random.Random(0))
    assert draw.draw(100, 77) == (77, 77)


def test_the_default_mix_draws_each_cap_at_its_share() -> None:
    draw = CapDraw(DEFAULT_CAPS, random.Random(1))
    caps = [draw.draw(100, 50)[0] for _ in range(20_000)]
    total = sum(w for _, w in DEFAULT_CAPS.choices)
    for tokens, weight in DEFAULT_CAPS.choices:
        value = CONTEXT_TOKENS - 100 if tokens is None else tokens
        assert caps.count(value) / len(caps) == pytest.approx(weight / total, abs=0.015)


def test_mean_output_counts_the_cut() -> None:
    caps = ClientCaps(((10, 1.0), (None, 1.0)))
    # Lengths 5 and 20: a cap of 10 gives 5 and 10, no cap 5 and 20.
    assert caps.mean_output([5, 20]) == pytest.approx((7.5 + 12.5) / 2)
    assert EXACT.mean_output([5, 20]) == 12.5


@pytest.mark.parametrize(
    ("text", "choices"),
    [
        ("1024", ((1024, 1.0),)),
        ("none", ((None, 1.0),)),
        ("none:0.5,256:0.5", ((None, 0.5), (256, 0.5))),
    ],
)
def test_parse_caps_reads_a_mix(text: str, choices: tuple[tuple[int | None, float], ...]) -> None:
    assert parse_caps(text).choices == choices


def test_parse_caps_names_the_bad_part() -> None:
    with pytest.raises(ValueError, match=r"'lots' is not TOKENS\[:WEIGHT\]"):
        parse_caps("256,lots")
    with pytest.raises(ValueError, match=r"choices\[0\] tokens must be >= 1"):
        parse_caps("0")
    with pytest.raises(ValueError, match=r"choices\[1\] weight must be > 0"):
        parse_caps("256,512:-1")
    assert parse_caps("default") is DEFAULT_CAPS and parse_caps("exact") is EXACT


def test_caps_change_no_arrival_and_never_raise_a_true_length() -> None:
    exact = list(generate(WorkloadSpec(seed=3, max_requests=3000, caps=EXACT)))
    capped = list(generate(WorkloadSpec(seed=3, max_requests=3000)))
    assert [(r.at_s, r.city, r.prompt_tokens) for r in exact] == [
        (r.at_s, r.city, r.prompt_tokens) for r in capped
    ]
    assert all(r.max_tokens == r.output_tokens for r in exact)
    pairs = list(zip(exact, capped, strict=True))
    assert all(c.output_tokens == min(e.output_tokens, c.max_tokens) for e, c in pairs)
    # The default mix: caps say little about the length, and some answers are cut.
    assert sum(c.max_tokens > 2 * c.output_tokens for c in capped) > 0.5 * len(capped)
    assert any(c.output_tokens < e.output_tokens for e, c in pairs)


def test_requests_draw_their_model_from_the_mix() -> None:
    spec = replace(WorkloadSpec(seed=5, max_requests=4000), models=(("a", 3.0), ("b", 1.0)))
    models = [r.model for r in generate(spec)]
    assert models.count("a") / len(models) == pytest.approx(0.75, abs=0.03)
    with pytest.raises(ValueError, match=r"WorkloadSpec.models\[0\]"):
        WorkloadSpec(models=(("", 1.0),))
