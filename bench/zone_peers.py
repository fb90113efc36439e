"""Routing quality on one real zone: Meridian's local tier against nginx and HAProxy.

The same emulated GPUs (``sim.worker``: a mixed zone, one A100 throttled), the same
requests at the same arrival times (a few shared system prompts, varied user text and
``max_tokens``, Poisson arrivals at ``--load`` of the zone's warm capacity), sent open
loop through each front in turn:

- *meridian*: the zone's real local tier (``local_lb.server.build_local_tier``, its
  default policy), as ``bench.sim_validation`` runs it;
- *completion_time*: the same tier with the ``completion_time`` policy (the default
  without its length weight: every request by its completion time alone), the
  before of the change that weighs long requests towards fast GPUs;
- *nginx*: ``least_conn`` with ``weight=`` from each GPU's speed (hardware class times
  throttle), the configuration most fleets start from;
- *haproxy*: ``balance leastconn`` with the same weights.

Every run starts fresh GPUs (cold prefix caches) on the same ports. Rounds interleave
the fronts, so a slow minute of this shared machine falls on all of them. A request's
latency is the client's, from its scheduled send to its answer. The client, the local
tier and the GPUs share this process's core (as in ``bench.sim_validation``); nginx and
HAProxy run in processes of their own, so the comparison, if anything, favours them.
``--time-scale`` slows the emulated GPUs so that the routers' CPU is a small part of a
request's time. ``--sessions`` sends 4-turn conversations instead, each turn with
``x-meridian-session`` and its history as its prompt's prefix (``--sessions unshared``:
turns that share no history, so the header brings no cache hit); ``--simulate`` runs the
same zone and workload in the simulator (``bench.zone_peers_sim``).

    python -m bench.zone_peers --rounds 3      # ~10 min, writes bench/results/zone_peers.{json,md}
    python -m bench.zone_peers --quick         # smoke, writes nothing
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.data_plane_fleet import Proc
from bench.data_plane_peers import (
    PeerPlan,
    Upstream,
    binary,
    haproxy_cfg,
    nginx_conf,
    proxy_argv,
    write_files,
)
from bench.report import machine, pct, revision, write_json_and_markdown
from bench.sim_validation_real import Front, RealResult, run_real
from bench.sim_validation_workload import (
    Shape,
    ShapeSpec,
    draw_sessions,
    draw_shapes,
    draw_unshared_sessions,
    make_shots,
    zone_capacity_rps,
    zone_gpus,
    zone_topology,
)
from bench.zone_peers_sim import sim_markdown, simulate
from common.basics.redis_embed import EmbeddedRedis, free_port
from common.config.gpu import GpuConfig
from common.config.node import Endpoint
from common.config.topology import Topology
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc

RESULTS = Path(__file__).parent / "results"
FRONTS = ("meridian", "completion_time", "nginx", "haproxy")
TIERS = {"meridian": "default", "completion_time": "completion_time"}  # front -> local policy
HARDWARE = ("H100", "H200", "A100", "A100", "A100@0.5", "V100", "V100", "V100")
READY_S = 10.0
PEER_TIMEOUT_S = 600  # a peer's read timeout: longer than any request of the run


def weight(gpu: GpuConfig) -> int:
    """A GPU's static weight: its speed (A100 = 1.0) in tenths, at least 1."""
    return max(1, round(10 * gpu.speed))


def peer_files(
    name: str, workdir: Path, listen: Endpoint, gpus: Sequence[GpuConfig]
) -> dict[str, str]:
    """Peer ``name``'s config: weighted least connections, plaintext HTTP/2 both ways."""
    upstream = Upstream([g.endpoint for g in gpus], [weight(g) for g in gpus], PEER_TIMEOUT_S)
    if name in ("nginx", "haproxy"):
        render = nginx_conf if name == "nginx" else haproxy_cfg
        conf = render(workdir, listen, upstream, None)
        return {"nginx.conf" if name == "nginx" else "haproxy.cfg": conf}
    raise ValueError(f"unknown peer {name!r}: expected nginx or haproxy")


