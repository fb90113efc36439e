"""How long answers turn out to be: what a tier plans for when a client's cap says little.

A client's ``max_tokens`` bounds its answer; it does not say how long the answer will
be. Many clients send a generous default or none (the server's limit, thousands of
tokens), while most answers stop far earlier. Planned at its cap, an uncapped chat
turn would weigh as much as dozens of real ones: a tier's backlog, its children's waits
and its GPUs' rates would all be counted in caps, and a mix of caps would make each
wrong in its own direction.

``OutputLengths`` learns, per model, the typical length of the answers this tier has
passed back (the completion count the GPU server reported, ``common.request.tokens``),
and plans each request at ``min(cap, typical)``. Until an answer of a model has been
seen it plans at the cap, as before. Only what a server knows is used: the lengths of
answers already finished, never the one being asked for.

The typical length is an EWMA of the reported counts. Counts cut short by their own
caps pull it down a little (a censored mean); a request's plan is an estimate for
ranking and backlogs, never a limit: per-try timeouts and quotas keep using the cap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of one finished answer in a model's typical length: the last few hundred
# answers matter, so a shift in what clients ask for shows within seconds at load.
LENGTH_EWMA_ALPHA = 0.02


@dataclass
class OutputLengths:
    """Per model, the typical length of the answers seen (see the module docstring)."""

    alpha: float = LENGTH_EWMA_ALPHA
    # Typical reported completion tokens by model (absent: none seen yet).
    typical: dict[str, float] = field(default_factory=dict)

    def observe(self, model: str, completion_tokens: int) -> None:
        """An answer of ``model`` ended, ``completion_tokens`` long (as its server said)."""
        previous = self.typical.get(model)
        if previous is None:
            self.typical[model] = float(completion_tokens)
        else:
            self.typical[model] = previous + self.alpha * (completion_tokens - previous)

    def planned(self, model: str, max_tokens: int) -> int:
        """The output to plan a request of ``model`` capped at ``max_tokens`` for: the
        cap, or the typical answer when that is shorter (at least one token)."""
        typical = self.typical.get(model)
        if typical is None or typical >= max_tokens:
            return max_tokens
        return max(1, int(typical + 0.5))
