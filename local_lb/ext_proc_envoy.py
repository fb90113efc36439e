"""An Envoy bootstrap that puts a zone's endpoint picker in front of its GPUs.

Envoy listens for callers, asks the picker (ext_proc, ``local_lb.ext_proc``)
where each request goes, and carries it there itself. Two shapes of GPU cluster:

* ``override_host`` (the default, and what the Gateway API Inference Extension
  recommends): a cluster that lists the zone's GPUs, with Envoy's
  ``envoy.load_balancing_policies.override_host`` policy reading the picker's
  answer (metadata ``envoy.lb`` / ``x-gateway-destination-endpoint``, then the
  header). It walks the comma-separated list on retries, so a GPU that refuses
  the connection is replaced by the next one at once, and writes the endpoint
  that served into ``x-gateway-destination-endpoint-served`` for the picker;
* ``original_dst``: an ORIGINAL_DST cluster reading the destination header
  (``use_http_header``), for GPUs Envoy is not told about. Envoy 1.40 reads
  exactly one ``ip:port`` from that header (a list is no address: the request
  fails with "no healthy upstream"), so the zone's picker must answer with
  ``ext_proc.fallbacks: 0``; the route reports the served endpoint as a response
  header (``%UPSTREAM_REMOTE_ADDRESS%``).

``deploy/envoy/`` holds both, and the override_host one for GPUs that speak OpenAI
HTTP (``openai_gpus``: vLLM's API, carried over HTTP/1.1; an SSE stream's tokens never
reach the picker), rendered for the example addresses there; the
end-to-end tests and ``bench/extproc.py`` render them for their own ports.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from common.config.node import Endpoint
from local_lb.ext_proc_reply import DESTINATION, LB_NAMESPACE, SERVED, SUBSET, SUBSET_NAMESPACE

HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
OVERRIDE_HOST = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
)
ROUND_ROBIN = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
)
SET_METADATA = "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config"
# A request body Envoy holds for the picker (BUFFERED): the tiers' 4 MiB message limit
# plus headroom; beyond it Envoy answers 413 itself.
BUFFER_LIMIT_BYTES = 4 * 1024 * 1024 + 64 * 1024
# Envoy waits this long for each picker answer; ext_proc.max_wait_s stays below it.
MESSAGE_TIMEOUT = "10s"


def _address(endpoint: Endpoint) -> dict[str, Any]:
    return {"socket_address": {"address": endpoint.host, "port_value": endpoint.port}}


def _upstream_http(http1: bool = False) -> dict[str, Any]:
    """HTTP/2 (gRPC) to an upstream, or HTTP/1.1 (``http1``: an OpenAI HTTP server such
    as vLLM's, which speaks nothing else)."""
    options: dict[str, Any] = (
        {"http_protocol_options": {}} if http1 else {"http2_protocol_options": {}}
    )
    return {
        HTTP_OPTIONS: {
            "@type": f"type.googleapis.com/{HTTP_OPTIONS}",
            "explicit_http_config": options,
        }
    }


def _ext_proc_filter(openai_gpus: bool) -> dict[str, Any]:
    """Only the phases the picker needs: the request headers (hints) and whole body (the
    model and prompt), the response headers (status, the endpoint that served) and, from
    gRPC GPUs, the response trailers (the call's status); never a response body. An
    OpenAI GPU's HTTP/1.1 response has no trailers: its end is the stream's close."""
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": EXT_PROC,
            "grpc_service": {"envoy_grpc": {"cluster_name": "meridian_picker"}},
            "message_timeout": MESSAGE_TIMEOUT,
            "status_on_error": {"code": 503},  # the picker unreachable: no GPU can be named
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "BUFFERED",
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SEND",
                "response_body_mode": "NONE",
                "response_trailer_mode": "SKIP" if openai_gpus else "SEND",
            },
            "metadata_options": {
                "forwarding_namespaces": {"untyped": [LB_NAMESPACE, SUBSET_NAMESPACE]}
            },
        },
    }


def _subset_filter(subset: Sequence[Endpoint]) -> dict[str, Any]:
    """Sets the subset hint, as a data plane that knows the allowed endpoints would."""
    hint = {SUBSET: [e.address for e in subset]}
    return {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": SET_METADATA,
            "metadata": [{"metadata_namespace": SUBSET_NAMESPACE, "value": hint}],
        },
    }


def _listener(
    listen: Endpoint, retries: int, original_dst: bool, subset: Any, openai_gpus: bool
) -> dict[str, Any]:
    route: dict[str, Any] = {
        "cluster": "gpus",
        "timeout": "0s",  # generation may be long; the caller's deadline bounds it
        "retry_policy": {
            "retry_on": "connect-failure,refused-stream,reset,unavailable",
            "num_retries": retries,
        },
    }
    routes: dict[str, Any] = {"match": {"prefix": "/"}, "route": route}
    if original_dst:
        served = {"key": SERVED, "value": "%UPSTREAM_REMOTE_ADDRESS%"}
        routes["response_headers_to_add"] = [{"header": served}]
    filters = [*([_subset_filter(subset)] if subset else []), _ext_proc_filter(openai_gpus)]
    filters.append(
        {
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
            },
        }
    )
    manager = {
        "@type": f"{HCM}.HttpConnectionManager",
        "stat_prefix": "meridian",
        "codec_type": "AUTO",
        "route_config": {"virtual_hosts": [{"name": "zone", "domains": ["*"], "routes": [routes]}]},
        "http_filters": filters,
    }
    return {
        "name": "callers",
        "address": _address(listen),
        "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }


def _gpu_cluster(gpus: Sequence[Endpoint], original_dst: bool, openai: bool) -> dict[str, Any]:
    cluster: dict[str, Any] = {"name": "gpus", "connect_timeout": "0.5s"}
    cluster["typed_extension_protocol_options"] = _upstream_http(http1=openai)
    if original_dst:
        cluster.update(
            type="ORIGINAL_DST",
            lb_policy="CLUSTER_PROVIDED",
            original_dst_lb_config={"use_http_header": True, "http_header_name": DESTINATION},
        )
        return cluster
    key = {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}
    policy = {
        "@type": OVERRIDE_HOST,
        "override_host_sources": [{"metadata": key}, {"header": DESTINATION}],
        "selected_host_key": {"key": LB_NAMESPACE, "path": [{"key": SERVED}]},
        "fallback_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.round_robin",
                        "typed_config": {"@type": ROUND_ROBIN},
                    }
                }
            ]
        },
    }
    endpoints = [{"endpoint": {"address": _address(g)}} for g in gpus]
    cluster.update(
        type="STATIC",
        load_balancing_policy={
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": policy,
                    }
                }
            ]
        },
        load_assignment={"cluster_name": "gpus", "endpoints": [{"lb_endpoints": endpoints}]},
    )
    return cluster


