"""The cheap path for a request the sampler drops: no SDK span, no re-injected context.

Under Meridian's default sampler (``parentbased_traceidratio``: 1 in 10) nine in ten
requests are dropped, and every tier below the edge receives them with a W3C
``traceparent`` whose sampled flag is off. Such a request gets no span anywhere, so
building one (context extraction, sampler, id generation, a ``NonRecordingSpan``) and
writing its context back into the child's metadata is pure cost: about 120 µs of CPU
per request and tier, measured (``bench/hop_cost.py``). A tier whose sampler follows
an unsampled remote parent (``ParentBased``'s default) and whose propagator is W3C
only therefore reads the flag itself and skips the span: the caller's ``traceparent``
goes down untouched (it is in the hints' ``passed_down``), which W3C Trace Context
allows a participant that records nothing, and keeps the decision below.

At the edge the dropped request has no parent: the SDK still starts it (the sampler
must see its new trace id), but its context is written down as one formatted header
instead of a round through the propagator.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from opentelemetry import trace
from opentelemetry.propagators.textmap import TextMapPropagator

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
W3C_FIELDS = frozenset({TRACEPARENT, TRACESTATE, "baggage"})
# The W3C header as the SDK's TraceContextTextMapPropagator accepts it.
_TRACEPARENT = re.compile(
    r"^\s*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\s*$"
)
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


def skips_unsampled(tracer: trace.Tracer, propagator: TextMapPropagator) -> bool:
    """True when ``tracer`` drops every span whose remote parent is unsampled and
    ``propagator`` carries W3C headers only (so ``traceparent`` alone says the decision)."""
    sampler = getattr(tracer, "sampler", None)
    if sampler is None or not set(propagator.fields) <= W3C_FIELDS:
        return False
    return "remoteParentNotSampled:AlwaysOffSampler" in sampler.get_description()


def unsampled_parent(metadata: Iterable[tuple[str, str | bytes]]) -> bool:
    """True when the caller's ``traceparent`` is valid and its sampled flag is off (a
    malformed one is ignored by the propagator too: the request starts a trace of its own)."""
    header = None
    for key, value in metadata:  # the last one, as ``extract_context``'s carrier keeps it
        if key == TRACEPARENT and isinstance(value, str):
            header = value
    match = None if header is None else _TRACEPARENT.match(header)
    if match is None:
        return False
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return False
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return False
    return not int(flags, 16) & 1


def inject_unsampled(metadata: list[tuple[str, str]], span: trace.Span) -> list[tuple[str, str]]:
    """``metadata`` carrying dropped ``span``'s context as W3C headers (what the
    tracecontext propagator writes; baggage passes down as the caller sent it)."""
    ctx = span.get_span_context()
    kept = [(k, v) for k, v in metadata if k != TRACEPARENT and k != TRACESTATE]
    kept.append((TRACEPARENT, f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"))
    if ctx.trace_state:
        kept.append((TRACESTATE, ctx.trace_state.to_header()))
    return kept
