"""Throughput with one and with two replicas of the global and the regional tier, one run.

One fleet as ``meridian up`` starts it (``cli.launcher.Fleet``: one process per tier,
plaintext between tiers, tenant auth and quotas counted in Redis at the edge), one
region of one zone of ``--gpus`` near-instant emulated GPUs (the routers are the
bottleneck), plus a second global and a second regional process from the same
topology, listening on 127.0.0.3 where the first ones listen on 127.0.0.2. The
global tiers dial the region at a name, and the callers dial the global tier at a
name, both answered by a DNS server this bench runs (``sim.dns_server``), so each
phase only changes the answers: ``GxR`` is G global and R regional replicas
(``1x1``, ``2x1``, ``1x2``, ``2x2``). Connections age out after 1 s
(``keepalive.max_connection_age_s``), so every channel has re-resolved within the
settling time. A closed loop of
``--concurrency`` callers on one round-robin channel sends 1-token generate requests
(``bench.hop_cost.closed_loop``), ``--seconds`` per phase, ``--rounds`` times with the
phases interleaved; figures are medians over rounds, with each replica's CPU share
(proof that both took work) and each phase's requests/s over 1x1's.

    .venv/bin/python -m bench.replicas        # writes results/replicas.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.hop_cost import (
    RESULTS,
    TENANT,
    Target,
    closed_loop,
    closed_loop_medians,
    cpu_seconds,
    fleet_spec,
    med,
)
from bench.report import write_json_and_markdown
from cli.launcher import Fleet
from cli.processes import TierProcess
from cli.readiness import tier_ready
from common.basics.redis_embed import free_port
from common.request.replicas import replica_channel_options
from sim.dns_server import LoopbackDns, loopback_dns

FIRST, SECOND = "127.0.0.2", "127.0.0.3"
REGIONAL, EDGE = "regional.bench.test", "edge.bench.test"
# Phase: (global replicas, regional replicas) in the DNS answers.
PHASES = {
    "1x1": ([FIRST], [FIRST]),
    "2x1": ([FIRST, SECOND], [FIRST]),
    "1x2": ([FIRST], [FIRST, SECOND]),
    "2x2": ([FIRST, SECOND], [FIRST, SECOND]),
}
SETTLE_S = 3.0  # > 2 x max_connection_age_s: every channel has re-resolved


class Replicas:
    """The fleet (first replicas) and the second global and regional processes."""

    def __init__(self, run_dir: Path, dns: LoopbackDns, args: argparse.Namespace) -> None:
        spec = fleet_spec(args.gpus, args.time_scale)
        self.edge_port, self.region_port = free_port(FIRST), free_port(FIRST)
        spec["global"]["listen"] = f"{FIRST}:{self.edge_port}"
        spec["global"]["address"] = f"{EDGE}:{self.edge_port}"
        region = spec["regions"][0]
        self.region = region["name"]
        region["listen"] = f"{FIRST}:{self.region_port}"
        region["address"] = f"{REGIONAL}:{self.region_port}"
        spec["dns"] = dns.authority
        spec["keepalive"] = {"max_connection_age_s": 1}
        path = run_dir / "fleet.yaml"
        path.write_text(yaml.safe_dump(spec))
        self.fleet = Fleet(path, run_dir / "run", tls=False)
        # The second replicas: the resolved topology, their own IP and ops ports.
        raw = copy.deepcopy(self.fleet.raw)
        raw["global"].update(listen=f"{SECOND}:{self.edge_port}", ops_listen=_free())
        raw["regions"][0].update(listen=f"{SECOND}:{self.region_port}", ops_listen=_free())
        second = run_dir / "second.yaml"
        second.write_text(yaml.safe_dump(raw, sort_keys=False))
        cli = [sys.executable, "-m", "cli.main"]
        cfg = ["--config", str(second)]
        self.extra = {
            f"regional-{self.region}-b": TierProcess(
                "regional-b", [*cli, "regional", *cfg, "--region", self.region], run_dir / "rb.log"
            ),
            "global-b": TierProcess("global-b", [*cli, "global", *cfg], run_dir / "gb.log"),
        }
        key = ("authorization", f"Bearer {self.fleet.tenant_keys[TENANT]}")
        self.target = Target(
            "chain",
            [f"{dns.authority}{EDGE}:{self.edge_port}"],
            None,
            [],
            (key,),
            tuple(replica_channel_options()),
        )

    def pids(self) -> dict[str, int]:
        procs = {**self.fleet.processes, **self.extra}
        return {n: p.process.pid for n, p in procs.items() if p.process is not None}

    def start(self) -> None:
        self.fleet.start(timeout_s=90)
        # Bottom first: the second regional, then the second global (which needs it).
        waits = [(SECOND, self.region_port), (SECOND, self.edge_port)]
        for proc, (host, port) in zip(self.extra.values(), waits, strict=True):
            proc.start()
            deadline = time.monotonic() + 60
            while not tier_ready(f"{host}:{port}", None, 0.5):
                if time.monotonic() > deadline or not proc.alive():
                    raise RuntimeError(f"{proc.name} is not ready; see {proc.log_path}")
                time.sleep(0.1)

    def stop(self) -> None:
        for proc in reversed(list(self.extra.values())):
            proc.stop()
        self.fleet.stop()


def _free() -> str:
    return f"127.0.0.1:{free_port()}"


async def measure(bench: Replicas, args: argparse.Namespace) -> dict[str, Any]:
    """One phase's closed loop: requests/s, latency, and CPU seconds of every process."""
    await closed_loop(bench.target, args.concurrency, args.warmup)
    pids = bench.pids()
    before = {n: cpu_seconds(pid) for n, pid in pids.items()}
    done, wall, lat, errors = await closed_loop(bench.target, args.concurrency, args.seconds)
    lat.sort()
    cpu = {n: cpu_seconds(pid) - before[n] for n, pid in pids.items()}
    return {
        "rps": done / wall,
        # Every fleet process's CPU per request: the figure others on the machine disturb least.
        "cpu_us_per_request": 1e6 * sum(cpu.values()) / max(done, 1),
        "p50_ms": 1e3 * lat[len(lat) // 2] if lat else None,
        "p99_ms": 1e3 * lat[int(len(lat) * 0.99)] if lat else None,
        "errors": errors,
        "cpu_s": cpu,
        # Others on the machine take CPU from the fleet (and more from fewer processes).
        "load_average_1m": os.getloadavg()[0],
    }


async def run(bench: Replicas, dns: LoopbackDns, args: argparse.Namespace) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {p: [] for p in PHASES}
    for i in range(args.rounds):
        for phase, (edges, regionals) in PHASES.items():
            dns.set(EDGE, edges)
            dns.set(REGIONAL, regionals)
            await asyncio.sleep(SETTLE_S)
            r = await measure(bench, args)
            rounds[phase].append(r)
            cpu = " ".join(f"{n}={c:.1f}" for n, c in r["cpu_s"].items() if c >= 0.05)
            print(
                f"round {i + 1} {phase} {r['rps']:7.0f} req/s p50 {r['p50_ms'] or 0:6.1f} ms "
                f"err {r['errors']}  cpu s: {cpu}",
                flush=True,
            )
    median = {p: _medians(r) for p, r in rounds.items()}
    return {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "params": vars(args),
        "rounds": rounds,
        "median": median,
        "ratio_rps_over_1x1": {p: m["rps"] / median["1x1"]["rps"] for p, m in median.items()},
    }


def _medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        **closed_loop_medians(rounds),
        "cpu_us_per_request": med([r["cpu_us_per_request"] for r in rounds]),
        "load_average_1m": med([r["load_average_1m"] for r in rounds]),
        "cpu_s": {n: med([r["cpu_s"][n] for r in rounds]) for n in rounds[0]["cpu_s"]},
    }


