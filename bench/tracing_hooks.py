"""The CPU of tracing's own code per request, measured alone (for bench.tracing_overhead).

A whole tier's requests/s on this shared 2-core machine moves by several percent from one
window to the next, more than tracing at the default sampler costs, so the bench also
times what tracing adds directly: a tier's ``TierTracing`` driven for one request the way
the call interceptor and the forwarding loop drive it (server span, ``pick`` span,
attempt span, the context written into the child's metadata, both spans ended), with the
real SDK provider ``setup_tracing`` builds and its in-memory span ring, at each position
a tier can be in:

* *edge*: the caller sends no ``traceparent``; the sampler decides (the global tier, or a
  local tier called directly);
* *below, unsampled parent*: the edge dropped the request (9 in 10 at the default);
* *below, sampled parent*: the edge traced it, so every tier below does too.

Not counted here: gRPC sending and parsing the extra ``traceparent`` header, which the
whole-tier windows of bench.tracing_overhead include.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence

import grpc
from opentelemetry import trace

from common.config.node import Endpoint
from common.observability.tracing import Telemetry, TierTracing
from common.request.balancer import Lease
from common.request.call import CallRecord
from common.request.child import Child

METHOD = "/inference.GRPCInferenceService/ModelInfer"
Metadata = list[tuple[str, str]]
BASE: Metadata = [("x-meridian-tenant", "t1"), ("content-type", "application/grpc")]
POSITIONS = ("edge", "below, unsampled parent", "below, sampled parent")


def parents(sampled: bool, count: int, rng: random.Random) -> list[Metadata]:
    """``count`` callers' metadata, each with a ``traceparent`` of its own."""
    flags = "01" if sampled else "00"
    return [
        [
            *BASE,
            ("traceparent", f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-{flags}"),
        ]
        for _ in range(count)
    ]


def one_request(tracing: TierTracing, metadata: Metadata, child: Child) -> Metadata:
    """The tracing calls a tier makes for one request forwarded at the first attempt."""
    call = CallRecord(METHOD, metadata, 0.0)
    tracing.call_started(call)
    parent = call.span
    started = tracing.decision_started(parent)
    lease = Lease(child, 1.0, 0.0, reason="least-cost", candidates=4, estimated_s=0.01)
    tracing.record_decision(parent, started, lease)
    tracing.begin_attempt(METHOD, lease, 1, parent)
    down = tracing.child_metadata(list(metadata), lease, parent)
    tracing.end_attempt(lease, grpc.StatusCode.OK, "", 0.01)
    call.code = grpc.StatusCode.OK
    tracing.call_ended(call)
    return down


def us_per_request(tracing: TierTracing, callers: Sequence[Metadata], requests: int) -> float:
    """This thread's CPU per request: the calls run in it (the span ring too), and other
    threads of the process (a test run's, gRPC's) are not theirs to count."""
    child = Child("gpu-0", Endpoint("127.0.0.1", 9000), frozenset({"m"}))
    cpu = time.thread_time()
    for i in range(requests):
        one_request(tracing, callers[i % len(callers)], child)
    return (time.thread_time() - cpu) / requests * 1e6


def hook_costs(
    modes: dict[str, Telemetry], requests: int, rounds: int
) -> dict[str, dict[str, float]]:
    """Median µs of CPU per request, by mode and position, over ``rounds`` interleaved
    rounds of ``requests`` requests each."""
    rng = random.Random(7)
    callers = {
        "edge": [BASE],
        "below, unsampled parent": parents(False, 1000, rng),
        "below, sampled parent": parents(True, 1000, rng),
    }
    samples: dict[str, dict[str, list[float]]] = {
        mode: {position: [] for position in POSITIONS} for mode in modes
    }
    tiers = {
        mode: TierTracing(telemetry.tracer, "local", telemetry.propagator)
        for mode, telemetry in modes.items()
    }
    for _ in range(rounds):
        for mode, tracing in tiers.items():
            for position in POSITIONS:
                samples[mode][position].append(us_per_request(tracing, callers[position], requests))
    return {
        mode: {position: statistics.median(values) for position, values in by_position.items()}
        for mode, by_position in samples.items()
    }


def chain_cost(costs: dict[str, float], ratio: float) -> float:
    """µs per request of tracing in a chain of three tiers when the edge traces ``ratio``
    of requests: the edge's own figure already mixes the sampler's decisions; below it a
    request is traced at every tier when the edge traced it, at none otherwise."""
    below = (1 - ratio) * costs["below, unsampled parent"] + ratio * costs["below, sampled parent"]
    return costs["edge"] + 2 * below


def no_op_tracing() -> Telemetry:
    return Telemetry(trace.NoOpTracer())
