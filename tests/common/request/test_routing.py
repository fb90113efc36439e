import grpc
import pytest

from common.basics.errors import RouteError
from common.basics.geo import GeoPoint
from common.request.routing import ATTEMPT, ORIGIN, parse_hints


def test_client_hints_parsed() -> None:
    hints = parse_hints(
        [
            ("x-meridian-client-geo", "53.35,-6.26"),
            ("x-meridian-session", "conv-1"),
            ("x-meridian-priority", "critical"),
            ("traceparent", "00-abc-def-01"),
            ("user-agent", "grpc-python"),
        ],
        trust_internal=False,
    )
    assert hints.origin == GeoPoint(53.35, -6.26)
    assert hints.session == "conv-1"
    assert hints.priority == "critical"
    assert ("traceparent", "00-abc-def-01") in hints.passed_down
    assert all(k != "user-agent" for k, _ in hints.passed_down)


def test_edge_ignores_internal_keys_from_clients() -> None:
    hints = parse_hints([(ORIGIN, "1,2"), (ATTEMPT, "5")], trust_internal=False)
    assert hints.origin is None and hints.attempt == 0
    md = hints.downstream_metadata(None, 0)
    assert (ORIGIN, "1,2") not in md


def test_inner_tier_trusts_origin_over_client_geo() -> None:
    hints = parse_hints(
        [(ORIGIN, "1.0,2.0"), ("x-meridian-client-geo", "50,5"), (ATTEMPT, "2")],
        trust_internal=True,
    )
    assert hints.origin == GeoPoint(1.0, 2.0)
    assert hints.attempt == 2


def test_downstream_metadata_carries_origin_and_attempt() -> None:
    hints = parse_hints([("x-meridian-session", "s")], trust_internal=False)
    md = hints.downstream_metadata(GeoPoint(1.5, 2.25), 1)
    assert (ORIGIN, "1.5000,2.2500") in md
    assert (ATTEMPT, "1") in md
    assert ("x-meridian-session", "s") in md


@pytest.mark.parametrize(
    ("metadata", "names"),
    [
        ([("x-meridian-client-geo", "dublin")], "x-meridian-client-geo"),
        ([("x-meridian-client-geo", "95,0")], "x-meridian-client-geo"),
        ([("x-meridian-priority", "urgent")], "x-meridian-priority"),
        ([("x-meridian-client-region", "")], "x-meridian-client-region"),
        ([("x-meridian-session", "s" * 300)], "x-meridian-session"),
    ],
)
def test_malformed_hint_is_invalid_argument_naming_key(
    metadata: list[tuple[str, str]], names: str
) -> None:
    with pytest.raises(RouteError) as err:
        parse_hints(metadata, trust_internal=False)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"'{names}'" in err.value.message


def test_a_value_is_read_only_when_every_character_is_printable_ascii() -> None:
    """The rule is 0x20-0x7E, character by character, over every code point below
    0x3000 (controls, DEL, Latin-1, other scripts' letters and spaces)."""
    for code in range(0x3000):
        char = chr(code)
        value = f"s{char}s"
        if 0x20 <= code <= 0x7E:
            assert parse_hints([("x-meridian-session", value)], trust_internal=False).session
            hints = parse_hints([("traceparent", value)], trust_internal=True)
            assert hints.passed_down == (("traceparent", value),)
        else:
            with pytest.raises(RouteError) as err:
                parse_hints([("x-meridian-session", value)], trust_internal=False)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, hex(code)
            # A trace header that breaks the rule is dropped, not refused.
            assert parse_hints([("traceparent", value)], trust_internal=True).passed_down == ()
