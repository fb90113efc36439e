"""What the fleet simulator moves around: one request as a workload emits it.

Workloads (``sim.workload``, ``sim.trace_csv``) yield ``SimRequest`` in arrival
order; the deployment (``sim.deployment``) routes each through the real pickers
and balancers; the recorder (``sim.measure``) keeps what happened to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.basics.geo import GeoPoint
from common.basics.vocabulary import Priority

SIM_MODEL = "sim-llm"


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One inference request: when and where it arrives, who sends it, its shape.

    ``prefix_blocks`` are chained hashes of the prompt's leading ``BLOCK_TOKENS``
    blocks (as ``common.request.prefix`` computes them at the edge): two requests
    share a prefix exactly as far as their leading hashes agree, which is what
    both the GPU's prefix cache and the local tier's prefix index look at.
    """

    id: int
    at_s: float
    city: str
    origin: GeoPoint
    tenant: str
    prompt_tokens: int
    output_tokens: int
    prefix_blocks: tuple[int, ...] = ()
    session: str | None = None
    priority: Priority = Priority.STANDARD
    model: str = SIM_MODEL
