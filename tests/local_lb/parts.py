"""Shared helpers for the unit tests of the balancer's parts: real GPUs, an injected clock."""

from __future__ import annotations

from common.config.node import Endpoint
from local_lb.state import GpuChild

M = "m"


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def gpus(n: int = 2, slots: int = 2, models: frozenset[str] = frozenset({M})) -> list[GpuChild]:
    return [
        GpuChild(
            name=f"g{i}",
            endpoint=Endpoint("127.0.0.1", 1),
            models=models,
            slots=slots,
            rate=2000.0,
        )
        for i in range(n)
    ]
