"""Routing hints: what a request says about itself in gRPC metadata.

Clients may send ``x-meridian-session``, ``x-meridian-priority``,
``x-meridian-client-geo`` (``lat,lon``) and ``x-meridian-client-region``. Tiers
talk to each other with internal keys (``x-meridian-origin``, the client
location the edge resolved, ``x-meridian-attempt``, ``x-meridian-tenant``,
``x-meridian-prefix-blocks`` and ``x-meridian-single-request``, which marks a
stream a tier opened for one request of its caller's stream:
``common.request.streaming``). The edge drops any internal key a client sends,
so a client cannot steer inner tiers; inner tiers accept internal keys from the
tier above — on a fleet with TLS, only from their own parent, proven by the
identity in its certificate: every other caller is refused before its metadata
is read (``common.request.peers``). A fleet without TLS trusts its network.

Format rules, checked before anything else reads a value:

* a value Meridian reads must be printable ASCII (0x20-0x7E) of at most
  ``MAX_VALUE_LEN`` characters, else INVALID_ARGUMENT naming the key. Stock gRPC
  clients cannot send anything else, but a raw HTTP/2 client can, and gRPC's
  server hands such bytes over as they came; forwarded unchecked, they would
  make the call to the tier below fail inside gRPC;
* ``traceparent``/``tracestate``/``baggage`` that break the same rule are dropped, not
  refused (W3C Trace Context: a tracer restarts the trace instead);
* at the edge, an ``x-meridian-*`` key that is neither a client key nor an
  internal one (a typo such as ``x-meridian-prority``, a response trailer such
  as ``x-meridian-route``) is INVALID_ARGUMENT naming it, so a mistake is never
  silently ignored. Inner tiers ignore such keys, so a newer tier above may add
  one during a rolling upgrade.

The size of the whole header block is bounded by gRPC itself
(``Limits.max_metadata_bytes``, see ``common.request.server``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.basics.errors import RouteError
from common.basics.geo import GeoPoint, format_geo, parse_geo
from common.basics.vocabulary import PRIORITY_NAMES, Priority
from common.request.prefix import PREFIX_BLOCKS, decode_blocks, encode_blocks

SESSION = "x-meridian-session"
PRIORITY = "x-meridian-priority"
CLIENT_GEO = "x-meridian-client-geo"
CLIENT_REGION = "x-meridian-client-region"
ORIGIN = "x-meridian-origin"
ATTEMPT = "x-meridian-attempt"
TENANT = "x-meridian-tenant"
ROUTE = "x-meridian-route"
LOAD = "x-meridian-load"
SINGLE_REQUEST = "x-meridian-single-request"

CLIENT_KEYS = frozenset({SESSION, PRIORITY, CLIENT_GEO, CLIENT_REGION})
INTERNAL_KEYS = frozenset({ORIGIN, ATTEMPT, TENANT, PREFIX_BLOCKS, SINGLE_REQUEST})
# Passed through to the tier below (and on to the GPU) when present.
TRACE_KEYS = frozenset({"traceparent", "tracestate", "baggage"})
PASS_THROUGH = TRACE_KEYS | CLIENT_KEYS
MERIDIAN_PREFIX = "x-meridian-"
MAX_VALUE_LEN = 256

Metadata = Sequence[tuple[str, str | bytes]]


@dataclass(frozen=True)
class RouteHints:
    """Routing facts about one request, parsed once from its metadata."""

    origin: GeoPoint | None
    client_region: str | None
    session: str | None
    priority: Priority
    attempt: int
    passed_down: tuple[tuple[str, str], ...]
    tenant: str = ""
    prefix_blocks: tuple[int, ...] = ()
    # Data residency of the tenant (set at the edge, never sent between tiers).
    allowed_regions: frozenset[str] = frozenset()
    # A stream the tier above opened for one request: its failure is the stream's status.
    single_request: bool = False

    def downstream_metadata(
        self, origin: GeoPoint | None, attempt: int, prefix_blocks: tuple[int, ...] = ()
    ) -> list[tuple[str, str]]:
        """Metadata for a call to the tier below."""
        md = list(self.passed_down)
        if origin is not None:
            md.append((ORIGIN, format_geo(origin)))
        md.append((ATTEMPT, str(attempt)))
        if self.tenant:
            md.append((TENANT, self.tenant))
        if prefix_blocks:
            md.append((PREFIX_BLOCKS, encode_blocks(list(prefix_blocks))))
        return md


def _printable(value: str) -> bool:
    """Every character in 0x20-0x7E: for ASCII, exactly what ``isprintable`` accepts
    (both run in C; a generator over the characters cost ~3 µs per traceparent)."""
    return value.isascii() and value.isprintable()


def _text(key: str, value: str | bytes) -> str:
    if isinstance(value, bytes):
        raise RouteError.invalid(f"metadata '{key}' must be text, not binary")
    if len(value) > MAX_VALUE_LEN and key != PREFIX_BLOCKS:
        raise RouteError.invalid(f"metadata '{key}' is longer than {MAX_VALUE_LEN} characters")
    if not _printable(value):
        raise RouteError.invalid(
            f"metadata '{key}' must be printable ASCII; it holds control or non-ASCII characters"
        )
    return value


def _unknown_key(key: str) -> RouteError:
    return RouteError.invalid(
        f"unknown metadata key {key[:64]!r}; Meridian reads {', '.join(sorted(CLIENT_KEYS))}"
    )


def parse_hints(metadata: Metadata | None, *, trust_internal: bool) -> RouteHints:
    """Read routing hints; a malformed value raises INVALID_ARGUMENT naming the key.

    ``trust_internal`` is False at the edge: internal keys from clients are
    dropped there, never believed, and unknown ``x-meridian-*`` keys refused.
    """
    values: dict[str, str] = {}
    passed: list[tuple[str, str]] = []
    for key, value in metadata or ():
        if key in TRACE_KEYS:
            if isinstance(value, str) and len(value) <= MAX_VALUE_LEN and _printable(value):
                passed.append((key, value))
        elif key in CLIENT_KEYS or (trust_internal and key in INTERNAL_KEYS):
            text = _text(key, value)
            values[key] = text
            if key in PASS_THROUGH:
                passed.append((key, text))
        elif not trust_internal and key.startswith(MERIDIAN_PREFIX) and key not in INTERNAL_KEYS:
            raise _unknown_key(key)
    origin = None
    if trust_internal and ORIGIN in values:
        origin = _geo(ORIGIN, values[ORIGIN])
    elif CLIENT_GEO in values:
        origin = _geo(CLIENT_GEO, values[CLIENT_GEO])
    asked = values.get(PRIORITY, "standard")
    priority = Priority.parse(asked)
    if priority is None:
        raise RouteError.invalid(
            f"metadata '{PRIORITY}' must be one of {', '.join(PRIORITY_NAMES)}; got {asked!r}"
        )
    attempt = 0
    if trust_internal and ATTEMPT in values:
        try:
            attempt = int(values[ATTEMPT])
        except ValueError:
            raise RouteError.invalid(f"metadata '{ATTEMPT}' must be an integer") from None
    blocks: tuple[int, ...] = ()
    if trust_internal and PREFIX_BLOCKS in values:
        blocks = tuple(decode_blocks(values[PREFIX_BLOCKS]))
    region = values.get(CLIENT_REGION)
    if region is not None and not region:
        raise RouteError.invalid(f"metadata '{CLIENT_REGION}' is empty; name a region or omit it")
    return RouteHints(
        origin=origin,
        client_region=region,
        session=values.get(SESSION) or None,
        priority=priority,
        attempt=attempt,
        passed_down=tuple(passed),
        tenant=values.get(TENANT, "") if trust_internal else "",
        prefix_blocks=blocks,
        single_request=trust_internal and values.get(SINGLE_REQUEST) == "1",
    )


def _geo(key: str, value: str) -> GeoPoint:
    try:
        return parse_geo(value)
    except ValueError as exc:
        raise RouteError.invalid(f"metadata '{key}': {exc}") from None


def trailer(metadata: Metadata | None, key: str) -> str | None:
    """The first text value of ``key`` in trailing metadata, if any."""
    for k, v in metadata or ():
        if k == key:
            return v.decode() if isinstance(v, bytes) else v
    return None
