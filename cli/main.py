"""The ``meridian`` command: run one tier, a whole demo fleet, or a load generator.

meridian up [--config deploy/demo-fleet.yaml]
meridian global   --config topology.yaml
meridian regional --config topology.yaml --region eu-west
meridian local    --config topology.yaml --region eu-west --zone eu-west-1a
meridian worker   --config topology.yaml --region eu-west --zone eu-west-1a
meridian loadgen  --target 127.0.0.1:8001 --requests 200
meridian top      [--ops http://127.0.0.1:8002] [--once]
meridian admin    list | drain NAME | undrain NAME | weight GPU W | reload
meridian sim      fleet --gpus 1024 --regions 6 | run [--quick] (see meridian sim --help)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from common.config.node import ConfigError
from common.config.topology import Topology, load_topology


def _topology(args: argparse.Namespace) -> Topology:
    topology = load_topology(args.config)
    if args.redis:
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

            tier = build_regional_tier(topology, _need(args, "region"), reload_from=source)
        else:
            from local_lb.server import build_local_tier

            tier = build_local_tier(
                topology,
                _need(args, "region"),
                _need(args, "zone"),
                policy=args.policy,
                reload_from=source,
            )
        await tier.serve_until(stop, grace=args.grace)

    asyncio.run(_until_signalled(run))


def _run_worker(args: argparse.Namespace) -> None:
    from common.config.tls import gpu_server_credentials
    from sim.worker import run_zone_workers

    topology = _topology(args)
    zone = topology.zone(_need(args, "region"), _need(args, "zone"))
    time_scale = args.time_scale if args.time_scale is not None else topology.time_scale
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    credentials = gpu_server_credentials(
        topology, args.region, zone, cert_file=args.tls_cert, key_file=args.tls_key
    )

    async def run(stop: asyncio.Event) -> None:
        await run_zone_workers(zone, args.region, time_scale, stop, credentials)

    asyncio.run(_until_signalled(run))


def _need(args: argparse.Namespace, name: str) -> str:
    value = getattr(args, name)
    if not value:
        raise ConfigError(f"--{name} is required for 'meridian {args.command}'")
    return str(value)


def _run_up(args: argparse.Namespace) -> None:
    from cli.launcher import Fleet
    from local_lb.policies import POLICIES

    if args.policy not in POLICIES:
        raise ConfigError(f"--policy: unknown policy {args.policy!r}; known: {sorted(POLICIES)}")
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


def _run_loadgen(args: argparse.Namespace) -> None:
    from cli.loadgen import run_loadgen

    asyncio.run(
        run_loadgen(
            args.target,
            model=args.model,
            requests=args.requests,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            stream_share=args.stream_share,
            api_key=args.api_key,
        )
    )


def _run_keygen(args: argparse.Namespace) -> None:
    from common.tenancy.auth import new_key

    key, digest = new_key()
    print(f"key     {key}")
    print(f"sha256  {digest}")
    print("give the key to the tenant; put the sha256 in auth.tenants[].api_key_sha256")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meridian", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("global", "regional", "local", "worker"):
        p = sub.add_parser(name, help=f"run one {name} process")
        p.add_argument("--config", required=True, help="topology YAML")
        p.add_argument("--region")
        p.add_argument("--zone")
        p.add_argument("--redis", help="Redis URL, overriding the topology's redis_url")
        p.add_argument("--policy", default="default", help="(local) GPU picking policy")
        p.add_argument("--grace", type=float, default=5.0, help="seconds to finish in-flight work")
        p.add_argument(
            "--time-scale", type=float, default=None, help="(worker) emulated time factor"
        )
        p.add_argument("--tls-cert", help="(worker) certificate of the GPUs whose entry says tls")
        p.add_argument("--tls-key", help="(worker) its private key")
    up = sub.add_parser("up", help="start the demo fleet on this machine")
    from cli.launcher import DEMO_FLEET

    up.add_argument("--config", default=str(DEMO_FLEET), help="fleet YAML (ports 0 = pick free)")
    up.add_argument("--run-dir", help="where to write the resolved topology and logs")
    up.add_argument("--redis", help="use this Redis instead of starting an embedded one")
    up.add_argument("--time-scale", type=float, default=None)
    up.add_argument("--policy", default="default", help="GPU picking policy of every local tier")
    sub.add_parser("keygen", help="print a new API key and the SHA-256 to configure")
    usage = sub.add_parser("usage", help="sum usage records per tenant and model", add_help=False)
    usage.add_argument("rest", nargs=argparse.REMAINDER)
    admin = sub.add_parser("admin", help="list, drain, weight, reload (Admin API)", add_help=False)
    admin.add_argument("rest", nargs=argparse.REMAINDER)
    simulate = sub.add_parser(
        "sim", help="write a fleet topology, or simulate routing policies on it", add_help=False
    )
    simulate.add_argument("rest", nargs=argparse.REMAINDER)
    from cli.top import add_parser as add_top_parser

    add_top_parser(sub)
    load = sub.add_parser("loadgen", help="send a bounded run of requests and report")
    load.add_argument("--target", default="127.0.0.1:8001")
    load.add_argument("--model", default="demo-llm")
    load.add_argument("--api-key", help="tenant API key (sent as 'authorization: Bearer')")
    load.add_argument("--requests", type=int, default=300)
    load.add_argument("--concurrency", type=int, default=16)
    load.add_argument("--max-tokens", type=int, default=16)
    load.add_argument(
        "--stream-share",
        type=float,
        default=0.25,
        help="fraction of requests sent as token streams",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    from cli.launcher import die_with_parent

    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    # These parse their own arguments; argparse's REMAINDER would refuse leading options.
    if argv[:1] == ["usage"]:
        from cli.usage import usage_main

        raise SystemExit(usage_main(argv[1:]))
    if argv[:1] == ["admin"]:
        from cli.admin import admin_main

        raise SystemExit(admin_main(argv[1:]))
    if argv[:1] == ["sim"]:
        from cli.sim import sim_main

        raise SystemExit(sim_main(argv[1:]))
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command in ("global", "regional", "local"):
            _run_tier(args)
        elif args.command == "worker":
            _run_worker(args)
        elif args.command == "up":
            _run_up(args)
        elif args.command == "loadgen":
            _run_loadgen(args)
        elif args.command == "keygen":
            _run_keygen(args)
        elif args.command == "top":
            from cli.top import top_main

            raise SystemExit(top_main(args))
        elif args.command == "usage":
            from cli.usage import usage_main

            raise SystemExit(usage_main(args.rest))
    except ConfigError as exc:
        print(f"meridian: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
