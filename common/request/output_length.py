"""How long answers turn out to be: what a tier plans for when a client's cap says little.

A client's ``max_tokens`` bounds its answer; it does not say how long the answer will
be. Many clients send a generous default or none (the server's limit, thousands of
tokens), while most answers stop far earlier. Planned at its cap, an uncapped chat
turn would weigh as much as dozens of real ones: a tier's backlog, its children's waits
and its GPUs' rates would all be counted in caps, and a mix of caps would make each
wrong in its own direction.

``OutputLengths`` learns the typical length of the answers this tier has passed back
(the completion count the GPU server reported, ``common.request.tokens``), per model
and per *cap class* (caps within a factor of two of each other: 129-256, 257-512,
...), and plans each request at ``min(cap, typical)`` with the typical answer of its
cap class, or of its model while that class has seen no answer. Until an answer of a
model has been seen it plans at the cap, as before. Per class, because where clients'
caps follow their answers (an application that asks for about what it needs) a long
cap is a long answer, and one typical length for all would plan every request capped
above it alike, so nothing downstream (the local picker's length weight) could tell a
long one; where caps say nothing of the length, every class learns the same typical
answer and the plan is the model's. Only what a server knows is used: the caps sent and
the lengths of answers already finished, never the one being asked for.

The typical length is an EWMA of the reported counts. Counts cut short by their own
caps pull it down a little (a censored mean); a request's plan is an estimate for
ranking and backlogs, never a limit: per-try timeouts and quotas keep using the cap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of one finished answer in a model's typical length: the last few hundred
# answers matter, so a shift in what clients ask for shows within seconds at load.
LENGTH_EWMA_ALPHA = 0.02


def cap_class(max_tokens: int) -> int:
    """The class of a cap: caps within a factor of two share one, (2**(k-1), 2**k] for
    class k, so the common round caps (256, 1024, 4096) head their classes."""
    return max(0, max_tokens - 1).bit_length()


@dataclass
class OutputLengths:
    """Per model and cap class, the typical length of the answers seen (see the module
    docstring)."""

    alpha: float = LENGTH_EWMA_ALPHA
    # Typical reported completion tokens by model (absent: none seen yet).
    typical: dict[str, float] = field(default_factory=dict)
    # The same by (model, cap class).
    by_cap: dict[tuple[str, int], float] = field(default_factory=dict)

    def observe(self, model: str, max_tokens: int, completion_tokens: int) -> None:
        """An answer of ``model`` capped at ``max_tokens`` ended, ``completion_tokens``
        long (as its server said)."""
        self.typical[model] = self._moved(self.typical.get(model), completion_tokens)
        key = (model, cap_class(max_tokens))
        self.by_cap[key] = self._moved(self.by_cap.get(key), completion_tokens)

    def planned(self, model: str, max_tokens: int) -> int:
        """The output to plan a request of ``model`` capped at ``max_tokens`` for: the
        cap, or the typical answer of its cap class (else of its model) when that is
        shorter (at least one token)."""
        typical = self.by_cap.get((model, cap_class(max_tokens)))
        if typical is None:
            typical = self.typical.get(model)
        if typical is None or typical >= max_tokens:
            return max_tokens
        return max(1, int(typical + 0.5))

    def _moved(self, previous: float | None, sample: int) -> float:
        if previous is None:
            return float(sample)
        return previous + self.alpha * (sample - previous)