def envoy_bootstrap(
    *,
    listen: Endpoint,
    picker: Endpoint,
    admin: Endpoint,
    gpus: Sequence[Endpoint] = (),
    original_dst: bool = False,
    retries: int = 2,
    subset: Sequence[Endpoint] = (),
    openai_gpus: bool = False,
) -> dict[str, Any]:
    """The bootstrap: callers on ``listen``, the picker at ``picker``, the GPUs (listed
    for ``override_host``; found from the header with ``original_dst``), admin on
    ``admin`` (keep it on loopback: it can stop Envoy). ``subset`` makes Envoy send
    that subset hint with every request. ``openai_gpus``: the GPUs speak OpenAI HTTP
    (vLLM, SGLang), which Envoy carries to them over HTTP/1.1; else V2 gRPC (HTTP/2)."""
    picker_cluster = {
        "name": "meridian_picker",
        "type": "STATIC",
        "connect_timeout": "0.25s",
        "typed_extension_protocol_options": _upstream_http(),
        "load_assignment": {
            "cluster_name": "meridian_picker",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(picker)}}]}],
        },
    }
    return {
        "admin": {"address": _address(admin)},
        "static_resources": {
            "listeners": [_listener(listen, retries, original_dst, subset, openai_gpus)],
            "clusters": [picker_cluster, _gpu_cluster(gpus, original_dst, openai_gpus)],
        },
    }


def render(bootstrap: dict[str, Any]) -> str:
    return yaml.safe_dump(bootstrap, sort_keys=False)


# The examples in deploy/envoy: Envoy and the picker on one host, two GPUs.
EXAMPLE_GPUS = (Endpoint("10.0.0.11", 8001), Endpoint("10.0.0.12", 8001))
EXAMPLE_HEADER = """\
# Envoy in front of one Meridian zone, its local tier as the endpoint picker ({shape}).
# Rendered by `python -m local_lb.ext_proc_envoy` (local_lb/ext_proc_envoy.py says why
# each part is there); run: envoy -c {name} --disable-hot-restart
# The zone's topology entry needs `ext_proc: {{listen: 127.0.0.1:9002{fallbacks}}}`.
"""


def example(original_dst: bool, *, openai: bool = False) -> str:
    """The text of ``deploy/envoy/envoy.yaml`` (``envoy-original-dst.yaml``, or with
    ``openai`` ``envoy-openai.yaml``: GPUs that speak OpenAI HTTP, as vLLM's do)."""
    bootstrap = envoy_bootstrap(
        listen=Endpoint("0.0.0.0", 8080),
        picker=Endpoint("127.0.0.1", 9002),
        admin=Endpoint("127.0.0.1", 9901),
        gpus=() if original_dst else EXAMPLE_GPUS,
        original_dst=original_dst,
        retries=1 if original_dst else 2,
        openai_gpus=openai,
    )
    shape = "ORIGINAL_DST cluster, one endpoint" if original_dst else "override_host, fallbacks"
    header = EXAMPLE_HEADER.format(
        shape=shape + (", OpenAI HTTP GPUs over HTTP/1.1" if openai else ""),
        name=example_name(original_dst, openai=openai),
        fallbacks=", fallbacks: 0" if original_dst else "",
    )
    return header + render(bootstrap)


def example_name(original_dst: bool, *, openai: bool = False) -> str:
    if openai:
        return "envoy-openai-original-dst.yaml" if original_dst else "envoy-openai.yaml"
    return "envoy-original-dst.yaml" if original_dst else "envoy.yaml"


# The examples written: (original_dst, openai).
EXAMPLES = ((False, False), (True, False), (False, True))


DEPLOY_DIR = Path(__file__).resolve().parent.parent / "deploy" / "envoy"


def main(argv: Sequence[str] | None = None) -> None:
    """Write the example bootstraps (``--help`` says so, and writes nothing)."""
    parser = argparse.ArgumentParser(
        prog="python -m local_lb.ext_proc_envoy",
        description="Write the example Envoy bootstraps (override_host and ORIGINAL_DST "
        "clusters of V2 GPUs, override_host of OpenAI HTTP GPUs) that put a zone's "
        "endpoint picker in front of its GPUs.",
    )
    parser.add_argument(
        "--out", type=Path, default=DEPLOY_DIR, help="directory to write (default: deploy/envoy)"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for original_dst, openai in EXAMPLES:
        text = example(original_dst, openai=openai)
        (args.out / example_name(original_dst, openai=openai)).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
