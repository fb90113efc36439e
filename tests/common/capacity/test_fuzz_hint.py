"""Fuzzing the capacity hint a tier reads from its child's ``x-meridian-capacity``
trailer (``common.capacity.summary.decode_hint``), in process.

A hint is only a hint: anything malformed reads as None (no hint), never raises,
and what is read has the values a summary could hold (counts in uint32, a wait and
a capacity that are numbers >= 0, utilisation in 0..1 when the slots say so).
What ``encode_hint`` writes reads back as the same entry. Deterministic and bounded.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from common.capacity.summary import decode_hint, encode_hint, expected_wait_s
from common.gen.meridian.v1 import capacity_pb2

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
UINT32 = st.integers(0, 2**32 - 1)
FIELD_KEYS = st.sampled_from([*"htsfquwc", "x", ""])
NUMBERS = st.one_of(
    UINT32.map(str),
    st.sampled_from(["-1", "4294967296", "nan", "inf", "-inf", "1e400", "+3", " 3", "3_0", ""]),
    st.floats().map(repr),
    st.text(max_size=5),
)
GOOD = "h=3,t=4,s=64,f=10,q=0,u=0,w=0.120000,c=8000"


@st.composite
def hint_texts(draw: st.DrawFn) -> str:
    """A well-formed hint with a few fields replaced, dropped or added."""
    fields = dict(part.split("=", 1) for part in GOOD.split(","))
    for key, value in draw(st.dictionaries(FIELD_KEYS, NUMBERS, max_size=3)).items():
        fields[key] = value
    for key in draw(st.lists(st.sampled_from(sorted(fields)), max_size=2)):
        fields.pop(key, None)
    return ",".join(f"{k}={v}" for k, v in fields.items())


@FUZZ
@given(text=st.one_of(hint_texts(), st.text(max_size=40)))
@example(text=GOOD.replace("w=0.120000", "w=nan"))  # found: a NaN wait, read as a hint
@example(text=GOOD.replace("w=0.120000", "w=-5"))  # found: a negative wait
@example(text=GOOD.replace("c=8000", "c=nan"))
@example(text=GOOD.replace("c=8000", "c=-1"))
@example(text=GOOD.replace("h=3", "h=-1"))
@example(text=GOOD.replace("s=64", "s=4294967296"))
@example(text=GOOD + ",w=1")  # a field twice: the last one counts
@example(text=GOOD.replace(",c=8000", ""))  # an older peer's hint, without capacity
@example(text="h=3,,t=4")
@example(text="=")
def test_a_hint_reads_as_an_entry_in_range_or_as_none(text: str) -> None:
    entry = decode_hint(text, "demo-llm")
    if entry is None:
        return
    assert entry.model == "demo-llm"
    assert entry.estimated_wait_s >= 0 and entry.token_throughput_capacity >= 0, text
    assert not math.isnan(expected_wait_s(entry, 3, 10.0, 1)), text
    if 0 < entry.total_slots and entry.free_slots <= entry.total_slots:
        assert 0 <= entry.utilisation <= 1


@FUZZ
@given(
    counts=st.tuples(UINT32, UINT32, UINT32, UINT32, UINT32, UINT32),
    wait=st.floats(0, 1e6),
    capacity=st.floats(0, 1e9),
)
def test_what_a_tier_writes_reads_back(
    counts: tuple[int, ...], wait: float, capacity: float
) -> None:
    healthy, total, slots, free, queued, unknown = counts
    entry = capacity_pb2.ModelCapacity(
        model="m",
        healthy_gpus=healthy,
        total_gpus=total,
        total_slots=slots,
        free_slots=free,
        queued_requests=queued,
        unknown_children=unknown,
        estimated_wait_s=wait,
        token_throughput_capacity=capacity,
    )
    decoded = decode_hint(encode_hint(entry), "m")
    assert decoded is not None
    assert (decoded.total_slots, decoded.free_slots, decoded.queued_requests) == (
        slots,
        free,
        queued,
    )
    assert decoded.estimated_wait_s == round(wait, 6)
    assert decoded.token_throughput_capacity == round(capacity)
    assert decode_hint(encode_hint(decoded), "m") == decoded  # a fixed point
