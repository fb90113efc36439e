"""Session affinity: consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

Each GPU owns ``vnodes`` points on a 64-bit ring. A session hashes to a
point and goes to the first GPU clockwise whose load is below
``ceil((1 + epsilon) * (total_load + 1) / n)``, so no GPU ever holds more than
(1+ε)× the average, and when a GPU joins or leaves only the sessions on it
(and the few that overflowed past it) move. The ring is rebuilt only when the
set of GPUs changes; a lookup is a bisect plus a short walk.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Iterable, Iterator

DEFAULT_EPSILON = 0.25
DEFAULT_VNODES = 64


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class BoundedLoadRing:
    """A consistent-hash ring of GPU names with a load bound."""

    def __init__(
        self,
        names: Iterable[str],
        *,
        epsilon: float = DEFAULT_EPSILON,
        vnodes: int = DEFAULT_VNODES,
    ) -> None:
        if epsilon <= 0:
            raise ValueError(f"epsilon must be > 0, got {epsilon}")
        self.epsilon = epsilon
        self.vnodes = vnodes
        self.names: frozenset[str] = frozenset()
        self._points: list[int] = []
        self._owners: list[str] = []
        self.rebuild(names)

    def rebuild(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)
        ring = sorted(
            (_point(f"{name}#{i}"), name) for name in self.names for i in range(self.vnodes)
        )
        self._points = [p for p, _ in ring]
        self._owners = [n for _, n in ring]

    def capacity(self, total_load: int, members: int | None = None) -> int:
        """Most load one GPU may hold once one more unit is placed."""
        n = members if members is not None else len(self.names)
        return max(1, math.ceil((1 + self.epsilon) * (total_load + 1) / max(1, n)))

    def walk(self, session: str) -> Iterator[str]:
        """Distinct GPU names clockwise from the session's point."""
        if not self._points:
            return
        start = bisect.bisect(self._points, _point(session))
        seen: set[str] = set()
        n = len(self._points)
        for i in range(n):
            name = self._owners[(start + i) % n]
            if name not in seen:
                seen.add(name)
                yield name
                if len(seen) == len(self.names):
                    return

    def lookup(
        self,
        session: str,
        load: Callable[[str], int],
        total_load: int,
        eligible: Callable[[str], bool],
    ) -> str | None:
        """The session's GPU: first eligible GPU clockwise with load under the bound."""
        bound = self.capacity(total_load)
        for name in self.walk(session):
            if eligible(name) and load(name) < bound:
                return name
        return None
