"""A tier plans each request at min(cap, the typical answer it has seen for such caps)."""

from __future__ import annotations

import pytest

from common.request.output_length import OutputLengths, cap_class


def test_the_cap_until_an_answer_of_the_model_was_seen() -> None:
    lengths = OutputLengths()
    assert lengths.planned("m", 4096) == 4096
    lengths.observe("other", 4096, 10)
    assert lengths.planned("m", 4096) == 4096
    assert lengths.planned("other", 4096) == 10


def test_a_cap_below_the_typical_answer_is_the_plan() -> None:
    lengths = OutputLengths()
    lengths.observe("m", 8000, 300)
    assert lengths.planned("m", 8000) == 300
    assert lengths.planned("m", 256) == 256
    assert lengths.planned("m", 300) == 300


def test_the_typical_answer_follows_the_answers_as_an_ewma() -> None:
    lengths = OutputLengths(alpha=0.5)
    lengths.observe("m", 1000, 100)
    lengths.observe("m", 1000, 300)
    assert lengths.typical["m"] == pytest.approx(200.0)
    lengths.observe("m", 1000, 0)
    assert lengths.typical["m"] == pytest.approx(100.0)
    # An answer of no tokens never plans a request at nothing.
    lengths = OutputLengths(alpha=1.0)
    lengths.observe("m", 64, 0)
    assert lengths.planned("m", 64) == 1


def test_caps_within_a_factor_of_two_share_a_class() -> None:
    assert cap_class(129) == cap_class(256) == 8
    assert cap_class(128) == 7
    assert cap_class(257) == 9
    assert cap_class(1) == cap_class(0) == 0


def test_where_caps_follow_the_answers_a_long_cap_plans_long() -> None:
    """Clients that ask for about what they need: answers of 200 under caps near 256,
    of 20 under caps near 32. One typical length for all (the old rule) planned both
    kinds at the same ~110 tokens; each class plans at its own answers."""
    lengths = OutputLengths(alpha=0.1)
    for _ in range(200):
        lengths.observe("m", 240, 200)
        lengths.observe("m", 30, 20)
    assert lengths.planned("m", 250) == 200
    assert lengths.planned("m", 31) == 20
    # A class not seen yet takes the model's typical answer.
    assert 100 < lengths.planned("m", 4000) < 120


def test_where_caps_say_nothing_every_class_plans_the_same() -> None:
    lengths = OutputLengths(alpha=0.1)
    for _ in range(200):
        for cap in (256, 1024, 4096):
            lengths.observe("m", cap, 150)
    assert lengths.planned("m", 256) == lengths.planned("m", 1024) == lengths.planned("m", 4096)
