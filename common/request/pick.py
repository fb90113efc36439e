"""What a picker sees of a request, and the picker contract."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from common.basics.geo import GeoPoint
from common.basics.vocabulary import Priority
from common.request.children import Child

# Work of one prompt token that must be prefilled, in decode-token equivalents: prefill
# runs in parallel over the prompt, ~20x cheaper per token than decoding one. The unit
# of every tier's work figures (a zone's backlog, a GPU's cost).
PREFILL_WEIGHT = 0.05


@dataclass(frozen=True)
class PickRequest:
    """What a picker sees of a request."""

    model: str
    version: str
    origin: GeoPoint | None
    session: str | None
    priority: Priority
    prompt_tokens: int = 0
    max_tokens: int = 0
    tenant: str = ""
    # The client's declared region (x-meridian-client-region), for a measured RTT matrix.
    client_region: str | None = None
    # Data residency: the regions this request may be served in (empty: any).
    allowed_regions: frozenset[str] = frozenset()
    # Chained hashes of the prompt's leading blocks (common.request.prefix), computed at the edge.
    prefix_blocks: tuple[int, ...] = ()
    # The output this tier plans for (common.request.output_length): at most the cap,
    # less when the answers seen are shorter. None: the cap.
    planned_output: int | None = None

    @property
    def work_tokens(self) -> float:
        """Tokens this request may cost at most (prompt plus the cap): what quotas and
        time limits count."""
        return float(self.prompt_tokens + self.max_tokens)

    @property
    def output_tokens(self) -> int:
        """The output planned for: ``planned_output``, or the cap when none was set."""
        planned = self.planned_output
        return self.max_tokens if planned is None else planned

    @property
    def work(self) -> float:
        """Work this request is expected to put on a GPU with nothing cached, in the
        unit of a zone's backlog and throughput (planned decode tokens plus weighted
        prefill)."""
        return self.output_tokens + PREFILL_WEIGHT * self.prompt_tokens


class Picker(Protocol):
    """Ranks the children that may serve a request, best first. Pure: no I/O."""

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]: ...


def sent_since_report(child: Child) -> int:
    """Requests this tier sent ``child`` since its newest capacity report (summary or
    hint), less those it had in flight there when the report came that are back since:
    the report cannot show the first yet and still counts the second as busy. Negative
    when more came back than went: the child is less busy than reported. (Counting
    only what was sent, a zone's report made during this tier's one request read busy
    for a whole cadence after it was answered, and an idle region sent a client's
    requests to the next zone, in turns, from one report to the next.)"""
    return child.outstanding_requests - child.outstanding_at_report


def sent_work_since_report(child: Child) -> float:
    """``sent_since_report`` in work (``PickRequest.work``) rather than requests."""
    return child.outstanding_work - child.outstanding_work_at_report
