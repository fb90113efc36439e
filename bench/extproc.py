"""Envoy + endpoint picker against the local tier proxying itself, in one run.

One zone of ``--gpus`` emulated A100s (``meridian worker``, its own process) at a tiny
``--time-scale``, so the router and not the GPU is what is measured; one local tier
(``meridian local``, its own process) serving both its V2 proxy and, with
``--ext-proc-listen``, the endpoint picker; one Envoy (``bench.envoy_proc``, one worker
thread) with the picker's ext_proc filter in front of the GPUs (override_host cluster).
Clients in this process send 1-token ModelInfer calls in a closed loop of
``--concurrency`` for ``--seconds``, to each path in turn, ``--runs`` times:

* ``direct``: straight to the GPUs, clients spread evenly (no router): the floor;
* ``proxy``: to the local tier, which picks and forwards the bytes itself;
* ``envoy``: to Envoy, which asks the picker and carries the bytes.

Reported per path: requests/s and latency P50/P99 (median over runs), and the latency
each router path adds over ``direct``. All processes share the machine's cores.

    .venv/bin/python -m bench.extproc                 # 3 runs of 5 s per path, writes results
    .venv/bin/python -m bench.extproc --seconds 2 --runs 1 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench.envoy_proc import EnvoyProcess
from bench.report import machine
from common.basics.redis_embed import EmbeddedRedis, free_port
from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.v2 import generate_request
from local_lb.ext_proc_envoy import envoy_bootstrap
from sim.topology import one_zone_mapping

REGION, ZONE, MODEL = "r", "r-1a", "m"
RESULTS = Path(__file__).parent / "results"
PATHS = ("direct", "proxy", "envoy")


async def closed_loop(
    addresses: list[str], concurrency: int, seconds: float, tokens: int = 1
) -> dict[str, float]:
    """Requests/s and latency percentiles of ``concurrency`` clients, spread over
    ``addresses`` (a channel each), each asking for ``tokens`` tokens in one answer."""
    request = generate_request(MODEL, "hello", tokens)
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]

    async def client(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
        while time.perf_counter() < stop_at:
            began = time.perf_counter()
            await stub.ModelInfer(request, timeout=10)
            latencies.append(time.perf_counter() - began)

    try:
        started = time.perf_counter()
        await asyncio.gather(*(client(stubs[i % len(stubs)]) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
    finally:
        for channel in channels:
            await channel.close()
    latencies.sort()
    return {
        "rps": len(latencies) / elapsed,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
    }


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "MERIDIAN_PARENT_PID": str(os.getpid())}  # die with this process
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)


async def _ready(address: str, timeout_s: float = 20.0) -> None:
    """Until ``address`` answers ServerReady true (a GPU, or a tier with a healthy GPU)."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while time.monotonic() < deadline:
            try:
                if (await stub.ServerReady(pb.ServerReadyRequest(), timeout=1)).ready:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{address} not ready within {timeout_s} s")


def _topology(redis_url: str, gpus: int, time_scale: float) -> dict[str, Any]:
    mapping = one_zone_mapping(
        redis_url, gpus=gpus, model=MODEL, region=REGION, zone=ZONE, slow_start_window_s=0
    )
    mapping["time_scale"] = time_scale
    zone = mapping["regions"][0]["zones"][0]
    zone["ext_proc"] = {"listen": f"127.0.0.1:{free_port()}"}
    return mapping


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    load = os.getloadavg()[0]  # other work on the machine skews every figure alike
    redis = EmbeddedRedis()
    redis.start()
    mapping = _topology(redis.url, args.gpus, args.time_scale)
    config = workdir / "topology.yaml"
    config.write_text(yaml.safe_dump(mapping), encoding="utf-8")
    zone = mapping["regions"][0]["zones"][0]
    gpus = [g["listen"] for g in zone["gpus"]]
    where = ["--config", str(config), "--region", REGION, "--zone", ZONE, "--log-level", "warning"]
    main = [sys.executable, "-m", "cli.main"]
    procs = [_spawn([*main, "worker", *where], workdir / "worker.log")]
    admin, listen = Endpoint("127.0.0.1", free_port()), Endpoint("127.0.0.1", free_port())
    bootstrap = envoy_bootstrap(
        listen=listen,
        picker=_endpoint(zone["ext_proc"]["listen"]),
        admin=admin,
        gpus=[_endpoint(g) for g in gpus],
    )
    envoy = EnvoyProcess(bootstrap, admin, workdir)
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        str(n): {path: [] for path in PATHS} for n in args.max_tokens
    }
    try:
        for gpu in gpus:
            await _ready(gpu)
        procs.append(_spawn([*main, "local", *where], workdir / "local.log"))
        await _ready(zone["listen"])
        await envoy.start()
        targets = {"direct": gpus, "proxy": [zone["listen"]], "envoy": [listen.address]}
        for address in targets.values():  # warm up every path once
            await closed_loop(address, args.concurrency, 0.5)
        for i in range(args.runs):
            for tokens in args.max_tokens:
                for path, address in targets.items():
                    figures = await closed_loop(address, args.concurrency, args.seconds, tokens)
                    results[str(tokens)][path].append(figures)
                    print(f"run {i + 1} {tokens:4d} tokens {path:6s}: {_line(figures)}", flush=True)
    finally:
        await envoy.stop()
        for proc in reversed(procs):
            proc.terminate()
            _wait(proc)
        redis.stop()
    return _summary(args, results, load)


