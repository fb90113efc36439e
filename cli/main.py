"""The ``meridian`` command: run one tier, a whole demo fleet, a load generator, the
operator's tools. Its options are in ``cli.parser`` (``meridian COMMAND --help``);
``usage``, ``admin`` and ``sim`` parse their own."""

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

from cli.parser import build_parser
from cli.workers import WorkerPlace, worker_addresses, worker_topology
from common.config.ext_proc import ExtProcConfig
from common.config.node import ConfigError, parse_endpoint
from common.config.topology import Topology, ZoneConfig, load_topology
from common.observability.logs import FORMAT_ENV, LEVEL_ENV, LogSettings, configure_logging


def _topology(args: argparse.Namespace) -> Topology:
    if getattr(args, "auth_file", None):  # meridian global only
        from cli.auth_file import load_with_auth

        topology = load_with_auth(args.config, args.auth_file)
    else:
        topology = load_topology(args.config)
    if getattr(args, "redis", None):  # a worker has no --redis
        topology = dataclasses.replace(topology, redis_url=args.redis)
    if args.command in ("global", "regional", "local"):
        topology = _redis_login(topology, args)
    if getattr(args, "ext_proc_listen", None):  # meridian local only
        topology = _with_ext_proc(topology, args)
    place = _place(args)
    if place.shared:  # as this worker binds it (cli.workers)
        topology = worker_topology(topology, args.command, place, *_where(args))
    return topology


def _redis_login(topology: Topology, args: argparse.Namespace) -> Topology:
    """Every Redis URL of ``topology`` logging in as this tier's ACL user, when a
    password is given (``common.operations.redis_login``), over TLS with the fleet's CA."""
    from common.config.identity import GLOBAL, local, regional
    from common.operations.redis_acl import user_name
    from common.operations.redis_login import read_password, tier_login, with_login

    region, zone = _where(args)
    identity = {
        "global": GLOBAL,
        "regional": regional(region),
        "local": local(region, zone),
    }[args.command]
    password = read_password(args.redis_password_file, os.environ)
    return with_login(topology, tier_login(topology, user_name(identity), password, identity))


def _place(args: argparse.Namespace) -> WorkerPlace:
    """Which worker this process is: 0 of 1 unless the supervisor started it."""
    index = getattr(args, "worker_index", None)
    return WorkerPlace() if index is None else WorkerPlace(index, args.workers)


def _where(args: argparse.Namespace) -> tuple[str, str]:
    return getattr(args, "region", ""), getattr(args, "zone", "")


def _supervise(args: argparse.Namespace, argv: list[str]) -> int:
    """``--workers N`` (N > 1): check the topology and every address the workers will
    bind, then start and watch them (cli.supervisor)."""
    from cli.supervisor import Supervisor, check_free

    check_free(worker_addresses(_topology(args), args.command, args.workers, *_where(args)))
    what = " ".join(n for n in (args.command, "tier", *_where(args)) if n)
    return Supervisor(argv, args.workers, args.grace, what).run()


