"""What one hop of Meridian costs against a bare pass-through: requests/s, latency, CPU.

One fleet as ``meridian up`` starts it (``cli.launcher.Fleet``: one process per tier,
mutual TLS between tiers, tenant auth at the global edge), one region of one zone of
``--gpus`` emulated GPUs at ``--time-scale`` (near-instant: the router is the
bottleneck), and three bare hops (``bench.hop_bare``) in the same positions as the
global, regional and local tiers, serving and dialling TLS where those do. A closed
loop of ``--concurrency`` callers (raw bytes, so the client costs little) sends
1-token generate requests to each target in turn, ``--seconds`` each, ``--rounds``
times interleaved; the figures are medians over rounds.

The figure least disturbed by others sharing the machine is CPU per request of each
router process (utime + stime from /proc/PID/stat over the run, divided by the
requests it finished); requests/s and latency are reported beside it, ratios always
against the bare hop measured in the same round.

    .venv/bin/python -m bench.hop_cost                       # writes results/hop_cost.{json,md}
    .venv/bin/python -m bench.hop_cost --out hop_cost_before
    .venv/bin/python -m bench.hop_cost --no-tls --out hop_cost_notls
    OTEL_TRACES_SAMPLER=always_off .venv/bin/python -m bench.hop_cost --out hop_cost_dropped
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from cli.launcher import DEMO_FLEET, Fleet
from cli.processes import TierProcess
from common.basics.redis_embed import free_port
from common.config.identity import GLOBAL, Identity, local, regional
from common.request.v2 import generate_request

RESULTS = Path(__file__).parent / "results"
MODEL, REGION, ZONE, TENANT = "demo-llm", "us-east", "us-east-1a", "bench"
INFER = "/inference.GRPCInferenceService/ModelInfer"
BARE = ("bare-global", "bare-regional", "bare-local")


def fleet_spec(gpus: int, time_scale: float, *, quotas: bool = True) -> dict[str, Any]:
    """The demo fleet cut to one zone of ``gpus`` GPUs, on free ports, one tenant whose
    limits never bind here."""
    spec: dict[str, Any] = yaml.safe_load(DEMO_FLEET.read_text())
    spec["global"] = {**spec["global"], "listen": "127.0.0.1:0", "ops_listen": "127.0.0.1:0"}
    spec["global"].pop("openai_listen", None)
    spec["regions"] = spec["regions"][:1]
    zone = spec["regions"][0]["zones"][0]
    spec["regions"][0]["zones"] = [zone]
    zone["gpus"] = [
        {**zone["gpus"][0], "name": f"{ZONE}-gpu{i}", "hardware": "H100", "throttle": 1.0}
        for i in range(gpus)
    ]
    spec["time_scale"] = time_scale
    tenant: dict[str, Any] = {"id": TENANT, "api_key": "generate", "priority_ceiling": "critical"}
    if quotas:  # limits that never bind here, but are counted in Redis on every request
        tenant.update(requests_per_s=1_000_000, tokens_per_min=1_000_000_000, max_concurrent=4096)
    spec["auth"] = {"enabled": True, "tenants": [tenant]}
    return spec


@dataclass
class Target:
    """Where the callers send, as whom, and which processes do the work."""

    name: str
    address: list[str]
    credentials: grpc.ChannelCredentials | None
    processes: list[str]
    metadata: tuple[tuple[str, str], ...] = ()
    # Channel arguments (round robin over the replicas behind a name: bench.replicas).
    options: tuple[tuple[str, str | int], ...] = ()


class Bench:
    """The fleet, the bare hops, and the targets over them."""

    def __init__(self, run_dir: Path, args: argparse.Namespace) -> None:
        path = run_dir / "fleet.yaml"
        spec = fleet_spec(args.gpus, args.time_scale, quotas=not args.no_quotas)
        path.write_text(yaml.safe_dump(spec))
        self.fleet = Fleet(path, run_dir / "run", tls=not args.no_tls)
        topo = self.fleet.topology
        zone = topo.regions[0].zones[0]
        self.gpus = [g.endpoint.address for g in zone.gpus]
        self.bare_addr = {n: f"127.0.0.1:{free_port()}" for n in BARE}
        self.bare = self._bare_hops(run_dir)
        key = ("authorization", f"Bearer {self.fleet.tenant_keys[TENANT]}")
        as_regional = self._creds(regional(REGION))
        as_global = self._creds(GLOBAL)
        b = self.bare_addr
        self.targets = {
            t.name: t
            for t in [
                Target("direct", self.gpus, None, [f"worker-{ZONE}"]),
                Target("bare1", [b["bare-local"]], as_regional, ["bare-local"]),
                Target("local", [zone.endpoint.address], as_regional, [f"local-{ZONE}"]),
                Target("bare2", [b["bare-regional"]], as_global, ["bare-regional", "bare-local"]),
                Target(
                    "regional",
                    [topo.regions[0].endpoint.address],
                    as_global,
                    [f"regional-{REGION}", f"local-{ZONE}"],
                ),
                Target("bare3", [b["bare-global"]], None, list(BARE), (key,)),
                Target(
                    "chain",
                    [topo.global_tier.endpoint.address],
                    None,
                    ["global", f"regional-{REGION}", f"local-{ZONE}"],
                    (key,),
                ),
            ]
        }

    def _creds(self, who: Identity) -> grpc.ChannelCredentials | None:
        return None if self.fleet.topology.tls is None else self.fleet.credentials_as(who)

    def _bare_hops(self, run_dir: Path) -> dict[str, TierProcess]:
        tls = self.fleet.topology.tls
        a = self.bare_addr

        def cert(who: Identity) -> list[str]:
            return [] if tls is None else [str(tls.cert_file(who).parent)]

        plan = {  # name: (upstreams, serve as, dial as) — as the tier in that position
            "bare-local": (self.gpus, cert(local(REGION, ZONE)), []),
            "bare-regional": ([a["bare-local"]], cert(regional(REGION)), cert(regional(REGION))),
            "bare-global": ([a["bare-regional"]], [], cert(GLOBAL)),
        }
        out = {}
        for name, (up, serve, dial) in plan.items():
            argv = [
                sys.executable,
                "-m",
                "bench.hop_bare",
                "--listen",
                a[name],
                "--upstream",
                ",".join(up),
            ]
            if tls is not None:
                argv += ["--ca", tls.ca]
            argv += [x for s in serve for x in ("--serve-cert", s)]
            argv += [x for d in dial for x in ("--dial-cert", d)]
            out[name] = TierProcess(name, argv, run_dir / f"{name}.log")
        return out

    def pid(self, name: str) -> int:
        proc = (self.bare.get(name) or self.fleet.processes[name]).process
        assert proc is not None
        return proc.pid

    def start(self) -> None:
        self.fleet.start(timeout_s=90)
        for proc in self.bare.values():
            proc.start()
        for name, address in self.bare_addr.items():
            host, _, port = address.rpartition(":")
            deadline = time.monotonic() + 30
            while True:  # until it listens (it dials lazily: nothing else to wait for)
                try:
                    socket.create_connection((host, int(port)), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or not self.bare[name].alive():
                        raise RuntimeError(f"{name} is not listening; see its log") from None
                    time.sleep(0.05)

    def stop(self) -> None:
        for proc in reversed(list(self.bare.values())):
            proc.stop()
        self.fleet.stop()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (all its threads)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def closed_loop(
    target: Target, concurrency: int, seconds: float
) -> tuple[int, float, list[float], int]:
    """(requests done, wall seconds, latencies, errors) of ``concurrency`` callers."""
    body = generate_request(MODEL, "hello", 1).SerializeToString()
    options = list(target.options)
    channels = [
        grpc.aio.insecure_channel(a, options)
        if target.credentials is None
        else grpc.aio.secure_channel(a, target.credentials, options)
        for a in target.address
    ]
    calls = [c.unary_unary(INFER) for c in channels]
    latencies: list[float] = []
    errors = 0
    first_error: list[str] = []
    stop_at = time.perf_counter() + seconds

    async def caller(i: int) -> None:
        nonlocal errors
        call = calls[i % len(calls)]
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            try:
                await call(body, metadata=target.metadata, timeout=10)
            except grpc.aio.AioRpcError as exc:
                errors += 1
                if not first_error:
                    first_error.append(f"{exc.code().name}: {exc.details()}")
                    print(f"{target.name}: {first_error[0]}", file=sys.stderr, flush=True)
                await asyncio.sleep(0.01)
                continue
            latencies.append(time.perf_counter() - t0)

    try:
        started = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(concurrency)))
        return len(latencies), time.perf_counter() - started, latencies, errors
    finally:
        for channel in channels:
            await channel.close()


async def idle_cpu(bench: Bench, seconds: float) -> dict[str, float]:
    """CPU seconds per second each process spends with no request to serve (health
    probes, keepalive pings, capacity summaries, metric scrapes)."""
    names = [*bench.fleet.processes, *bench.bare]
    before = {n: cpu_seconds(bench.pid(n)) for n in names}
    started = time.perf_counter()
    await asyncio.sleep(seconds)
    wall = time.perf_counter() - started
    return {n: (cpu_seconds(bench.pid(n)) - before[n]) / wall for n in names}


async def measure(
    bench: Bench, target: Target, args: argparse.Namespace, idle: dict[str, float]
) -> dict[str, Any]:
    await closed_loop(target, args.concurrency, args.warmup)
    pids = {p: bench.pid(p) for p in target.processes}
    before = {p: cpu_seconds(pid) for p, pid in pids.items()}
    client_before = time.process_time()
    done, wall, lat, errors = await closed_loop(target, args.concurrency, args.seconds)
    client_cpu = time.process_time() - client_before
    used = {p: cpu_seconds(pid) - before[p] for p, pid in pids.items()}
    n = max(done, 1)
    lat.sort()
    return {
        "rps": done / wall,
        "p50_ms": 1e3 * lat[len(lat) // 2] if lat else None,
        "p99_ms": 1e3 * lat[int(len(lat) * 0.99)] if lat else None,
        "errors": errors,
        "cpu_us_per_request": {p: 1e6 * c / n for p, c in used.items()},
        # Less what the process burns idle over the same time: the cost that grows with requests.
        "net_cpu_us_per_request": {p: 1e6 * (c - idle[p] * wall) / n for p, c in used.items()},
        "client_cpu_us_per_request": 1e6 * client_cpu / max(done, 1),
    }


def med(values: list[Any]) -> float | None:
    """The median of the values a round measured (None where it measured none)."""
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def closed_loop_medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """What every closed-loop round measures, over the rounds: rate, latency, errors."""
    return {
        "rps": med([r["rps"] for r in rounds]),
        "p50_ms": med([r["p50_ms"] for r in rounds]),
        "p99_ms": med([r["p99_ms"] for r in rounds]),
        "errors": sum(r["errors"] for r in rounds),
    }


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        **closed_loop_medians(rounds),
        **{
            kind: {p: med([r[kind][p] for r in rounds]) for p in rounds[0][kind]}
            for kind in ("cpu_us_per_request", "net_cpu_us_per_request")
        },
    }


async def run(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    names = args.targets.split(",")
    rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    await asyncio.sleep(1.0)  # first health probes and capacity summaries
    idle = await idle_cpu(bench, args.idle)
    print("idle CPU ms/s: " + " ".join(f"{p}={1e3 * v:.0f}" for p, v in idle.items()))
    for i in range(args.rounds):
        for name in names:
            r = await measure(bench, bench.targets[name], args, idle)
            rounds[name].append(r)
            net = r["net_cpu_us_per_request"]
            cpu = " ".join(f"{p}={v:.0f}({net[p]:.0f})" for p, v in r["cpu_us_per_request"].items())
            print(
                f"round {i + 1} {name:8s} {r['rps']:7.0f} req/s p50 {r['p50_ms'] or 0:6.1f} ms "
                f"err {r['errors']}  cpu µs/req (net of idle) {cpu}",
                flush=True,
            )
    return {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "params": vars(args),
        "tls": not args.no_tls,
        "quotas": not args.no_quotas,
        "otel_env": {k: v for k, v in os.environ.items() if k.startswith("OTEL_")},
        "idle_cpu_s_per_s": idle,
        "rounds": rounds,
        "median": {n: medians(r) for n, r in rounds.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=0.0001)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle", type=float, default=3.0, help="seconds of idle CPU sampling")
    parser.add_argument("--targets", default="direct,bare1,local,bare2,regional,bare3,chain")
    parser.add_argument("--no-tls", action="store_true", help="plaintext between tiers")
    parser.add_argument(
        "--no-quotas", action="store_true", help="the tenant has no rate or concurrency limit"
    )
    parser.add_argument("--out", default="hop_cost", help="results/OUT.json and OUT.md")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hop_cost-") as tmp:
        bench = Bench(Path(tmp), args)
        bench.start()
        try:
            result = asyncio.run(run(bench, args))
        finally:
            bench.stop()
    from bench.hop_report import markdown
    from bench.report import write_json_and_markdown

    text = markdown(result, RESULTS)
    print(text)
    if not args.no_write:
        write_json_and_markdown(RESULTS, args.out, result, text)


if __name__ == "__main__":
    main()
