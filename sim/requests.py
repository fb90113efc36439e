"""What the fleet simulator moves around: one request as a workload emits it.

Workloads (``sim.workload``, ``sim.trace_csv``) yield ``SimRequest`` in arrival
order; the deployment (``sim.deployment``) routes each through the real pickers
and balancers; the recorder (``sim.measure``) keeps what happened to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.basics.geo import GeoPoint
from common.basics.vocabulary import Priority

SIM_MODEL = "sim-llm"


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One inference request: when and where it arrives, who sends it, its shape.

    ``output_tokens`` is the answer's true length, which only the simulated GPU
    knows (it stops there); ``max_tokens`` is the cap the client sent, resolved as
    a server resolves a missing one (``sim.caps``): all a router ever sees of the
    answer's length before it ends. ``output_tokens <= max_tokens``.

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
    max_tokens: int = field(kw_only=True)
    # Leading blocks of prefix_blocks an earlier request already had (a system prompt, an
    # earlier turn): the most any GPU's prefix cache can hold of this prompt (sim.bound).
    shared_blocks: int = field(default=0, kw_only=True)
