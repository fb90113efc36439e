"""Fuzzing what the local tier reads from its GPUs, in process: the Prometheus
``/metrics`` scrape (``load_book.parse_prometheus_load``), the ``x-meridian-load``
trailer (``load_book.parse_load_trailer``) and an OpenAI GPU's ``/v1/models``
(``openai_probe.served_models``).

These are reports, not requests: whatever a GPU sends, the parser returns a load
with finite values >= 0 (or a set of model names), or None; it never raises, and
the regular expression stays linear on long hostile lines. Deterministic and bounded.
"""

from __future__ import annotations

import json
import math
import time

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from local_lb.load_book import parse_load_trailer, parse_prometheus_load
from local_lb.openai_probe import served_models

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
NAMES = st.sampled_from(
    [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "nv_inference_pending_request_count",
        "vllm:other",
        "# HELP vllm:num_requests_running",
    ]
)
LABELS = st.one_of(
    st.just(""),
    st.sampled_from(['{model="m"}', '{a="x,y",b="}"}', '{a="\\"q\\""}', "{}", '{a="', "{a=b}"]),
    st.text(max_size=12).map(lambda t: "{m=" + json.dumps(t) + "}"),
)
VALUES = st.one_of(
    st.floats().map(repr),
    st.sampled_from(["NaN", "+Inf", "-Inf", "-1", "1e400", "0x10", "1_0", "", "3 1700000000000"]),
    st.integers(0, 10**6).map(str),
)
LINES = st.one_of(
    st.tuples(NAMES, LABELS, st.sampled_from([" ", "\t", "  "]), VALUES).map("".join),
    st.text(max_size=30),
)


def finite_load(load: tuple[float, float, float | None] | None) -> bool:
    if load is None:
        return True
    running, waiting, kv = load
    values = [running, waiting] + ([] if kv is None else [kv])
    return all(math.isfinite(v) and v >= 0 for v in values)


@FUZZ
@given(lines=st.lists(LINES, max_size=8))
@example(lines=["vllm:num_requests_running 1e308", "vllm:num_requests_running 1e308"])
@example(lines=["vllm:num_requests_running{" + 'a="b",' * 2000 + "a=b 1"])  # long, unmatched
@example(lines=["vllm:num_requests_running{" + "a=" * 3000 + " 1"])
@example(lines=["vllm:kv_cache_usage_perc NaN", "sglang:token_usage 0.5"])
@example(lines=["vllm:num_requests_waiting -0.0"])
def test_a_scrape_reads_as_a_finite_load_or_none(lines: list[str]) -> None:
    started = time.perf_counter()
    load = parse_prometheus_load("\n".join(lines))
    assert time.perf_counter() - started < 1.0, "the sample regex backtracked"
    assert finite_load(load), (lines, load)


@FUZZ
@given(
    text=st.one_of(
        st.text(max_size=40),
        st.lists(
            st.tuples(st.sampled_from(["running", "waiting", "kv", "x", ""]), VALUES), max_size=5
        ).map(lambda kv: ",".join(f"{k}={v}" for k, v in kv)),
    )
)
@example(text="running=1e308,waiting=1e308,kv=1e400")
@example(text="running=1,waiting=2,kv=nan")
@example(text="running=1,waiting=2,kv=0.5,running=3")
@example(text="kv=0.5,waiting=2,running=1,extra=-1")
def test_a_load_trailer_reads_as_a_finite_load_or_none(text: str) -> None:
    assert finite_load(parse_load_trailer(text)), text


MODELS_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(["data", "id", "x"]), inner)
    ),
    max_leaves=10,
)


@FUZZ
@given(body=st.one_of(st.binary(max_size=30), MODELS_JSON.map(lambda v: json.dumps(v).encode())))
@example(body=b"[" * 100_000)  # found: RecursionError out of the health probe
@example(body=b'{"data": [{"id": ["x"]}, {"id": "m"}, 7]}')
@example(body=b'{"data": {"id": "m"}}')
@example(body=b"\xff")
def test_a_model_list_reads_as_names_or_none(body: bytes) -> None:
    models = served_models(body)
    assert models is None or all(isinstance(m, str) for m in models)
