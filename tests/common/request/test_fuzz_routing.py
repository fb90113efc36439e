"""Fuzzing what the tiers read from gRPC metadata, in process: routing hints
(``routing.parse_hints``), the client location (``geo.parse_geo``), the prefix blocks
carried between tiers (``prefix.decode_blocks``) and the API key
(``auth.bearer_key``).

Properties: only the documented error comes out (RouteError with its status,
ValueError for a location) and it names the metadata key to fix; what a tier
accepts it passes down as metadata gRPC can send, with values in their range.
Deterministic and bounded; ``test_limits`` covers what stock clients send.
"""

from __future__ import annotations

import math
import string
from typing import Any

import grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from common.basics.errors import RouteError
from common.basics.geo import parse_geo
from common.basics.vocabulary import PRIORITY_NAMES
from common.request.prefix import MAX_CARRIED_BLOCKS, PREFIX_BLOCKS, decode_blocks, encode_blocks
from common.request.routing import (
    ATTEMPT,
    CLIENT_GEO,
    CLIENT_KEYS,
    CLIENT_REGION,
    INTERNAL_KEYS,
    PRIORITY,
    SESSION,
    TRACE_KEYS,
    parse_hints,
)
from common.tenancy.auth import bearer_key

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
KNOWN = sorted(CLIENT_KEYS | INTERNAL_KEYS | TRACE_KEYS)
KEYS = st.one_of(
    st.sampled_from(KNOWN),
    st.sampled_from(["x-meridian-prority", "x-meridian-route", "x-meridian-", "authorization"]),
    st.text(string.ascii_lowercase + "-", min_size=1, max_size=8).map(lambda k: "x-meridian-" + k),
    st.text(string.ascii_lowercase + "-_.", min_size=1, max_size=8),
)
VALUES = st.one_of(
    st.sampled_from(
        [
            "53.35,-6.26",
            "-90,180",
            "nan,0",
            "1e999,1",
            "1_0,2",
            " 1 , 2 ",
            "critical",
            "Critical",
            "",
            "7",
            "-1",
            "0" * 16,
            "ffffffffffffffff",
            "-fffffffffffffff",
            "+000000000000001",
            "0000_00000000001",
            " 00000000000000f",
            "00000000000000g1",
        ]
    ),
    st.text(max_size=20),
    st.text(string.printable, max_size=300),
    st.binary(max_size=8),
)
METADATA = st.lists(st.tuples(KEYS, VALUES), max_size=5)


def names_a_key(message: str, metadata: list[tuple[str, Any]]) -> bool:
    return any(f"'{key}'" in message or repr(key[:64]) in message for key, _ in metadata)


@FUZZ
@given(metadata=METADATA, trust_internal=st.booleans())
@example(metadata=[(PREFIX_BLOCKS, "-fffffffffffffff")], trust_internal=True)  # found: -0xfff…
@example(metadata=[(PREFIX_BLOCKS, "+000000000000001")], trust_internal=True)
@example(metadata=[(PREFIX_BLOCKS, "0000_00000000001")], trust_internal=True)
@example(metadata=[(PREFIX_BLOCKS, ".".join(["0" * 16] * 65))], trust_internal=True)
@example(metadata=[(CLIENT_GEO, "1_0,2")], trust_internal=False)
@example(metadata=[(CLIENT_GEO, "\u0661,2")], trust_internal=False)  # an Arabic-Indic 1
@example(metadata=[(ATTEMPT, "\u0661")], trust_internal=True)
@example(metadata=[(ATTEMPT, "9" * 256)], trust_internal=True)
@example(metadata=[(SESSION, b"\xff")], trust_internal=False)
@example(metadata=[("traceparent", "\x00")], trust_internal=False)
@example(metadata=[(CLIENT_REGION, "")], trust_internal=False)
@example(metadata=[(PRIORITY, "CRITICAL")], trust_internal=False)
def test_metadata_parses_or_names_its_key(
    metadata: list[tuple[str, Any]], trust_internal: bool
) -> None:
    try:
        hints = parse_hints(metadata, trust_internal=trust_internal)
    except RouteError as err:
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, err
        assert names_a_key(err.message, metadata), err.message
        return
    assert hints.priority.name.lower() in PRIORITY_NAMES
    if hints.origin is not None:
        assert -90 <= hints.origin.lat <= 90 and -180 <= hints.origin.lon <= 180
    assert all(0 <= block < 2**64 for block in hints.prefix_blocks), hints.prefix_blocks
    assert len(hints.prefix_blocks) <= MAX_CARRIED_BLOCKS
    if not trust_internal:  # a client cannot speak for an inner tier
        assert (hints.tenant, hints.prefix_blocks, hints.attempt) == ("", (), 0)
    down = hints.downstream_metadata(hints.origin, 1, hints.prefix_blocks)
    for key, value in down:  # what gRPC will send to the tier below
        assert value.isascii() and value.isprintable(), (key, value)
    again = parse_hints(down, trust_internal=True)  # and the tier below reads it back
    assert (again.session, again.priority, again.prefix_blocks) == (
        hints.session,
        hints.priority,
        hints.prefix_blocks,
    )


@FUZZ
@given(blocks=st.lists(st.integers(0, 2**64 - 1), max_size=MAX_CARRIED_BLOCKS))
def test_prefix_blocks_round_trip(blocks: list[int]) -> None:
    assert decode_blocks(encode_blocks(blocks)) == blocks


@FUZZ
@given(text=st.one_of(st.text(max_size=24), VALUES.filter(lambda v: isinstance(v, str))))
@example(text="90.0000001,0")
@example(text="-0,-180")
@example(text="inf,0")
def test_a_location_parses_in_range_or_says_why(text: str) -> None:
    try:
        point = parse_geo(text)
    except ValueError as err:
        assert "lat" in str(err), err
        return
    assert math.isfinite(point.lat) and -90 <= point.lat <= 90
    assert math.isfinite(point.lon) and -180 <= point.lon <= 180


@FUZZ
@given(
    metadata=st.lists(st.tuples(st.sampled_from(["authorization", "x-other"]), VALUES), max_size=3)
)
@example(metadata=[("authorization", "Bearer ")])
@example(metadata=[("authorization", "bearer mk_x")])
@example(metadata=[("authorization", b"Bearer mk_x")])
@example(metadata=[("authorization", "Bearer " + "k" * 600)])
def test_the_api_key_is_read_or_refused_naming_authorization(
    metadata: list[tuple[str, Any]],
) -> None:
    try:
        key = bearer_key(metadata)
    except RouteError as err:
        assert err.code == grpc.StatusCode.UNAUTHENTICATED and "'authorization" in err.message
        return
    last = [v for k, v in metadata if k == "authorization"][-1]
    assert isinstance(last, str) and last.startswith("Bearer ") and key == last[7:].strip()
