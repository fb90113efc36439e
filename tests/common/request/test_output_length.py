"""A tier plans each request at min(cap, the typical answer it has seen)."""

from __future__ import annotations

import pytest

from common.request.output_length import OutputLengths


def test_the_cap_until_an_answer_of_the_model_was_seen() -> None:
    lengths = OutputLengths()
    assert lengths.planned("m", 4096) == 4096
    lengths.observe("other", 10)
    assert lengths.planned("m", 4096) == 4096
    assert lengths.planned("other", 4096) == 10


def test_a_cap_below_the_typical_answer_is_the_plan() -> None:
    lengths = OutputLengths()
    lengths.observe("m", 300)
    assert lengths.planned("m", 8000) == 300
    assert lengths.planned("m", 256) == 256
    assert lengths.planned("m", 300) == 300


def test_the_typical_answer_follows_the_answers_as_an_ewma() -> None:
    lengths = OutputLengths(alpha=0.5)
    lengths.observe("m", 100)
    lengths.observe("m", 300)
    assert lengths.typical["m"] == pytest.approx(200.0)
    lengths.observe("m", 0)
    assert lengths.typical["m"] == pytest.approx(100.0)
    # An answer of no tokens never plans a request at nothing.
    lengths = OutputLengths(alpha=1.0)
    lengths.observe("m", 0)
    assert lengths.planned("m", 64) == 1