async def _until_signalled(run: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await run(stop)


def _run_tier(args: argparse.Namespace) -> None:
    topology, place = _topology(args), _place(args)

    def source() -> Topology:  # the Admin API's ReloadTopology re-reads the same file
        return _topology(args)

    async def run(stop: asyncio.Event) -> None:
        # Imported here: each tier process loads only its own package.
        if args.command == "global":
            from global_lb.server import build_global_tier

            tier = build_global_tier(topology, reload_from=source, replicas=place.count)
        elif args.command == "regional":
            from regional_lb.server import build_regional_tier

            tier = build_regional_tier(
                topology, args.region, reload_from=source, publish=place.index == 0,
                replicas=place.count,
            )  # fmt: skip
        else:
            from local_lb.server import build_local_tier

            tier = build_local_tier(
                topology,
                args.region,
                args.zone,
                policy=args.policy,
                reload_from=source,
                replicas=place.count,
            )
        if tier.admin is not None:  # its changes would reach one worker: refused
            tier.admin.workers = place.count
        await tier.serve_until(stop, grace=args.grace)

    asyncio.run(_until_signalled(run))


def _with_ext_proc(topology: Topology, args: argparse.Namespace) -> Topology:
    """``--ext-proc-listen`` over the zone's ``ext_proc`` section (its other keys kept)."""
    listen = parse_endpoint(args.ext_proc_listen, "--ext-proc-listen")

    def zone(z: ZoneConfig) -> ZoneConfig:
        config = dataclasses.replace(z.ext_proc, listen=listen) if z.ext_proc else None
        return dataclasses.replace(z, ext_proc=config or ExtProcConfig(listen))

    regions = tuple(
        dataclasses.replace(r, zones=tuple(zone(z) if z.name == args.zone else z for z in r.zones))
        if r.name == args.region
        else r
        for r in topology.regions
    )
    return dataclasses.replace(topology, regions=regions)


def _run_worker(args: argparse.Namespace) -> None:
    from common.config.tls import gpu_server_credentials
    from sim.worker import run_zone_workers

    topology = _topology(args)
    zone = topology.zone(args.region, args.zone)
    if args.protocol is not None:
        gpus = tuple(dataclasses.replace(g, protocol=args.protocol) for g in zone.gpus)
        zone = dataclasses.replace(zone, gpus=gpus)
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
        if fleet.acl is not None:
            where = fleet.acl.directory
            print(f"redis acl  a user per role, passwords in {where} (anyone may read, not write)")
        _print_inner_tiers(topo)
        print(f"policy     {args.policy} (every local tier)")
        if topo.tls is not None:
            print(f"mtls       between tiers, one identity each; certificates {topo.tls.certs}")
        for tenant_id, key in fleet.tenant_keys.items():
            print(f"tenant {tenant_id} key {key}")
        if fleet.admin_key is not None:
            print(f"admin key {fleet.admin_key}")
        print(f"global     listening {fleet.global_address}  (KServe V2 gRPC, model demo-llm)")
        if topo.global_tier.openai is not None:
            url = topo.global_tier.openai.base_url
            print(f"openai     {url}  (OpenAI-compatible HTTP: completions, chat, models)")
        if fleet.operator_key is not None:
            print(f"operator key {fleet.operator_key}  (the ops HTTP's /api/*: Bearer)")
        if topo.global_tier.ops is not None:
            # The link hands the dashboard its operator key (kept in the tab, never sent
            # in a URL: the fragment stays in the browser).
            link = "" if fleet.operator_key is None else f"#operator-key={fleet.operator_key}"
            print(
                f"dashboard  http://{topo.global_tier.ops}/{link}  "
                "(also /metrics /readyz /api/*)"
            )
        print("ready; Ctrl-C stops everything", flush=True)
        while not stop:
            for line in fleet.watch.poll():  # once per death, once per return
                if not stop:  # Ctrl-C reaches the children too: their exits are no news
                    print(line, flush=True)
            time.sleep(0.5)
    finally:
        print("stopping fleet", flush=True)
        fleet.stop()


def _print_inner_tiers(topo: Topology) -> None:
    """Each region's and zone's tier as ``meridian up`` started it (and its OpenAI edge)."""
    for region in topo.regions:
        openai = f"  openai {region.openai.base_url}" if region.openai else ""
        print(f"region     {region.name:<14} regional tier {region.endpoint}{openai}")
        for zone in region.zones:
            gpus = ", ".join(f"{g.name.rsplit('-', 1)[-1]}:{g.hardware}" for g in zone.gpus)
            openai = f"  openai {zone.openai.base_url}" if zone.openai else ""
            print(f"  zone     {zone.name:<14} local tier {zone.endpoint}  gpus {gpus}{openai}")


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


# What each process a Fleet launches imports before its start gate.
SERVING_MODULES = {
    "global": "global_lb.server",
    "regional": "regional_lb.server",
    "local": "local_lb.server",
    "worker": "sim.worker",
}


def _through_start_gate(command: str) -> None:
    """Launched behind a gate (``cli.launcher.Fleet.start``): load the code now, the
    slow part of a start, then wait until the launcher closes the gate's pipe."""
    from cli.processes import START_GATE_ENV

    gate = os.environ.pop(START_GATE_ENV, None)
    if gate is None or command not in SERVING_MODULES:
        return
    importlib.import_module(SERVING_MODULES[command])
    while os.read(int(gate), 1):  # end of file: the gate is open
        pass
    os.close(int(gate))


def _dispatch(args: argparse.Namespace, argv: list[str]) -> int:
    _through_start_gate(args.command)
    if args.command in ("global", "regional", "local"):
        if args.workers > 1 and args.worker_index is None:
            return _supervise(args, argv)
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
    elif args.command == "deploy":
        from cli.k8s.command import deploy_main

        return deploy_main(args)
    return 0


def main(argv: list[str] | None = None) -> None:
    from cli.processes import die_with_parent

    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    # These parse their own arguments; argparse's REMAINDER would refuse leading options.
    own = {
        "usage": "cli.usage:usage_main",
        "admin": "cli.admin:admin_main",
        "sim": "cli.sim:sim_main",
        "redis-acl": "cli.redis_acl:redis_acl_main",
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
        code = _dispatch(args, argv)
    except ConfigError as exc:
        print(f"meridian: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    raise SystemExit(code)


if __name__ == "__main__":
    main()
