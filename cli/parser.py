"""The ``meridian`` parser: each command its own options, with help and defaults.

Kept apart from ``cli.main`` (which runs the commands) so the options read as one
list. Every option has help text; ``HelpFormatter`` shows its default.
"""

from __future__ import annotations

import argparse
from typing import Any

from cli.options import (
    HelpFormatter,
    fraction,
    non_negative_float,
    positive_float,
    positive_int,
    version,
)
from common.observability.logs import FORMAT_ENV, FORMATS, LEVEL_ENV, LEVELS, LogSettings

DESCRIPTION = """Run one tier, a whole demo fleet, or a load generator.

  meridian up [--config deploy/demo-fleet.yaml]
  meridian global   --config topology.yaml
  meridian regional --config topology.yaml --region eu-west
  meridian local    --config topology.yaml --region eu-west --zone eu-west-1a
  meridian worker   --config topology.yaml --region eu-west --zone eu-west-1a
  meridian loadgen  --target 127.0.0.1:8001 --requests 200
  meridian top      [--ops http://127.0.0.1:8002] [--once]
  meridian admin    list | drain NAME | undrain NAME | weight GPU W | reload
  meridian usage    --redis redis://127.0.0.1:6379/0 [--since 24h]
  meridian redis-acl passwords | render | apply --config topology.yaml --dir DIR
  meridian sim      fleet --gpus 1024 --regions 6 | run [--quick]
  meridian deploy   k8s --config topology.yaml [--image IMG] [--namespace NS] [--out DIR]

Every command has its own options: meridian COMMAND --help.
"""


def _policy(text: str) -> str:
    """``--policy``: a name of local_lb.policies.POLICIES (imported only when the flag
    is given, so a global or regional process never loads the local tier)."""
    from local_lb.policies import POLICIES

    if text not in POLICIES:
        raise argparse.ArgumentTypeError(f"unknown policy {text!r}; known: {', '.join(POLICIES)}")
    return text


def _log_options(p: argparse.ArgumentParser, env: LogSettings) -> None:
    group = p.add_argument_group("logging (to stderr)")
    group.add_argument(
        "--log-format",
        choices=FORMATS,
        default=env.format,
        help=f"text lines, or one JSON object a line; also ${FORMAT_ENV}",
    )
    group.add_argument(
        "--log-level",
        choices=LEVELS,
        default=env.level,
        help=f"least severe level written; also ${LEVEL_ENV}",
    )


def _tier_options(p: argparse.ArgumentParser, where: tuple[str, ...], env: LogSettings) -> None:
    """Options of a process that runs one part of a topology."""
    p.add_argument("--config", required=True, metavar="FILE", help="topology YAML")
    if "region" in where:
        p.add_argument(
            "--region", required=True, metavar="NAME", help="the region (its name in the topology)"
        )
    if "zone" in where:
        p.add_argument("--zone", required=True, metavar="NAME", help="the zone, in --region")
    _log_options(p, env)


def _workers_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workers",
        metavar="N",
        type=positive_int,
        default=1,
        help="processes serving this tier on its one port (SO_REUSEPORT), under a "
        "supervisor that restarts one that dies; what they share: README "
        "'Several workers on one port'",
    )
    # Set by the supervisor on each worker it starts (cli.supervisor).
    p.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)


def _redis_options(p: argparse.ArgumentParser) -> None:
    """How a tier reaches Redis besides its topology: another URL, its ACL password."""
    p.add_argument("--redis", metavar="URL", help="Redis URL, overriding the topology's redis_url")
    p.add_argument(
        "--redis-password-file",
        metavar="FILE",
        help="log in to Redis as this tier's ACL user (meridian/global, "
        "meridian/regional/R, meridian/local/R/Z) with the password in FILE; also "
        "$MERIDIAN_REDIS_PASSWORD_FILE or $MERIDIAN_REDIS_PASSWORD (meridian redis-acl)",
    )


def _server_parsers(sub: Any, env: LogSettings) -> None:
    grace = {
        "metavar": "SECONDS",
        "type": non_negative_float,
        "default": 5.0,
        "help": "seconds to finish in-flight calls on SIGTERM",
    }
    for name, where, what in (
        ("global", (), "run the global tier (picks a region)"),
        ("regional", ("region",), "run one region's regional tier (picks a zone)"),
        ("local", ("region", "zone"), "run one zone's local tier (picks a GPU)"),
    ):
        p = sub.add_parser(name, help=what, description=what, formatter_class=HelpFormatter)
        _tier_options(p, where, env)
        _redis_options(p)
        if name == "global":
            p.add_argument(
                "--auth-file",
                metavar="FILE",
                help="the topology's auth section (tenants, key digests, admin keys) from a "
                "file of its own, e.g. a mounted Kubernetes Secret; it replaces the topology's",
            )
        if name == "local":
            p.add_argument(
                "--policy",
                metavar="NAME",
                type=_policy,
                default="default",
                help="GPU picking policy",
            )
            p.add_argument(
                "--ext-proc-listen",
                metavar="HOST:PORT",
                help="also serve Envoy's ext_proc as the zone's endpoint picker here "
                "(default: the zone's ext_proc.listen, if any)",
            )
        p.add_argument("--grace", **grace)
        _workers_options(p)
    what = "run one zone's emulated GPU servers"
    p = sub.add_parser("worker", help=what, description=what, formatter_class=HelpFormatter)
    _tier_options(p, ("region", "zone"), env)
    p.add_argument(
        "--time-scale",
        metavar="FACTOR",
        type=positive_float,
        default=None,
        help="emulated time factor (0.05: 20x faster; default: the topology's time_scale)",
    )
    p.add_argument(
        "--protocol",
        choices=("v2", "openai"),
        default=None,
        help="what every GPU of the zone serves: V2 gRPC, or vLLM's OpenAI HTTP API "
        "(default: as each GPU's entry says, its 'protocol'; the local tier reads the same)",
    )
    p.add_argument(
        "--tls-cert", metavar="FILE", help="certificate of the zone's GPUs whose entry says tls"
    )
    p.add_argument("--tls-key", metavar="FILE", help="its private key (with --tls-cert)")


