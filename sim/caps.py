"""How clients set ``max_tokens``: the cap a router sees, apart from the answer's true length.

A real client sends a cap (often a fixed default of its SDK or application), or
none, and nobody knows how long the answer will be until it ends. The
workload draws each request's true length from its shape and its cap from a
``ClientCaps`` mix; the request then carries:

- ``max_tokens``: the cap as the serving stack resolves it. A client that sends
  none gets the server's limit, the model's context less the prompt (vLLM's
  behaviour); a fixed cap is lowered to that limit too, as a client whose
  request would not fit must do (else the server refuses it).
- ``output_tokens``: ``min(true length, max_tokens)``: generation stops at the
  cap (the answer is cut short, ``finish_reason: length``) or at its own end.

Only the simulated GPU reads ``output_tokens``; every tier, summary and cost sees
``max_tokens`` alone.

``DEFAULT_CAPS`` is an assumption, not a published statistic: no trace publishes
the caps clients send. It mixes the common cases — no cap (the OpenAI SDK's and
most frameworks' default), 256, 1024 and 4096 (SDK and application defaults) —
so that the cap says little about the length, as in production. ``EXACT`` is the
clairvoyant setting (every client asks for exactly its answer's length), kept to
measure what knowing the length was worth.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from sim.shapes import KV_CAP_TOKENS
from sim.stats import cumulative_shares

# The simulated model's context: the largest prompt + output any GPU of a fleet holds.
CONTEXT_TOKENS = KV_CAP_TOKENS


@dataclass(frozen=True)
class ClientCaps:
    """A mix of caps: ``(tokens, weight)`` pairs, ``tokens`` None for no cap. ``exact``:
    every client asks for exactly its answer's length (clairvoyant; a reference only)."""

    choices: tuple[tuple[int | None, float], ...] = ()
    exact: bool = False

    def __post_init__(self) -> None:
        if self.exact:
            if self.choices:
                raise ValueError("ClientCaps: exact takes no choices")
            return
        if not self.choices:
            raise ValueError("ClientCaps.choices must list at least one (tokens, weight)")
        for i, (tokens, weight) in enumerate(self.choices):
            if tokens is not None and (not isinstance(tokens, int) or tokens < 1):
                raise ValueError(
                    f"ClientCaps.choices[{i}] tokens must be >= 1 or None, got {tokens!r}"
                )
            if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
                raise ValueError(f"ClientCaps.choices[{i}] weight must be > 0, got {weight!r}")

    @property
    def label(self) -> str:
        if self.exact:
            return "exact (clairvoyant)"
        total = sum(w for _, w in self.choices)
        return ", ".join(f"{'none' if t is None else t} {w / total:.0%}" for t, w in self.choices)

    def cumulative(self) -> list[tuple[float, int | None]]:
        """``(cumulative share, tokens)`` per choice (``sim.stats.cumulative_shares``)."""
        return cumulative_shares(self.choices)

    def mean_output(self, lengths: Sequence[int]) -> float:
        """Mean tokens generated when the true lengths are ``lengths`` (equally likely)
        and each is cut at the cap drawn from this mix (a prompt-free server limit)."""
        if self.exact or not lengths:
            return sum(lengths) / len(lengths) if lengths else 0.0
        total = sum(w for _, w in self.choices)
        mean = 0.0
        for tokens, weight in self.choices:
            cap = CONTEXT_TOKENS if tokens is None else tokens
            mean += weight / total * sum(min(n, cap) for n in lengths) / len(lengths)
        return mean


DEFAULT_CAPS = ClientCaps(((None, 0.4), (256, 0.15), (1024, 0.25), (4096, 0.2)))
EXACT = ClientCaps(exact=True)


def resolve(cap: int | None, prompt_tokens: int, true_tokens: int) -> tuple[int, int]:
    """``(max_tokens, output_tokens)`` for a request that drew ``cap`` (None: the client
    sent none) and whose answer would run ``true_tokens`` (see the module docstring)."""
    limit = max(1, CONTEXT_TOKENS - prompt_tokens)
    max_tokens = limit if cap is None else min(cap, limit)
    return max_tokens, min(true_tokens, max_tokens)


class CapDraw:
    """Draws each request's cap from ``caps`` with ``rng`` (a generator of its own, so the
    rest of a workload draws the same as without caps): ``draw(prompt, true length)``
    gives ``(max_tokens, output_tokens)`` as ``resolve`` does."""

    __slots__ = ("random", "shares")

    def __init__(self, caps: ClientCaps, rng: random.Random) -> None:
        self.shares = None if caps.exact else caps.cumulative()
        self.random = rng.random

    def draw(self, prompt_tokens: int, true_tokens: int) -> tuple[int, int]:
        shares = self.shares
        if shares is None:
            return true_tokens, true_tokens
        u = self.random()
        for share, cap in shares:
            if u < share:
                return resolve(cap, prompt_tokens, true_tokens)
        return resolve(shares[-1][1], prompt_tokens, true_tokens)


def parse_caps(text: str) -> ClientCaps:
    """``--max-tokens``: ``default``, ``exact``, ``none``, a number (every client sends
    it), or a mix ``none:0.4,256:0.15,1024:0.25``; ValueError naming the bad part."""
    text = text.strip()
    if text == "default":
        return DEFAULT_CAPS
    if text == "exact":
        return EXACT
    choices: list[tuple[int | None, float]] = []
    for part in text.split(","):
        tokens_text, _, weight_text = part.strip().partition(":")
        try:
            tokens = None if tokens_text == "none" else int(tokens_text)
            weight = float(weight_text) if weight_text else 1.0
        except ValueError:
            raise ValueError(
                f"--max-tokens: {part.strip()!r} is not TOKENS[:WEIGHT] "
                "(TOKENS a number or 'none'); or use 'default' or 'exact'"
            ) from None
        choices.append((tokens, weight))
    return ClientCaps(tuple(choices))