def markdown(result: dict[str, Any]) -> str:
    med, p = result["median"], result["params"]
    lines = [
        "# Replicas: one and two of the global and the regional tier",
        "",
        f"{result['machine']['cpus']} CPUs, Python {result['machine']['python']}; "
        f"{p['gpus']} emulated GPUs at time scale {p['time_scale']}, {p['concurrency']} "
        f"callers, {p['seconds']} s per phase, median of {p['rounds']} interleaved rounds; "
        "plaintext between tiers, tenant auth and quotas on (`python -m bench.replicas`).",
        "",
        "| phase | requests/s | P50 ms | P99 ms | errors | fleet CPU µs/request | load avg "
        "| CPU s per phase (global, global-b, regional, regional-b) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for phase, m in med.items():
        cpu = m["cpu_s"]
        names = ["global", "global-b", f"regional-{_region(cpu)}", f"regional-{_region(cpu)}-b"]
        shares = ", ".join(f"{cpu.get(n, 0.0):.2f}" for n in names)
        lines.append(
            f"| {phase} | {m['rps']:.0f} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} | "
            f"{m['errors']} | {m['cpu_us_per_request']:.0f} | {m['load_average_1m']:.1f} "
            f"| {shares} |"
        )
    lines += [
        "",
        "Requests/s over 1x1: "
        + ", ".join(f"{p} **{r:.2f}**" for p, r in result["ratio_rps_over_1x1"].items())
        + ".",
        "",
        "Every process of the fleet (GPU workers, local, regional and global tiers, Redis)",
        "and the callers share the machine's CPUs, so the ratio is bounded by CPU, not by",
        "the tiers: a second replica adds capacity only where a core is idle. Where other",
        "work runs on the machine too (load average above the CPU count), more processes",
        "win a larger share of the CPUs from it, which inflates the ratio; CPU per request",
        "is the figure that disturbance moves least.",
        "",
    ]
    return "\n".join(lines)


def _region(cpu: dict[str, float]) -> str:
    return next(n.removeprefix("regional-") for n in cpu if n.startswith("regional-"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=0.0001)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="replicas", help="results/OUT.json and OUT.md")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="replicas-") as tmp, loopback_dns({}) as dns:
        bench = Replicas(Path(tmp), dns, args)
        dns.set(REGIONAL, [FIRST])
        dns.set(EDGE, [FIRST])
        bench.start()
        try:
            result = asyncio.run(run(bench, dns, args))
        finally:
            bench.stop()
    text = markdown(result)
    print(text)
    if not args.no_write:
        write_json_and_markdown(RESULTS, args.out, result, text)


if __name__ == "__main__":
    main()
