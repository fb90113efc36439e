"""What recording one request costs a tier's metrics (a benchmark, not a test).

Times ``TierMetrics.call_ended`` — what the call interceptor runs once per request —
on a finished unary record (OK, a configured model and tenant, a first response and
token counts), with a trace id (so the latency histograms take an exemplar) and
without, and ``TierMetrics.decided`` (one per balancer decision) where it exists. Run
it from a checkout to compare two versions of the code:

    .venv/bin/python -m bench.metrics_observe
    (cd /other/checkout && /path/.venv/bin/python -m bench.metrics_observe)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import grpc

from common.basics.vocabulary import Priority
from common.config.node import Endpoint
from common.observability.tier_metrics import TierMetrics
from common.request.call import CallRecord
from common.request.children import Child, ChildSet
from common.request.pick import PickRequest
from common.request.routing import RouteHints

MODEL = "bench-llm"
TRACEPARENT = ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")


def record(trace: bool) -> CallRecord:
    passed = (TRACEPARENT,) if trace else ()
    hints = RouteHints(None, None, None, Priority.STANDARD, 1, passed, tenant="acme")
    call = CallRecord("ModelInfer", (), time.monotonic() - 0.2, hints=hints)
    call.model, call.code = MODEL, grpc.StatusCode.OK
    call.first_response_s = 0.2
    call.prompt_tokens, call.completion_tokens = 40, 120
    return call


def per_call_ns(fn: Callable[[], None], n: int, repeats: int) -> float:
    """The best of ``repeats`` runs of ``n`` calls, per call (timeit's convention)."""
    fn()  # the first call creates the label children
    runs = []
    for _ in range(repeats):
        gc.disable()
        start = time.perf_counter_ns()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter_ns() - start) / n)
        gc.enable()
    return min(runs), statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    child = Child("gpu-0", Endpoint("127.0.0.1", 1), frozenset({MODEL}))
    children = ChildSet([child], probe_interval_s=1, summary_ttl_s=3, probe=False)
    metrics = TierMetrics("local", children, models={MODEL}, tenants={"acme"})
    traced, plain = record(True), record(False)
    cases: dict[str, Callable[[], None]] = {
        "call_ended, with trace id": lambda: metrics.call_ended(traced),
        "call_ended, no trace id": lambda: metrics.call_ended(plain),
    }
    decided = getattr(metrics, "decided", None)
    if decided is not None:
        pick = PickRequest(MODEL, "", None, None, Priority.STANDARD, tenant="acme")
        cases["decided"] = lambda: decided(pick, "least_cost", None)
    for name, fn in cases.items():
        best, median = per_call_ns(fn, args.calls, args.repeats)
        print(f"{name:28s} best {best / 1000:6.2f} µs  median {median / 1000:6.2f} µs per call")


if __name__ == "__main__":
    main()