def _up_parser(sub: Any, env: LogSettings) -> None:
    from cli.launcher import DEMO_FLEET

    what = "start a whole fleet on this machine (Redis, GPUs, every tier)"
    up = sub.add_parser("up", help=what, description=what, formatter_class=HelpFormatter)
    up.add_argument(
        "--config", metavar="FILE", default=str(DEMO_FLEET), help="fleet YAML (ports 0 = pick free)"
    )
    up.add_argument(
        "--run-dir",
        metavar="DIR",
        help="where to write the resolved topology and logs (default: a new temp dir)",
    )
    up.add_argument(
        "--redis", metavar="URL", help="use this Redis URL instead of starting an embedded one"
    )
    up.add_argument(
        "--time-scale",
        metavar="FACTOR",
        type=positive_float,
        default=None,
        help="emulated time factor of the GPUs (default: the fleet file's time_scale)",
    )
    up.add_argument(
        "--policy",
        metavar="NAME",
        type=_policy,
        default="default",
        help="GPU picking policy of every local tier",
    )
    _log_options(up, env)


def _loadgen_parser(sub: Any) -> None:
    what = "send a bounded run of requests and report latency and spread"
    load = sub.add_parser("loadgen", help=what, description=what, formatter_class=HelpFormatter)
    load.add_argument(
        "--target",
        metavar="HOST:PORT",
        default="127.0.0.1:8001",
        help="the global tier's gRPC address",
    )
    load.add_argument("--model", metavar="NAME", default="demo-llm", help="model to ask for")
    load.add_argument(
        "--api-key", metavar="KEY", help="tenant API key (sent as 'authorization: Bearer')"
    )
    load.add_argument(
        "--requests", metavar="N", type=positive_int, default=300, help="requests to send"
    )
    load.add_argument(
        "--concurrency",
        metavar="N",
        type=positive_int,
        default=16,
        help="requests in flight at once",
    )
    load.add_argument(
        "--max-tokens",
        metavar="N",
        type=positive_int,
        default=16,
        help="max_tokens of each request",
    )
    load.add_argument(
        "--stream-share",
        metavar="SHARE",
        type=fraction,
        default=0.25,
        help="fraction sent as token streams",
    )
    load.add_argument(
        "--seed", metavar="N", type=int, default=7, help="seed of cities, prompts, streams"
    )
    tls = load.add_argument_group("TLS (a global with tls.client_facing: true)")
    tls.add_argument("--tls", action="store_true", help="dial TLS, verified by the system roots")
    tls.add_argument(
        "--ca", metavar="FILE", help="dial TLS, verified against this CA certificate (PEM)"
    )
    tls.add_argument(
        "--server-name",
        metavar="NAME",
        help="name to verify the certificate for, if not --target's host",
    )


def build_parser(env: LogSettings | None = None) -> argparse.ArgumentParser:
    """The ``meridian`` parser; ``env``: the log defaults (from MERIDIAN_LOG_*)."""
    env = env or LogSettings()
    parser = argparse.ArgumentParser(
        prog="meridian", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"meridian {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _server_parsers(sub, env)
    _up_parser(sub, env)
    sub.add_parser("keygen", help="print a new API key and the SHA-256 to configure")
    # These parse their own arguments (meridian usage --help ...).
    for name, what in (
        ("usage", "sum usage records per tenant and model"),
        ("admin", "list, drain, undrain, weight, reload (Admin API)"),
        ("sim", "write a fleet topology, or simulate routing policies on it"),
        ("redis-acl", "Redis ACL users per role: passwords, ACL file, apply"),
    ):
        sub.add_parser(name, help=what, add_help=False).add_argument(
            "rest", nargs=argparse.REMAINDER
        )
    from cli.top import add_parser as add_top_parser

    add_top_parser(sub)
    _loadgen_parser(sub)
    from cli.k8s.command import add_parser as add_deploy_parser

    add_deploy_parser(sub)
    return parser
