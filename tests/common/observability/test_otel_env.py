"""The OTel variables that choose tracing objects: defaults, lists, errors naming the variable."""

from __future__ import annotations

import pytest

from common.config.node import ConfigError
from common.observability.otel_env import TraceSettings, build_propagator, trace_settings


def test_nothing_set_keeps_spans_in_memory_with_w3c_propagation() -> None:
    assert trace_settings({}) == TraceSettings(
        exporters=(), protocol="grpc", propagators=("tracecontext", "baggage")
    )


def test_an_endpoint_alone_means_otlp_over_grpc() -> None:
    for variable in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        settings = trace_settings({variable: "http://collector:4317"})
        assert (settings.exporters, settings.protocol) == (("otlp",), "grpc")


def test_exporters_are_a_comma_list_without_repeats() -> None:
    settings = trace_settings({"OTEL_TRACES_EXPORTER": " otlp , Console,otlp"})
    assert settings.exporters == ("otlp", "console")


def test_none_exports_nothing_even_with_an_endpoint() -> None:
    env = {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}
    assert trace_settings(env).exporters == ()


def test_the_traces_protocol_comes_before_the_general_one() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
    }
    assert trace_settings(env).protocol == "http/protobuf"
    assert trace_settings({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}).protocol == (
        "http/protobuf"
    )


def test_propagators_in_the_order_given() -> None:
    settings = trace_settings({"OTEL_PROPAGATORS": "b3multi,tracecontext"})
    assert settings.propagators == ("b3multi", "tracecontext")
    assert trace_settings({"OTEL_PROPAGATORS": "none"}).propagators == ()


def test_sdk_disabled_builds_nothing() -> None:
    settings = trace_settings({"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "console"})
    assert settings.disabled and settings.exporters == ()


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("OTEL_TRACES_EXPORTER", "otlp,zipkin", "OTEL_TRACES_EXPORTER: unknown value 'zipkin'"),
        ("OTEL_TRACES_EXPORTER", "none,console", "OTEL_TRACES_EXPORTER: 'none' cannot be"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json", "OTEL_EXPORTER_OTLP_PROTOCOL: unsupported"),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "udp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: uns"),
        ("OTEL_PROPAGATORS", "tracecontext,jaeger", "OTEL_PROPAGATORS: unknown value 'jaeger'"),
        ("OTEL_TRACES_SAMPLER", "sometimes", "OTEL_TRACES_SAMPLER: unknown sampler 'sometimes'"),
        ("OTEL_SDK_DISABLED", "yes", "OTEL_SDK_DISABLED: expected true or false, got 'yes'"),
    ],
)
def test_an_unknown_value_names_the_variable_and_the_value(
    variable: str, value: str, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        trace_settings({variable: value})
    assert str(caught.value).startswith(message)


def test_the_propagator_carries_the_fields_of_each_name() -> None:
    assert build_propagator(("tracecontext", "baggage")).fields == {
        "traceparent",
        "tracestate",
        "baggage",
    }
    assert build_propagator(("b3",)).fields == {"b3"}
    assert "x-b3-traceid" in build_propagator(("b3multi",)).fields
    assert build_propagator(()).fields == set()
