"""Helpers for picker tests: children and requests without servers."""

from typing import Any

from common.basics.geo import GeoPoint
from common.basics.vocabulary import Priority
from common.config.node import Endpoint
from common.gen.meridian.v1 import capacity_pb2
from common.request.children import Child
from common.request.pick import PickRequest

MODEL = "demo-llm"


def child(
    name: str,
    *,
    location: GeoPoint | None = None,
    models: tuple[str, ...] = (MODEL,),
    healthy: bool = True,
    speed: float = 1.0,
    outstanding_work: float = 0.0,
) -> Child:
    c = Child(
        name=name,
        endpoint=Endpoint("127.0.0.1", 1),
        models=frozenset(models),
        location=location,
        speed=speed,
    )
    c.healthy = healthy
    c.outstanding_work = outstanding_work
    return c


def with_summary(
    c: Child,
    healthy_gpus: int,
    received_at: float,
    model: str = MODEL,
    *,
    total_gpus: int = 4,
    **fields: Any,
) -> Child:
    entry = capacity_pb2.ModelCapacity(
        model=model, healthy_gpus=healthy_gpus, total_gpus=total_gpus, **fields
    )
    c.summary = capacity_pb2.CapacitySummary(source_id="s", sequence=1, models=[entry])
    c.summary_received_at = received_at
    return c


def request(
    origin: GeoPoint | None = None,
    model: str = MODEL,
    tokens: int = 10,
    *,
    client_region: str | None = None,
    allowed_regions: frozenset[str] = frozenset(),
) -> PickRequest:
    return PickRequest(
        model=model,
        version="",
        origin=origin,
        session=None,
        priority=Priority.STANDARD,
        prompt_tokens=tokens,
        max_tokens=tokens,
        client_region=client_region,
        allowed_regions=allowed_regions,
    )
