"""Log lines as JSON or text: keys, trace ids under a recording span, extra fields,
levels; shed load summarised once per window."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sys
import time
import warnings
from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from common.observability.logs import LogSettings, ShedLog, configure_logging
from common.request.call import STREAM_METHOD, CallRecord


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """Where ``configure_logging`` writes in a test; the root logger, warnings capture and
    excepthook are put back afterwards."""
    root = logging.getLogger()
    handlers, level, hook = list(root.handlers), root.level, sys.excepthook
    out = io.StringIO()
    try:
        yield out
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        sys.excepthook = hook
        logging.captureWarnings(False)


def lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_json_line_has_the_keys_and_the_extra_fields(stream: io.StringIO) -> None:
    configure_logging(LogSettings("json", "info"), stream)
    logging.getLogger("meridian.test").warning(
        "child %s marked down", "gpu-1", extra={"event": "child_down", "child": "gpu-1"}
    )
    (line,) = lines(stream)
    assert line["level"] == "warning" and line["logger"] == "meridian.test"
    assert line["message"] == "child gpu-1 marked down"
    assert line["event"] == "child_down" and line["child"] == "gpu-1"
    assert str(line["timestamp"]).endswith("Z") and "T" in str(line["timestamp"])
    assert "trace_id" not in line and "span_id" not in line


def test_a_line_under_a_recording_span_carries_its_ids(stream: io.StringIO) -> None:
    configure_logging(LogSettings("json", "info"), stream)
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("ModelInfer") as span:
        logging.getLogger("meridian.test").info("inside")
        ctx = span.get_span_context()
    logging.getLogger("meridian.test").info("outside")
    inside, outside = lines(stream)
    assert inside["trace_id"] == format(ctx.trace_id, "032x")
    assert inside["span_id"] == format(ctx.span_id, "016x")
    assert "trace_id" not in outside


def test_a_span_that_is_not_sampled_gives_no_ids(stream: io.StringIO) -> None:
    configure_logging(LogSettings("json", "info"), stream)
    with TracerProvider(sampler=ALWAYS_OFF).get_tracer("t").start_as_current_span("x"):
        logging.getLogger("meridian.test").info("unsampled")
    (line,) = lines(stream)
    assert "trace_id" not in line


def test_exceptions_and_warnings_stay_one_json_line_each(stream: io.StringIO) -> None:
    configure_logging(LogSettings("json", "info"), stream)
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        logging.getLogger("meridian.test").exception("probe failed")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("deprecated thing", DeprecationWarning, stacklevel=1)
    sys.excepthook(ValueError, ValueError("uncaught"), None)
    failed, warned, uncaught = lines(stream)
    assert "RuntimeError: boom" in str(failed["exception"]) and failed["level"] == "error"
    assert warned["logger"] == "py.warnings" and "deprecated thing" in str(warned["message"])
    assert uncaught["level"] == "critical" and "uncaught ValueError" in str(uncaught["message"])


def test_the_level_filters(stream: io.StringIO) -> None:
    configure_logging(LogSettings("json", "warning"), stream)
    log = logging.getLogger("meridian.test")
    log.info("quiet")
    log.debug("quieter")
    log.warning("loud")
    assert [line["message"] for line in lines(stream)] == ["loud"]


def test_text_lines_append_the_fields(stream: io.StringIO) -> None:
    configure_logging(LogSettings("text", "info"), stream)
    logging.getLogger("meridian.test").info("reloaded", extra={"event": "reload", "why": "a b"})
    line = stream.getvalue().strip()
    assert ' INFO meridian.test: reloaded  event=reload why="a b"' in line


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MERIDIAN_LOG_FORMAT": "xml"}, "MERIDIAN_LOG_FORMAT='xml'"),
        ({"MERIDIAN_LOG_LEVEL": "loud"}, "MERIDIAN_LOG_LEVEL='loud'"),
    ],
)
def test_bad_environment_values_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LogSettings.from_env(env)


def test_the_environment_sets_the_defaults() -> None:
    assert LogSettings.from_env({}) == LogSettings("text", "info")
    env = {"MERIDIAN_LOG_FORMAT": "JSON", "MERIDIAN_LOG_LEVEL": "Debug"}
    assert LogSettings.from_env(env) == LogSettings("json", "debug")


def shed(code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED) -> CallRecord:
    return CallRecord("ModelInfer", (), time.monotonic(), code=code)


async def test_a_burst_of_sheds_is_one_line_per_window(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sheds = ShedLog("global", window_s=0.2)
    with caplog.at_level(logging.INFO, logger="common.observability.logs"):
        for _ in range(120):
            sheds.call_ended(shed())
        sheds.call_ended(shed(code=grpc.StatusCode.OK))  # not a shed
        stream = CallRecord(
            STREAM_METHOD, (), time.monotonic(), code=grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        stream.requests = 3  # its requests were counted as they ended
        sheds.call_ended(stream)
        assert caplog.records == []  # nothing per request
        await asyncio.sleep(0.35)
        sheds.call_ended(shed())
        sheds.flush()  # at stop: what the window holds so far
    first, second = caplog.records
    assert first.levelno == logging.WARNING
    assert first.getMessage().startswith("shed 120 requests in the last ")
    assert (first.sheds, first.event, first.tier) == (120, "sheds", "global")  # type: ignore[attr-defined]
    assert first.tenants == {"-": 120}  # type: ignore[attr-defined]
    assert second.sheds == 1  # type: ignore[attr-defined]
    sheds.flush()
    assert len(caplog.records) == 2  # nothing left to say
