"""RankingBalancer: why a child was chosen, what it learns from a child's hint."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import pytest

from common.basics.geo import GeoPoint, great_circle_km
from common.capacity.summary import CAPACITY_HINT, encode_hint
from common.config.node import Endpoint
from common.gen.meridian.v1 import capacity_pb2
from common.request.balancer import HINT_CACHE_SIZE, Outcome, RankingBalancer
from common.request.children import Child, ChildSet
from common.request.pick import PickRequest

M = "demo-llm"
HOME = GeoPoint(50.0, 8.0)


class Fixed:
    """A picker ranking the children in the order it was given."""

    def __init__(self, order: list[Child]) -> None:
        self.order = order

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        return list(self.order)


def _child(name: str, location: GeoPoint | None) -> Child:
    return Child(name, Endpoint("127.0.0.1", 1), frozenset({M}), location=location)


def _balancer(*children: Child, kind: str = "region") -> RankingBalancer:
    return RankingBalancer(
        Fixed(list(children)),
        ChildSet(children, probe_interval_s=1, summary_ttl_s=1.5, kind=kind, clock=lambda: 10.0),
    )


def _pick(origin: GeoPoint | None = HOME) -> PickRequest:
    return PickRequest(M, "", origin, None, "standard", 10, 20)


def _as_min_finds_it(origin: GeoPoint, child: Child, ranked: list[Child], kind: str) -> str:
    """The rule stated plainly: the first child of least distance is the nearest."""
    nearest = min(ranked, key=lambda c: great_circle_km(origin, c.location) if c.location else 1e9)
    return f"nearest {kind}" if nearest is child else "spill"


NEAR, FAR, TWIN = GeoPoint(50.1, 8.6), GeoPoint(40.7, -74.0), GeoPoint(50.1, 8.6)


@pytest.mark.parametrize(
    ("places", "chosen", "expected"),
    [
        ([NEAR, FAR], 0, "nearest region"),
        ([FAR, NEAR], 0, "spill"),
        ([FAR, NEAR], 1, "nearest region"),
        ([NEAR, TWIN], 1, "spill"),  # as near, but ranked after the first
        ([NEAR, TWIN], 0, "nearest region"),  # as near, ranked first
        ([NEAR, None], 0, "nearest region"),  # no location: far away
        ([FAR, None, TWIN], 2, "nearest region"),
    ],
)
def test_the_reason_names_the_nearest_child_as_the_first_of_least_distance(
    places: list[GeoPoint | None], chosen: int, expected: str
) -> None:
    children = [_child(f"c{i}", p) for i, p in enumerate(places)]
    balancer = _balancer(*children)
    child = children[chosen]
    if child.location is not None:
        assert _as_min_finds_it(HOME, child, children, "region") == expected
    assert balancer.reason(_pick(), child, children, ()) == expected


def test_the_reason_without_an_origin_or_after_a_failure() -> None:
    a, b = _child("a", NEAR), _child("b", None)
    balancer = _balancer(a, b)
    assert balancer.reason(_pick(None), a, [a, b], ()) == "ranked first"
    assert balancer.reason(_pick(), b, [a, b], ()) == "ranked first"
    assert balancer.reason(_pick(), a, [a, b], ("b",)) == "failover"


def _hint(free: int) -> tuple[tuple[str, str], ...]:
    entry = capacity_pb2.ModelCapacity(
        model=M, healthy_gpus=4, total_gpus=4, total_slots=64, free_slots=free
    )
    return ((CAPACITY_HINT, encode_hint(entry)),)


def _answer(
    balancer: RankingBalancer,
    trailers: tuple[tuple[str, str], ...],
    code: grpc.StatusCode = grpc.StatusCode.OK,
) -> Child:
    lease = asyncio.run(balancer.acquire(_pick(), (), None))
    balancer.release(lease, Outcome(code, 0.1, trailers=trailers))
    return lease.child


def test_a_hint_is_decoded_once_per_text_and_read_as_sent() -> None:
    a = _child("a", NEAR)
    balancer = _balancer(a)
    _answer(balancer, _hint(10))
    first = a.hint
    assert first is not None and (first.free_slots, first.total_slots) == (10, 64)
    assert first.utilisation == pytest.approx(54 / 64)
    _answer(balancer, _hint(10))
    assert a.hint is first  # the same text: the same decoded hint
    _answer(balancer, _hint(3))
    assert a.hint is not first and a.hint is not None and a.hint.free_slots == 3
    assert a.outstanding_requests == 0


def test_a_malformed_hint_is_no_hint_and_a_failed_child_without_one_is_marked_down() -> None:
    a = _child("a", NEAR)
    balancer = _balancer(a)
    _answer(balancer, ((CAPACITY_HINT, "h=x"),))
    assert a.hint is None and a.healthy
    _answer(balancer, ((CAPACITY_HINT, "h=x"),), grpc.StatusCode.UNAVAILABLE)
    assert not a.healthy and a.last_error.startswith("UNAVAILABLE")


def test_the_remembered_hints_are_bounded() -> None:
    a = _child("a", NEAR)
    balancer = _balancer(a)
    for free in range(HINT_CACHE_SIZE + 5):
        _answer(balancer, _hint(free))
        assert a.hint is not None and a.hint.free_slots == free
    assert len(balancer._hints) <= HINT_CACHE_SIZE