def peer_plan(name: str, workdir: Path, listen: Endpoint, gpus: Sequence[GpuConfig]) -> PeerPlan:
    """How to start peer ``name`` in front of ``gpus``."""
    exe = binary(name)
    if exe is None:
        raise RuntimeError(f"no {name} binary on this machine: `make peers` installs it")
    files = peer_files(name, workdir, listen, gpus)
    return PeerPlan(name, proxy_argv(name, exe, workdir), files, listen)


def peer_front(name: str, workdir: Path) -> Front:
    """``name`` started in front of the zone's GPUs, for ``run_real``."""

    async def start(stack: contextlib.AsyncExitStack, topology: Topology) -> str:
        listen = Endpoint("127.0.0.1", free_port())
        plan = peer_plan(name, workdir / name, listen, zone_gpus(topology))
        write_files(plan, workdir / name)
        proc = Proc(name, plan.argv, workdir / f"{name}.log")
        proc.start()
        stack.callback(proc.stop)
        await _forwarding(proc, listen.address)
        return listen.address

    return start


async def _forwarding(proc: Proc, address: str) -> None:
    """Until ``ServerReady`` answers through the peer (it reached a GPU)."""
    deadline = time.monotonic() + READY_S
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited: {proc.tail()}")
            try:
                if (await stub.ServerReady(pb.ServerReadyRequest(), timeout=1)).ready:
                    return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
    raise RuntimeError(f"{proc.name} not forwarding within {READY_S:g} s: {proc.tail()}")


@dataclass
class FrontRun:
    front: str
    round: int
    served: int
    codes: dict[str, int]
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    attempts_per_gpu: dict[str, int]
    prefix_hit_share: float
    process_cpu_cores: float
    loop_lag_p99_ms: float
    seconds: float

    @classmethod
    def of(cls, front: str, round_: int, real: RealResult) -> FrontRun:
        ms = [1000 * v for v in real.ok_latencies.values()]
        if not ms:
            raise RuntimeError(f"{front}: no request was served ({real.codes})")
        return cls(
            front, round_, len(ms), real.codes,
            pct(ms, 0.50) or 0.0, pct(ms, 0.90) or 0.0, pct(ms, 0.99) or 0.0,
            statistics.fmean(ms), real.attempts_per_gpu, real.prefix_hit_share,
            real.process_cpu_cores, real.loop_lag_p99_ms, real.seconds,
        )  # fmt: skip


SESSIONS = {"history": draw_sessions, "unshared": draw_unshared_sessions}


