"""The offered traffic: shared system prompts, multi-turn conversations, open-loop arrivals.

Pure and seeded. ``schedule(shape, seed)`` is the whole arrival sequence of one window,
and it is built once per round and sent unchanged to every front of that round, so
every front sees the same requests at the same offsets. Arrivals are a Poisson
process at ``shape.rate_rps``, bounded by ``shape.seconds`` and ``shape.max_requests``.
Each arrival either continues an open conversation (with ``shape.continue_p``, when one
has been quiet for at least ``shape.think_s``) or starts a new one on one of
``shape.prefixes`` shared system prompts (skewed: the first ones are the popular ones).
A turn's messages are the system prompt, every earlier turn (the user's message and an
assistant answer of the length that turn asked for) and the new user message, as a chat
client resends its history. The earlier answers are fixed filler, not what the GPU
said, so the sequence does not depend on any front; a conversation's next turn arrives
on schedule even if the previous one is still running (open loop).

``salted(turn, salt)`` puts one word in front of the system prompt: every window gets
its own salt, so no front finds a prefix cache warmed by the front before it, while the
word counts (the emulated tokenizer's tokens) stay the same.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from sim.engine import DECODE_STEP_BASE_S, DECODE_STEP_PER_SEQ_S, PREFILL_S_PER_TOKEN

_VOCAB = (
    "route token cache prefix zone region queue batch stream model latency answer "
    "request tenant budget shard replica window signal packet kernel tensor vector "
    "matrix layer weight prompt context memory engine worker server client"
).split()


@dataclass(frozen=True)
class Shape:
    """What one window offers."""

    rate_rps: float
    seconds: float
    max_requests: int = 100_000
    stream_share: float = 1.0  # of requests, the share sent with ``stream: true``
    prefixes: int = 8  # shared system prompts
    prefix_words: int = 160
    user_words: tuple[int, int] = (16, 48)  # a new user message, inclusive range
    output_tokens: tuple[int, int] = (32, 128)  # max_tokens, inclusive range
    continue_p: float = 0.75  # an arrival continues an open conversation
    think_s: float = 2.0  # a conversation's turns are at least this far apart
    max_turns: int = 8


@dataclass(frozen=True)
class Turn:
    """One request: when it is sent (seconds from the window's start) and what it asks."""

    at_s: float
    conversation: int
    index: int  # 0 for a conversation's first turn
    prefix: int
    messages: tuple[tuple[str, str], ...]  # (role, content), the system prompt first
    max_tokens: int
    stream: bool

    @property
    def prompt_words(self) -> int:
        return sum(len(content.split()) for _, content in self.messages)


@dataclass
class _Conversation:
    """An open conversation while the schedule is built."""

    ident: int
    prefix: int
    history: list[tuple[str, str]]
    last_at: float
    turns: int = 0


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_VOCAB) for _ in range(n))


def system_prompts(shape: Shape, seed: int) -> list[str]:
    """The shared system prompts (the same for every window of a run)."""
    rng = random.Random(f"prefixes-{seed}")
    return [f"system{i} " + _words(rng, shape.prefix_words - 1) for i in range(shape.prefixes)]


def schedule(shape: Shape, seed: int) -> list[Turn]:
    """Every request of one window, by arrival time (see the module docstring)."""
    rng = random.Random(seed)
    prompts = system_prompts(shape, seed)
    # Zipf-like popularity: prompt i drawn with weight 1/(i+1).
    weights = [1.0 / (i + 1) for i in range(shape.prefixes)]
    open_: list[_Conversation] = []
    turns: list[Turn] = []
    t = 0.0
    while len(turns) < shape.max_requests:
        t += rng.expovariate(shape.rate_rps)
        if t >= shape.seconds:
            break
        ready = [c for c in open_ if t - c.last_at >= shape.think_s]
        if ready and rng.random() < shape.continue_p:
            conv = rng.choice(ready)
        else:
            prefix = rng.choices(range(shape.prefixes), weights)[0]
            conv = _Conversation(len(turns), prefix, [("system", prompts[prefix])], t)
            open_.append(conv)
        question = _words(rng, rng.randint(*shape.user_words))
        max_tokens = rng.randint(*shape.output_tokens)
        stream = rng.random() < shape.stream_share
        messages = (*conv.history, ("user", question))
        turns.append(Turn(t, conv.ident, conv.turns, conv.prefix, messages, max_tokens, stream))
        conv.history += [("user", question), ("assistant", _words(rng, max_tokens))]
        conv.turns += 1
        conv.last_at = t
        if conv.turns >= shape.max_turns:
            open_.remove(conv)
    return turns


def salted(turn: Turn, salt: str) -> list[dict[str, str]]:
    """The turn's chat messages with ``salt`` as the system prompt's first word (same count)."""
    out = []
    for i, (role, content) in enumerate(turn.messages):
        if i == 0:
            content = salt + content[content.index(" ") :]
        out.append({"role": role, "content": content})
    return out


def mean_new_tokens(turns: list[Turn]) -> float:
    """Mean prompt tokens per request that no prefix cache can hold under perfect affinity:
    a first turn's user message (its system prompt is shared), a later turn's user message
    and the previous answer (the emulated GPU caches prompt blocks, not what it generated)."""
    if not turns:
        return 0.0
    total = 0
    for turn in turns:
        new = turn.messages[-1:] if turn.index == 0 else turn.messages[-2:]
        total += sum(len(content.split()) for _, content in new)
    return total / len(turns)


def capacity_rps(
    gpus: int, speed: float, slots: int, time_scale: float, out_tokens: float, new_tokens: float
) -> float:
    """Requests/s the emulated GPUs finish when every batch is full (``sim.engine``'s cost).

    One step decodes a token for each of ``b`` running sequences in ``BASE + PER_SEQ * b``
    and prefills what was admitted at ``PREFILL`` per token; at ``b = slots`` a request's
    share of a GPU's time is ``L * (BASE / slots + PER_SEQ) + P * PREFILL`` (times
    ``time_scale / speed``), ``L`` its output tokens and ``P`` its uncached prompt tokens.
    """
    per_request = out_tokens * (DECODE_STEP_BASE_S / slots + DECODE_STEP_PER_SEQ_S)
    per_request += new_tokens * PREFILL_S_PER_TOKEN
    return gpus * speed / (per_request * time_scale)


def expected_requests(rate_rps: float, seconds: float) -> int:
    """About how many requests a window of ``seconds`` at ``rate_rps`` offers."""
    return math.floor(rate_rps * seconds)
