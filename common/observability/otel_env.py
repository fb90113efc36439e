"""The standard OpenTelemetry environment variables Meridian reads itself, validated at start.

The SDK objects read most variables on their own (resource, sampler, batch
processor, each exporter's endpoint, headers, TLS and timeout). What decides
*which* objects exist is read here, once, into a ``TraceSettings``; a value
Meridian does not know fails the start with a ``ConfigError`` naming the
variable and the value, rather than being ignored:

* ``OTEL_SDK_DISABLED`` (``true``: no tracing at all);
* ``OTEL_TRACES_EXPORTER``: a comma list of ``otlp``, ``console``, ``none``.
  Unset, it is ``otlp`` when an OTLP endpoint variable is set and ``none``
  otherwise: unlike the SDK's default, a tier with no collector configured does
  not send to ``localhost:4317`` (it keeps its recent spans for ``/api/traces``,
  which it does whatever the exporters);
* ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else ``OTEL_EXPORTER_OTLP_PROTOCOL``:
  ``grpc`` (the default, port 4317) or ``http/protobuf`` (port 4318,
  ``/v1/traces``); ``http/json`` has no Python exporter and is refused;
* ``OTEL_PROPAGATORS``: a comma list of ``tracecontext``, ``baggage``, ``b3``
  (single header), ``b3multi``, ``none``; default ``tracecontext,baggage``.
* ``OTEL_TRACES_SAMPLER``: checked against the SDK's sampler names (the SDK
  itself would fall back to its default with only a log line).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.b3 import B3MultiFormat, B3SingleFormat
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from common.config.node import ConfigError

PROPAGATORS: Mapping[str, Callable[[], TextMapPropagator]] = {
    "tracecontext": TraceContextTextMapPropagator,
    "baggage": W3CBaggagePropagator,
    "b3": B3SingleFormat,
    "b3multi": B3MultiFormat,
}
EXPORTERS = ("otlp", "console")
PROTOCOLS = ("grpc", "http/protobuf")
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
DEFAULT_PROPAGATORS = ("tracecontext", "baggage")


@dataclass(frozen=True)
class TraceSettings:
    """Which tracing objects to build, from the OTel variables (see the module docstring)."""

    disabled: bool = False
    exporters: tuple[str, ...] = ()
    protocol: str = "grpc"
    propagators: tuple[str, ...] = DEFAULT_PROPAGATORS
    # OTEL_TRACES_SAMPLER as given (None: unset, Meridian's default sampler).
    sampler: str | None = None


def _names(env: Mapping[str, str], variable: str) -> tuple[str, ...] | None:
    """A comma list variable as lower-case names (None: unset or blank)."""
    raw = env.get(variable, "").strip()
    if not raw:
        return None
    return tuple(part.strip().lower() for part in raw.split(","))


def _known(variable: str, names: tuple[str, ...], known: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` less ``none``, each checked against ``known``; ``none`` stands alone."""
    for name in names:
        if name not in known and name != "none":
            raise ConfigError(
                f"{variable}: unknown value {name!r}; known: {', '.join((*known, 'none'))}"
            )
    if "none" in names and len(names) > 1:
        raise ConfigError(f"{variable}: 'none' cannot be combined with {', '.join(names)}")
    return tuple(dict.fromkeys(n for n in names if n != "none"))


def _protocol(env: Mapping[str, str]) -> str:
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = env.get(variable, "").strip().lower()
        if not value:
            continue
        if value not in PROTOCOLS:
            raise ConfigError(
                f"{variable}: unsupported protocol {value!r}; supported: {', '.join(PROTOCOLS)}"
            )
        return value
    return "grpc"


def trace_settings(env: Mapping[str, str]) -> TraceSettings:
    """The settings ``env`` asks for; ConfigError naming the variable for a value not known."""
    disabled = env.get("OTEL_SDK_DISABLED", "").strip().lower()
    if disabled not in ("", "true", "false"):
        raise ConfigError(f"OTEL_SDK_DISABLED: expected true or false, got {disabled!r}")
    if disabled == "true":
        return TraceSettings(disabled=True, propagators=())
    exporters = _names(env, "OTEL_TRACES_EXPORTER")
    if exporters is None:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        exporters = ("otlp",) if endpoint else ()
    propagators = _names(env, "OTEL_PROPAGATORS") or DEFAULT_PROPAGATORS
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or None
    if sampler is not None and sampler not in SAMPLERS:
        raise ConfigError(
            f"OTEL_TRACES_SAMPLER: unknown sampler {sampler!r}; known: {', '.join(SAMPLERS)}"
        )
    return TraceSettings(
        exporters=_known("OTEL_TRACES_EXPORTER", exporters, EXPORTERS),
        protocol=_protocol(env),
        propagators=_known("OTEL_PROPAGATORS", propagators, tuple(PROPAGATORS)),
        sampler=sampler,
    )


def build_propagator(names: tuple[str, ...]) -> CompositePropagator:
    """One propagator running ``names`` in order (none: extracts and injects nothing)."""
    return CompositePropagator([PROPAGATORS[name]() for name in names])