def workload(sessions: str | None) -> Callable[[int, ShapeSpec, random.Random], list[Shape]]:
    """Independent requests, or multi-turn sessions sent with x-meridian-session: turns
    that carry their history (``history``) or that share none (``unshared``)."""
    return SESSIONS[sessions] if sessions else draw_shapes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.zone_peers", description=__doc__)
    p.add_argument("--fronts", default=",".join(FRONTS), help=", ".join(FRONTS))
    p.add_argument("--load", type=float, default=0.85, help="fraction of the warm capacity")
    p.add_argument("--requests", type=int, default=1200, help="requests per run")
    p.add_argument("--rounds", type=int, default=2, help="every front once per round")
    p.add_argument("--time-scale", type=float, default=4.0, help="emulated GPUs' slowdown")
    p.add_argument("--hardware", default=",".join(HARDWARE), help="the zone (A100@0.5: throttled)")
    p.add_argument("--max-concurrency", type=int, default=16, help="slots per GPU")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--budget-s", type=float, default=1500.0, help="hard limit on the bench")
    p.add_argument(
        "--sessions", nargs="?", const="history", choices=tuple(SESSIONS),
        help="4-turn sessions with x-meridian-session: each turn's prompt its history "
        "(history, the default) or turns that share none (unshared)",
    )  # fmt: skip
    p.add_argument("--simulate", action="store_true", help="the simulator instead (seconds)")
    p.add_argument("--sim-loads", default="0.5,0.85,0.95", help="--simulate: the loads")
    p.add_argument("--sim-seeds", type=int, default=6, help="--simulate: seeds per load")
    p.add_argument("--quick", action="store_true", help="60 requests, 1 round; writes nothing")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    args.front_names = tuple(f.strip() for f in args.fronts.split(",") if f.strip())
    unknown = [f for f in args.front_names if f not in FRONTS]
    if unknown or not args.front_names:
        p.error(f"--fronts: expected some of {','.join(FRONTS)}, got {args.fronts!r}")
    if not 0 < args.load <= 1.5:
        p.error(f"--load: must be in (0, 1.5], got {args.load}")
    if args.quick:
        args.requests, args.rounds, args.no_write = 60, 1, True
    if args.requests < 20 or args.rounds < 1:
        p.error("--requests: at least 20, --rounds: at least 1")
    args.gpus = tuple(h.strip() for h in args.hardware.split(",") if h.strip())
    try:
        args.loads = [float(x) for x in args.sim_loads.split(",") if x.strip()]
    except ValueError:
        p.error(f"--sim-loads: expected fractions like 0.5,0.85, got {args.sim_loads!r}")
    if not args.loads or any(not 0 < x <= 1.5 for x in args.loads) or args.sim_seeds < 1:
        p.error("--sim-loads: each in (0, 1.5]; --sim-seeds: at least 1")
    return args


def run(args: argparse.Namespace) -> tuple[float, list[FrontRun]]:
    """Every front once per round on the same shots; fresh GPUs each time."""
    shapes = workload(args.sessions)(args.requests, ShapeSpec(), random.Random(args.seed))
    redis = EmbeddedRedis()
    runs: list[FrontRun] = []
    started = time.monotonic()
    try:
        redis.start()
        topology = zone_topology(
            redis.url, hardware=args.gpus, time_scale=args.time_scale,
            max_concurrency=args.max_concurrency,
        )  # fmt: skip
        rate = args.load * zone_capacity_rps(topology, shapes)
        shots = make_shots(shapes, rate, random.Random(args.seed))
        with tempfile.TemporaryDirectory(prefix="zone-peers-") as tmp:
            for round_ in range(args.rounds):
                for name in args.front_names:
                    left = args.budget_s - (time.monotonic() - started)
                    if left <= 0:
                        raise TimeoutError(f"--budget-s {args.budget_s:g} spent before {name}")
                    real = asyncio.run(
                        run_real(
                            topology, shots, timeout_s=args.timeout_s, budget_s=left,
                            front=peer_front(name, Path(tmp)) if name not in TIERS else None,
                            policy=TIERS.get(name, "default"),
                        )
                    )  # fmt: skip
                    runs.append(FrontRun.of(name, round_, real))
                    print(row(runs[-1]), flush=True)
    finally:
        redis.close()
    return rate, runs


def row(r: FrontRun) -> str:
    failed = sum(r.codes.values()) - r.codes.get("OK", 0)
    return (
        f"| {r.front} | {r.round + 1} | {r.p50_ms:.0f} | {r.p90_ms:.0f} | {r.p99_ms:.0f} "
        f"| {r.mean_ms:.0f} | {failed} | {100 * r.prefix_hit_share:.1f} % "
        f"| {r.process_cpu_cores:.2f} | {r.loop_lag_p99_ms:.1f} |"
    )


def ratios(runs: Sequence[FrontRun], front: str) -> dict[str, float]:
    """Median over rounds of ``front``'s P50 and P99 over meridian's in the same round."""
    by = {(r.front, r.round): r for r in runs}
    p50, p99 = [], []
    for r in runs:
        base = by.get(("meridian", r.round))
        if r.front == front and base is not None:
            p50.append(r.p50_ms / base.p50_ms)
            p99.append(r.p99_ms / base.p99_ms)
    if not p99:
        return {}
    return {"p50": statistics.median(p50), "p99": statistics.median(p99)}


