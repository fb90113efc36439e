"""LeastWorkPicker: the local tier's first policy — the GPU with least outstanding work.

Outstanding work is the tokens (prompt plus max_tokens) of the requests this
tier has in flight on a GPU, divided by the GPU's speed, so an H100 is seen
as half as loaded as an A100 carrying the same work. The request's own work
is added to each candidate, which makes the rank its estimated completion
order. Only healthy GPUs serving the model are candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.children import Child
from common.proxy import PickRequest


def estimated_drain_tokens(child: Child, request_tokens: float) -> float:
    """Speed-normalised work on ``child`` once this request joins it (A100 tokens)."""
    return (child.outstanding_work + request_tokens) / child.speed


@dataclass
class LeastWorkPicker:
    """Rank GPUs by outstanding work over speed, least first."""

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        eligible = [c for c in children if c.healthy and request.model in c.models]
        eligible.sort(key=lambda c: estimated_drain_tokens(c, request.work_tokens))
        return eligible