def _endpoint(text: str) -> Endpoint:
    host, _, port = text.rpartition(":")
    return Endpoint(host, int(port))


def _wait(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _line(figures: dict[str, float]) -> str:
    return (
        f"{figures['rps']:8.1f} req/s  p50 {figures['p50_ms']:6.2f} ms  "
        f"p99 {figures['p99_ms']:6.2f} ms"
    )


def _summary(
    args: argparse.Namespace, results: dict[str, dict[str, list[dict[str, float]]]], load: float
) -> dict[str, Any]:
    by_size = {}
    for tokens, paths in results.items():
        medians = {
            path: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            for path, runs in paths.items()
        }
        floor = medians["direct"]["p50_ms"]
        by_size[tokens] = {
            "medians": medians,
            "added_p50_ms": {p: medians[p]["p50_ms"] - floor for p in ("proxy", "envoy")},
            "envoy_vs_proxy_rps": medians["envoy"]["rps"] / medians["proxy"]["rps"],
        }
    return {
        "machine": {**machine(), "load_average_1m_before": load},
        "params": vars(args),
        "runs": results,
        "by_max_tokens": by_size,
    }


def markdown(summary: dict[str, Any]) -> str:
    m, p = summary["machine"], summary["params"]
    lines = [
        "# Envoy + endpoint picker vs the local tier proxying itself",
        "",
        f"`python -m bench.extproc` — {m['date']}, {m['nproc']} CPUs ({m['cpu']}), "
        f"Python {m['python']}, load average {m['load_average_1m_before']:.1f} before the "
        f"run; {p['gpus']} emulated A100s at time scale {p['time_scale']}, "
        f"{p['concurrency']} clients, {p['runs']} runs of {p['seconds']} s per path "
        "(medians).",
    ]
    for tokens, size in summary["by_max_tokens"].items():
        lines += [
            "",
            f"**{tokens}-token answers** (Envoy + picker / proxy requests/s: "
            f"{size['envoy_vs_proxy_rps']:.2f})",
            "",
            "| path | req/s | P50 ms | P99 ms | P50 added over direct |",
            "|---|---|---|---|---|",
        ]
        for path in PATHS:
            f = size["medians"][path]
            added = size["added_p50_ms"].get(path)
            extra = "—" if added is None else f"{added:+.2f} ms"
            lines.append(
                f"| {path} | {f['rps']:.0f} | {f['p50_ms']:.2f} | {f['p99_ms']:.2f} | {extra} |"
            )
    return "\n".join([*lines, "", READING])


READING = """\
Reading it. Every process here — the clients, the GPUs' worker, the local tier, Envoy
(one worker thread) and Redis — shares the machine's 2 cores (with whatever else runs
on it), so each path's figure is what is left to it, not what it would do alone. The
proxy path costs the tier one unary call in and one out per request, in Python. The
Envoy path moves the bytes to C++ but costs the picker, also Python, one ext_proc
stream of four messages per request (request headers, the buffered body, response
headers, trailers), and Envoy's worker takes CPU from that same pair of cores: for
small answers the picker is the bottleneck and Envoy + picker does a bit less than
the proxy. What it saves grows with the bytes the proxy would have copied (long
answers, token streams) and with cores of its own for Envoy; the picker's work per
request stays the same whatever the size."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=0.001)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--max-tokens",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 512],
        help="answer sizes to run, comma-separated",
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meridian-extproc-") as tmp:
        summary = asyncio.run(run(args, Path(tmp)))
    text = markdown(summary)
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "extproc.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
        (RESULTS / "extproc.md").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