def markdown(args: argparse.Namespace, rate: float, runs: Sequence[FrontRun]) -> str:
    lines = [
        "# One zone's routing quality: Meridian's local tier, nginx, HAProxy",
        "",
        f"GPUs: {', '.join(args.gpus)}; {args.max_concurrency} slots each; time scale "
        f"{args.time_scale:g}. {args.requests} requests per run"
        f"{session_note(args.sessions)} at "
        f"{args.load:.0%} of the "
        f"zone's warm capacity ({rate:.2f} requests/s), the same arrivals for every front; "
        f"{args.rounds} rounds, fronts interleaved, fresh GPUs every run.",
        "",
        "| front | round | P50 ms | P90 ms | P99 ms | mean ms | failed | prefix hits "
        "| client+tier+GPUs cores | loop lag P99 ms |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(row(r) for r in runs),
        "",
        "Against meridian in the same round (median over rounds; below 1: the peer is faster):",
        "",
        "| front | P50 ÷ meridian's | P99 ÷ meridian's |",
        "|:---|---:|---:|",
    ]
    for front in args.front_names:
        if front != "meridian" and (r := ratios(runs, front)):
            lines.append(f"| {front} | {r['p50']:.2f} | {r['p99']:.2f} |")
    return "\n".join(lines) + "\n"


def session_note(sessions: str | None) -> str:
    if sessions is None:
        return ""
    turns = "each turn's prompt its history" if sessions == "history" else "no shared history"
    return f" (4-turn sessions, x-meridian-session, {turns})"


def stem(args: argparse.Namespace, name: str) -> str:
    """The results' name: ``zone_peers``, ``zone_peers_sessions`` (history) or
    ``zone_peers_sessions_unshared``."""
    if args.sessions is None:
        return name
    return f"{name}_sessions" if args.sessions == "history" else f"{name}_sessions_unshared"


def results_payload(args: argparse.Namespace, **figures: Any) -> dict[str, Any]:
    """What a results file holds: the machine, the revision, the arguments, ``figures``."""
    config = {k: v for k, v in vars(args).items() if k not in ("no_write", "quick")}
    return {"machine": machine(), "revision": revision(), "config": config, **figures}


def main_simulated(args: argparse.Namespace) -> int:
    topology = zone_topology(
        "redis://127.0.0.1:1", hardware=args.gpus, time_scale=args.time_scale,
        max_concurrency=args.max_concurrency,
    )  # fmt: skip
    rows = simulate(
        topology, args.front_names, args.loads, args.requests, args.sim_seeds,
        draw=workload(args.sessions),
    )  # fmt: skip
    header = (
        "# One zone's routing quality in the simulator\n\n"
        f"GPUs: {', '.join(args.gpus)}; time scale {args.time_scale:g}; {args.requests} "
        f"requests per seed, {args.sim_seeds} seeds per load (each its own requests and "
        "arrivals, the same for every front); medians over the seeds."
    )
    text = sim_markdown(rows, header)
    print(text)
    if not args.no_write:
        payload = results_payload(args, rows=[asdict(r) for r in rows])
        write_json_and_markdown(RESULTS, stem(args, "zone_peers_sim"), payload, text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.simulate:
        return main_simulated(args)
    rate, runs = run(args)
    text = markdown(args, rate, runs)
    print(text)
    if not args.no_write:
        payload = results_payload(
            args,
            rate_rps=rate,
            runs=[asdict(r) for r in runs],
            ratios={f: ratios(runs, f) for f in args.front_names if f != "meridian"},
        )
        write_json_and_markdown(RESULTS, stem(args, "zone_peers"), payload, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
