"""Prefix sharing in a synthetic workload: block hashes, system prompts, sessions.

A prompt's ``prefix_blocks`` stand for the chained hashes the edge computes
(``common.request.prefix``: one per ``BLOCK_TOKENS`` whole tokens, block i's
hash covering blocks 0..i). Without text to hash, ``BlockIds`` hands out
distinct integers from a seeded counter: a block whose content no earlier
prompt had gets a fresh one, a prompt that begins like another reuses that
prompt's leading tuple. Two prompts therefore share exactly the leading blocks
they share in content, as chained hashes would.

``SystemPrompts``: each tenant has a few system prompts (a popular few, weighted
1/rank) that its fresh requests begin with. ``SessionBook``: a conversation's
turn k+1 is its system prompt + every earlier prompt and output + a new message,
so its blocks extend turn k's prompt blocks (turn k's last partial block and its
output join the new blocks).

How a session keeps the published token distribution: every request draws its
prompt size from the shape first; it becomes a session's next turn only when
it is at least that session's last prompt + output + ``MIN_MESSAGE_TOKENS``.
Sessions whose think time has passed wait in a pool per (city, tenant); an
arrival takes the waiting session with the largest requirement it meets. So the
marginal prompt distribution is untouched, later turns are the longer prompts
(as in real chats), and a session ends when its context outgrows what the shape
ever draws, or when its pool overflows (``MAX_WAITING_PER_KEY``: the longest go).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from dataclasses import dataclass
from itertools import accumulate
from operator import attrgetter

from common.request.prefix import BLOCK_TOKENS

MIN_MESSAGE_TOKENS = 8
MAX_WAITING_PER_KEY = 64
CHOICE_SLOTS = 256


class BlockIds:
    """Distinct block hashes from a seeded counter (below 2**63, as 64-bit hashes are)."""

    def __init__(self, rng: random.Random) -> None:
        self._next = rng.getrandbits(61)

    def fresh(self, count: int) -> tuple[int, ...]:
        start = self._next
        self._next += count
        return tuple(range(start, self._next))

    def extend(self, prefix: tuple[int, ...], prompt_tokens: int) -> tuple[int, ...]:
        """Blocks of a prompt of ``prompt_tokens`` that begins with ``prefix``'s content."""
        whole = prompt_tokens // BLOCK_TOKENS
        have = len(prefix)
        if have >= whole:
            return prefix[:whole] if have > whole else prefix
        start = self._next
        self._next += whole - have
        return prefix + tuple(range(start, self._next))


class SystemPrompts:
    """Each tenant's few shared system prompts: sizes log-uniform in ``tokens``,
    popularity 1/rank (the first is used most)."""

    def __init__(
        self,
        tenants: int,
        per_tenant: int,
        tokens: tuple[int, int],
        ids: BlockIds,
        rng: random.Random,
    ) -> None:
        lo, hi = tokens
        self.prompts: list[list[tuple[int, tuple[int, ...]]]] = []
        for _ in range(tenants):
            own = []
            for _ in range(per_tenant):
                size = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
                own.append((size, ids.fresh(size // BLOCK_TOKENS)))
            self.prompts.append(own)
        # Which prompt a uniform draw picks, tabulated over CHOICE_SLOTS slices of [0, 1).
        cum = list(accumulate(1.0 / (rank + 1) for rank in range(per_tenant)))
        ranks = [
            min(bisect.bisect_right(cum, (k + 0.5) / CHOICE_SLOTS * cum[-1]), per_tenant - 1)
            for k in range(CHOICE_SLOTS if per_tenant else 0)
        ]
        none: list[tuple[int, tuple[int, ...]]] = [(0, ())] * CHOICE_SLOTS
        self._table = [[own[r] for r in ranks] if own else none for own in self.prompts]

    def choose(self, tenant: int, u: float) -> tuple[int, tuple[int, ...]]:
        """(tokens, blocks) of one of the tenant's prompts, for a uniform draw ``u``;
        (0, ()) when the tenant has none."""
        return self._table[tenant][int(u * CHOICE_SLOTS)]


@dataclass(slots=True, eq=False)
class Session:
    """A conversation: its last turn's prompt, output and blocks, and turns to come."""

    id: str
    key: int
    turns_left: int
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]
    required: int = 0

    def next_turn(self, prompt_tokens: int, output_tokens: int, blocks: tuple[int, ...]) -> None:
        self.turns_left -= 1
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.blocks = blocks


_REQUIRED = attrgetter("required")


class SessionBook:
    """Sessions between turns: thinking (a heap by ready time), then waiting in a pool
    per key for an arrival with a large enough prompt (see the module docstring).

    The caller checks the cheap conditions inline (hot path): ``wake(now)`` once
    ``now >= next_ready``, then ``take`` only when the key's pool (``waiting``) has a
    session whose requirement, its first (smallest), the prompt meets."""

    def __init__(self, think_time_s: float, max_prompt_tokens: int, rng: random.Random) -> None:
        self.think_time_s = think_time_s
        self.max_prompt_tokens = max_prompt_tokens
        self.uniform = rng.random
        self.next_ready = math.inf
        self.waiting: dict[int, list[Session]] = {}
        self._thinking: list[tuple[float, int, Session]] = []
        self._order = itertools.count()

    def after_turn(self, session: Session, at_s: float) -> None:
        """The session just had a turn at ``at_s``: think, then wait for the next one."""
        session.required = session.prompt_tokens + session.output_tokens + MIN_MESSAGE_TOKENS
        if session.turns_left <= 0 or session.required > self.max_prompt_tokens:
            return  # over, or its context outgrew every prompt the shape draws
        ready = at_s - math.log(1.0 - self.uniform()) * self.think_time_s  # exponential
        heapq.heappush(self._thinking, (ready, next(self._order), session))
        if ready < self.next_ready:
            self.next_ready = ready

    def wake(self, now: float) -> None:
        """Move every session whose think time is over by ``now`` to its key's pool."""
        thinking, waiting = self._thinking, self.waiting
        while thinking and thinking[0][0] <= now:
            session = heapq.heappop(thinking)[2]
            pool = waiting.get(session.key)
            if pool is None:
                pool = waiting[session.key] = []
            bisect.insort(pool, session, key=_REQUIRED)
            if len(pool) > MAX_WAITING_PER_KEY:
                pool.pop()
        self.next_ready = thinking[0][0] if thinking else math.inf

    @staticmethod
    def take(pool: list[Session], prompt_tokens: int) -> Session | None:
        """The session of ``pool`` with the largest requirement ``prompt_tokens`` meets,
        removed from it; None when it meets none."""
        i = bisect.bisect_right(pool, prompt_tokens, key=_REQUIRED)
        return pool.pop(i - 1) if i else None
