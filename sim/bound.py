"""The lower bound: what no router can beat, computed per request without simulating GPUs.

For each request, the best it could possibly see from any router on this fleet:

    TTFT >= rtt + scale × step(batch 1, prefill of the prompt less its shared prefix)
    e2e  >= TTFT + scale × (output - 1) × step(batch 1, no prefill)

- ``rtt``: the least RTT from the request's origin to a region that serves its
  model (the simulator adds the served region's RTT to every latency it reports).
- ``scale``: ``time_scale / speed`` of the fastest GPU that serves the model, at
  its configured speed (throttling only ever slows a GPU).
- Alone on that GPU: batch 1 is the cheapest step (``sim.engine.step_cost_s`` grows
  with the batch and with every other request's prefill in the same step), and it
  is admitted the instant it arrives (no wait for a step boundary or a slot).
- Cached: at most its shared prefix (``SimRequest.shared_blocks``, the leading
  blocks an earlier request already had: a system prompt or an earlier turn). The
  rest of its blocks are new, so no prefix cache can hold them.
- ``output``: the true length, which the bound may know (it is no router).

Every term is a floor of what the simulated GPU charges (``sim.gpu_model``), so
for every request each policy's TTFT and e2e are at least these; a failed request
is infinitely late. ``tests/sim/test_bound.py`` checks it request by request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.basics.geo import GeoPoint
from common.config.topology import Topology
from common.request.prefix import BLOCK_TOKENS
from sim.engine import step_cost_s
from sim.requests import SimRequest

BOUND = "bound"


@dataclass(frozen=True, slots=True)
class BoundLatency:
    """One request's floors, RTT included, and the region that gives them."""

    region: str
    rtt_ms: float
    ttft_s: float
    e2e_s: float


@dataclass(frozen=True, slots=True)
class _ModelFloor:
    """Per model: the regions that serve it and its fastest GPU's seconds per A100-second."""

    regions: tuple[tuple[str, GeoPoint], ...]
    scale: float


class LowerBound:
    """``latency(req)`` for requests on ``topology`` (see the module docstring); RTTs by
    ``rtt_ms(origin, region location)``, the function the simulator reports with."""

    def __init__(self, topology: Topology, rtt_ms: Callable[[GeoPoint, GeoPoint], float]) -> None:
        self._rtt = rtt_ms
        self._floors: dict[str, _ModelFloor] = {}
        for model in sorted(topology.models):
            regions, fastest = [], 0.0
            for region in topology.regions:
                speeds = [g.speed for z in region.zones for g in z.gpus if model in g.models]
                if speeds:
                    regions.append((region.name, region.location))
                    fastest = max(fastest, *speeds)
            self._floors[model] = _ModelFloor(tuple(regions), topology.time_scale / fastest)
        self._nearest: dict[tuple[str, GeoPoint], tuple[str, float]] = {}
        self._decode_s = step_cost_s(1, 0)

    def serves(self, model: str) -> bool:
        return model in self._floors

    def nearest(self, model: str, origin: GeoPoint) -> tuple[str, float]:
        """The region serving ``model`` nearest ``origin`` and its RTT in ms (cached)."""
        key = (model, origin)
        found = self._nearest.get(key)
        if found is None:
            rtt = self._rtt
            found = min(
                ((name, rtt(origin, where)) for name, where in self._floors[model].regions),
                key=lambda pair: pair[1],
            )
            self._nearest[key] = found
        return found

    def latency(self, req: SimRequest) -> BoundLatency:
        """The request's floors; KeyError when no GPU serves its model."""
        floor = self._floors[req.model]
        region, rtt_ms = self.nearest(req.model, req.origin)
        cached = min(req.prompt_tokens, req.shared_blocks * BLOCK_TOKENS)
        first = floor.scale * step_cost_s(1, req.prompt_tokens - cached)
        rest = floor.scale * max(0, req.output_tokens - 1) * self._decode_s
        rtt_s = rtt_ms / 1000.0
        return BoundLatency(region, rtt_ms, rtt_s + first, rtt_s + first + rest)
