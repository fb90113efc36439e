"""The ``meridian`` command: run one tier, a whole demo fleet, or a load generator.

  meridian up [--config deploy/demo-fleet.yaml]
  meridian global   --config topology.yaml
  meridian regional --config topology.yaml --region eu-west
  meridian local    --config topology.yaml --region eu-west --zone eu-west-1a
  meridian worker   --config topology.yaml --region eu-west --zone eu-west-1a
  meridian loadgen  --target 127.0.0.1:8001 --requests 200
  meridian top      [--ops http://127.0.0.1:8002] [--once]
  meridian admin    list | drain NAME | undrain NAME | weight GPU W | reload
  meridian usage    --redis redis://127.0.0.1:6379/0 [--since 24h]
  meridian sim      fleet --gpus 1024 --regions 6 | run [--quick]

Every command has its own options: meridian COMMAND --help.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from cli.options import (
    HelpFormatter,
    fraction,
    non_negative_float,
    positive_float,
    positive_int,
    version,
)
from common.config.node import ConfigError
from common.config.topology import Topology, load_topology
from common.observability.logs import (
    FORMAT_ENV,
    FORMATS,
    LEVEL_ENV,
    LEVELS,
    LogSettings,
    configure_logging,
)


def _topology(args: argparse.Namespace) -> Topology:
    topology = load_topology(args.config)
    if getattr(args, "redis", None):  # a worker has no --redis
        topology = dataclasses.replace(topology, redis_url=args.redis)
    return topology


async def _until_signalled(run: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await run(stop)


def _run_tier(args: argparse.Namespace) -> None:
    topology = _topology(args)

    def source() -> Topology:  # the Admin API's ReloadTopology re-reads the same file
        return _topology(args)

    async def run(stop: asyncio.Event) -> None:
        # Imported here: each tier process loads only its own package.
        if args.command == "global":
            from global_lb.server import build_global_tier

            tier = build_global_tier(topology, reload_from=source)
        elif args.command == "regional":
            from regional_lb.server import build_regional_tier

            tier = build_regional_tier(topology, args.region, reload_from=source)
        else:
            from local_lb.server import build_local_tier

            tier = build_local_tier(
                topology,
                args.region,
                args.zone,
                policy=args.policy,
                reload_from=source,
            )
        await tier.serve_until(stop, grace=args.grace)

    asyncio.run(_until_signalled(run))


def _run_worker(args: argparse.Namespace) -> None:
    from common.config.tls import gpu_server_credentials
    from sim.worker import run_zone_workers

    topology = _topology(args)
    zone = topology.zone(args.region, args.zone)
    time_scale = args.time_scale if args.time_scale is not None else topology.time_scale
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    credentials = gpu_server_credentials(
        topology, args.region, zone, cert_file=args.tls_cert, key_file=args.tls_key
    )

    async def run(stop: asyncio.Event) -> None:
        await run_zone_workers(zone, args.region, time_scale, stop, credentials)

    asyncio.run(_until_signalled(run))


def _run_up(args: argparse.Namespace) -> None:
    from cli.launcher import Fleet

    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="meridian-up-"))
    overrides = {"time_scale": args.time_scale} if args.time_scale is not None else {}
    fleet = Fleet(
        args.config, run_dir, overrides=overrides, redis_url=args.redis, policy=args.policy
    )
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"starting {len(fleet.processes)} processes; logs in {run_dir}", flush=True)
    fleet.start()
    try:
        topo = fleet.topology
        kept = f"  (append-only file in {fleet.redis.data_dir})" if fleet.redis else ""
        print(f"redis      {topo.redis_url}{kept}")
        for region in topo.regions:
            print(f"region     {region.name:<14} regional tier {region.endpoint}")
            for zone in region.zones:
                gpus = ", ".join(f"{g.name.rsplit('-', 1)[-1]}:{g.hardware}" for g in zone.gpus)
                print(f"  zone     {zone.name:<14} local tier {zone.endpoint}  gpus {gpus}")
        print(f"policy     {args.policy} (every local tier)")
        if topo.tls is not None:
            print(f"mtls       between tiers, one identity each; certificates {topo.tls.certs}")
        for tenant_id, key in fleet.tenant_keys.items():
            print(f"tenant {tenant_id} key {key}")
        if fleet.admin_key is not None:
            print(f"admin key {fleet.admin_key}")
        print(f"global     listening {fleet.global_address}  (KServe V2 gRPC, model demo-llm)")
        if topo.global_tier.ops is not None:
            print(f"dashboard  http://{topo.global_tier.ops}/  (also /metrics /readyz /api/*)")
        print("ready; Ctrl-C stops everything", flush=True)
        while not stop:
            for line in fleet.watch.poll():  # once per death, once per return
                if not stop:  # Ctrl-C reaches the children too: their exits are no news
                    print(line, flush=True)
            time.sleep(0.5)
    finally:
        print("stopping fleet", flush=True)
        fleet.stop()


def _run_loadgen(args: argparse.Namespace) -> int:
    from cli.loadgen import LoadTls, run_loadgen

    tls = LoadTls(ca=args.ca, server_name=args.server_name) if args.tls or args.ca else None
    report = asyncio.run(
        run_loadgen(
            args.target,
            model=args.model,
            requests=args.requests,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            stream_share=args.stream_share,
            api_key=args.api_key,
            seed=args.seed,
            tls=tls,
        )
    )
    if report.failed:
        print(
            f"meridian loadgen: {report.failed} of {report.total} requests failed", file=sys.stderr
        )
        return 1
    return 0


def _run_keygen(args: argparse.Namespace) -> None:
    from common.tenancy.auth import new_key

    key, digest = new_key()
    print(f"key     {key}")
    print(f"sha256  {digest}")
    print("give the key to the tenant; put the sha256 in auth.tenants[].api_key_sha256")


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


def _server_parsers(sub: Any, env: LogSettings) -> None:
    grace = {
        "metavar": "SECONDS",
        "type": non_negative_float,
        "default": 5.0,
        "help": "seconds to finish in-flight calls on SIGTERM",
    }
    redis = {"metavar": "URL", "help": "Redis URL, overriding the topology's redis_url"}
    for name, where, what in (
        ("global", (), "run the global tier (picks a region)"),
        ("regional", ("region",), "run one region's regional tier (picks a zone)"),
        ("local", ("region", "zone"), "run one zone's local tier (picks a GPU)"),
    ):
        p = sub.add_parser(name, help=what, description=what, formatter_class=HelpFormatter)
        _tier_options(p, where, env)
        p.add_argument("--redis", **redis)
        if name == "local":
            p.add_argument(
                "--policy",
                metavar="NAME",
                type=_policy,
                default="default",
                help="GPU picking policy",
            )
        p.add_argument("--grace", **grace)
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
        prog="meridian", description=__doc__, formatter_class=HelpFormatter
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
    ):
        sub.add_parser(name, help=what, add_help=False).add_argument(
            "rest", nargs=argparse.REMAINDER
        )
    from cli.top import add_parser as add_top_parser

    add_top_parser(sub)
    _loadgen_parser(sub)
    return parser


def _dispatch(args: argparse.Namespace) -> int:
    if args.command in ("global", "regional", "local"):
        _run_tier(args)
    elif args.command == "worker":
        _run_worker(args)
    elif args.command == "up":
        _run_up(args)
    elif args.command == "loadgen":
        return _run_loadgen(args)
    elif args.command == "keygen":
        _run_keygen(args)
    elif args.command == "top":
        from cli.top import top_main

        return top_main(args)
    return 0


def main(argv: list[str] | None = None) -> None:
    from cli.launcher import die_with_parent

    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    # These parse their own arguments; argparse's REMAINDER would refuse leading options.
    own = {
        "usage": "cli.usage:usage_main",
        "admin": "cli.admin:admin_main",
        "sim": "cli.sim:sim_main",
    }
    if argv[:1] and argv[0] in own:
        module, _, function = own[argv[0]].partition(":")
        raise SystemExit(getattr(importlib.import_module(module), function)(argv[1:]))
    try:
        env = LogSettings.from_env(os.environ)
    except ValueError as exc:
        print(f"meridian: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    args = build_parser(env).parse_args(argv)
    if hasattr(args, "log_format"):
        settings = LogSettings(args.log_format, args.log_level)
        if args.command == "up":  # the fleet's processes inherit them
            os.environ.update({FORMAT_ENV: settings.format, LEVEL_ENV: settings.level})
    else:
        settings = LogSettings(env.format, "warning")  # clients: their output is the report
    configure_logging(settings)
    try:
        code = _dispatch(args)
    except ConfigError as exc:
        print(f"meridian: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    raise SystemExit(code)


if __name__ == "__main__":
    main()
