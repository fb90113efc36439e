"""Words every tier uses, defined once: request priorities and the anonymous tenant."""

from __future__ import annotations

from enum import StrEnum


class Priority(StrEnum):
    """A request's priority class (``x-meridian-priority``), most urgent first.

    A ``StrEnum``: it compares equal to its wire name, and the declaration order is
    the order of urgency (``rank`` 0 is served first).
    """

    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"

    @property
    def rank(self) -> int:
        return _RANKS[self]

    @classmethod
    def parse(cls, value: str) -> Priority | None:
        """The priority named ``value``, or None when it names none."""
        try:
            return cls(value)
        except ValueError:
            return None


_RANKS = {p: i for i, p in enumerate(Priority)}
PRIORITY_NAMES = tuple(p.value for p in Priority)

# The tenant of every request when authentication is off (and of internal calls
# that carry none).
ANONYMOUS_TENANT = "anonymous"
