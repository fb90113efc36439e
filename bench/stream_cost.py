"""What a streamed request costs through the whole chain: CPU per request and per token.

One fleet as ``meridian up`` starts it (``cli.launcher.Fleet``: one process per tier,
mutual TLS between tiers, tenant auth and quotas in Redis at the global edge), one
region of one zone of ``--gpus`` emulated GPUs at ``--time-scale``. Closed loops of
callers stream ``--tokens``-token generate requests through the global endpoint, over
V2 ``ModelStreamInfer`` (raw bytes: the client costs little) and over the OpenAI
edge's SSE, at a low and a high number of concurrent streams, ``--seconds`` each.

Measured per load: CPU seconds (utime + stime from /proc, every thread) of every
process of the front — global, regional, local and Redis; the emulated GPUs apart —
divided by the requests finished and by the output tokens they carried; messages the
caller received per request (fewer than tokens once the relay coalesces).

Variants, in one run, one after the other on the same machine:

* ``before``: the code at ``--before`` (a git worktree of that commit);
* ``after``: the code at ``--after`` (default HEAD: committed code, a worktree too),
  ``limits.stream_coalesce_ms`` 0 (coalescing only while a writer is busy);
* ``after+window``: the same with ``stream_coalesce_ms`` ``--window-ms`` (50: about five
  tokens at the emulated GPUs' 100 tokens/s per stream).

Each variant runs in a child process of its own (``--child``) whose imports and fleet
come from that variant's tree. Every figure is a median over ``--rounds`` windows.

    .venv/bin/python -m bench.stream_cost              # writes results/stream_cost.{json,md}
    .venv/bin/python -m bench.stream_cost --seconds 5 --rounds 1 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml

from bench.hop_cost import MODEL, REGION, TENANT, ZONE, cpu_seconds
from bench.hop_cost import fleet_spec as hop_fleet_spec
from cli.launcher import Fleet
from common.gen.inference import grpc_service_pb2 as pb
from common.request.v2 import generate_request

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
# The commit before the coalescing relay: the "before" of the recorded results.
DEFAULT_BEFORE = "6da686a"
FRONT = ("global", f"regional-{REGION}", f"local-{ZONE}", "redis")


def fleet_spec(gpus: int, time_scale: float, window_ms: float | None) -> dict[str, Any]:
    """``bench.hop_cost``'s one-zone demo fleet, with the OpenAI edge on a free port and
    the stream coalescing window ``window_ms`` (None: the key left out)."""
    spec = hop_fleet_spec(gpus, time_scale)
    spec["global"]["openai_listen"] = "127.0.0.1:0"
    if window_ms is not None:
        spec["limits"] = {"stream_coalesce_ms": window_ms}
    return spec


class Tally:
    """What the callers of one window got."""

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0
        self.messages = 0
        self.errors = 0
        self.first_error = ""

    def failed(self, what: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or what


async def v2_caller(
    channel: grpc.aio.Channel, key: str, tokens: int, stop: float, t: Tally
) -> None:
    body = generate_request(MODEL, "hello there", tokens, stream=True).SerializeToString()
    call = channel.stream_stream(STREAM)
    while time.monotonic() < stop:
        got = messages = 0
        try:
            async for raw in call(iter((body,)), metadata=(("authorization", key),), timeout=30):
                response = pb.ModelStreamInferResponse.FromString(raw)
                if response.error_message:
                    raise RuntimeError(response.error_message)
                messages += 1
                got = response.infer_response.parameters["completion_tokens"].int64_param
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            t.failed(str(exc)[:200])
            await asyncio.sleep(0.05)
            continue
        t.requests, t.tokens, t.messages = t.requests + 1, t.tokens + got, t.messages + messages


async def sse_caller(
    http: aiohttp.ClientSession, url: str, key: str, tokens: int, stop: float, t: Tally
) -> None:
    body = {
        "model": MODEL,
        "prompt": "hello there",
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": key}
    while time.monotonic() < stop:
        got = messages = 0
        try:
            async with http.post(f"{url}/completions", json=body, headers=headers) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        got = chunk["usage"]["completion_tokens"]
                    elif chunk["choices"] and chunk["choices"][0]["text"]:
                        messages += 1
        except (aiohttp.ClientError, RuntimeError) as exc:
            t.failed(str(exc)[:200])
            await asyncio.sleep(0.05)
            continue
        t.requests, t.tokens, t.messages = t.requests + 1, t.tokens + got, t.messages + messages


async def window(
    fleet: Fleet, pids: dict[str, int], protocol: str, streams: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One measured window of ``streams`` closed-loop callers over ``protocol``."""
    key = f"Bearer {fleet.tenant_keys[TENANT]}"
    tally = Tally()
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    started = time.monotonic()
    stop = started + args.seconds
    if protocol == "v2":
        async with grpc.aio.insecure_channel(fleet.global_address) as channel:
            await asyncio.gather(
                *(v2_caller(channel, key, args.tokens, stop, tally) for _ in range(streams))
            )
    else:
        url = fleet.openai_url
        assert url is not None
        limit = aiohttp.TCPConnector(limit=streams)
        async with aiohttp.ClientSession(connector=limit) as http:
            await asyncio.gather(
                *(sse_caller(http, url, key, args.tokens, stop, tally) for _ in range(streams))
            )
    wall = time.monotonic() - started
    cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    front = sum(cpu[name] for name in FRONT)
    done = max(tally.requests, 1)
    return {
        "protocol": protocol,
        "streams": streams,
        "wall_s": wall,
        "requests": tally.requests,
        "tokens": tally.tokens,
        "errors": tally.errors,
        "first_error": tally.first_error,
        "messages_per_request": tally.messages / done,
        "tokens_per_request": tally.tokens / done,
        "cpu_s": cpu,
        "front_ms_per_request": 1000 * front / done,
        "front_us_per_token": 1e6 * front / max(tally.tokens, 1),
        "front_cores": front / wall,
    }


async def measure(fleet: Fleet, args: argparse.Namespace) -> list[dict[str, Any]]:
    procs = {name: proc.process for name, proc in fleet.processes.items()}
    pids = {name: p.pid for name, p in procs.items() if p is not None}
    assert fleet.redis is not None and fleet.redis.process is not None
    pids["redis"] = fleet.redis.process.pid
    out = []
    for protocol in args.protocols.split(","):
        for streams in (args.low, args.high):
            await window(
                fleet, pids, protocol, streams, argparse.Namespace(**{**vars(args), "seconds": 1.0})
            )  # warm: connections, caches
            for r in range(args.rounds):
                result = await window(fleet, pids, protocol, streams, args)
                result["round"] = r
                print(json.dumps(result), file=sys.stderr, flush=True)
                out.append(result)
    return out


def child(args: argparse.Namespace) -> None:
    """Run one variant's fleet and windows; the result as JSON on stdout's last line."""
    with tempfile.TemporaryDirectory(prefix="stream-cost-") as tmp:
        spec = fleet_spec(args.gpus, args.time_scale, args.window_ms)
        path = Path(tmp) / "fleet.yaml"
        path.write_text(yaml.safe_dump(spec))
        fleet = Fleet(path, Path(tmp) / "run")
        try:
            fleet.start(timeout_s=90)
            results = asyncio.run(measure(fleet, args))
        finally:
            fleet.stop()
    print(json.dumps(results))


def run_variant(
    name: str, tree: Path, window_ms: float | None, args: argparse.Namespace
) -> list[dict[str, Any]]:
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--gpus",
        str(args.gpus),
        "--time-scale",
        str(args.time_scale),
        "--tokens",
        str(args.tokens),
        "--seconds",
        str(args.seconds),
        "--rounds",
        str(args.rounds),
        "--low",
        str(args.low),
        "--high",
        str(args.high),
        "--protocols",
        args.protocols,
    ]
    if window_ms is not None:
        argv += ["--window-ms", str(window_ms)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    print(f"== {name} ({tree})", file=sys.stderr, flush=True)
    done = subprocess.run(
        argv,
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        check=True,
        timeout=60 + 12 * args.rounds * args.seconds * 4,
    )
    results: list[dict[str, Any]] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    for r in results:
        r["variant"] = name
    return results


def _git(*argv: str) -> str:
    return subprocess.run(
        ["git", *argv], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--before", default=DEFAULT_BEFORE)
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--window-ms", type=float, default=None)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=5.0)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--low", type=int, default=2)
    parser.add_argument("--high", type=int, default=24)
    parser.add_argument("--protocols", default="v2,sse")
    parser.add_argument("--variants", default="before,after,after+window")
    parser.add_argument("--no-write", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    from bench.stream_cost_report import markdown, summarise  # the parent's alone

    window_ms = 50.0 if args.window_ms is None else args.window_ms
    load_start = os.getloadavg()[0]
    results: list[dict[str, Any]] = []
    wanted = args.variants.split(",")
    with tempfile.TemporaryDirectory(prefix="stream-cost-trees-") as tmp:
        trees = {"before": Path(tmp) / "before", "after": Path(tmp) / "after"}
        for which, rev in (("before", args.before), ("after", args.after)):
            _git("worktree", "add", "--detach", str(trees[which]), rev)
        try:
            for name, tree, ms in (
                ("before", trees["before"], None),
                ("after", trees["after"], 0.0),
                ("after+window", trees["after"], window_ms),
            ):
                if name in wanted:
                    results += run_variant(name, tree, ms, args)
        finally:
            for tree in trees.values():
                _git("worktree", "remove", "--force", str(tree))
    result = {
        "machine": {
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_start": round(load_start, 2),
            "load_end": round(os.getloadavg()[0], 2),
            "commit": _git("rev-parse", "--short", "HEAD"),
            "dirty": bool(_git("status", "--porcelain", "--", "common", "bench")),
        },
        "before": args.before,
        "after": _git("rev-parse", "--short", args.after),
        "window_ms": window_ms,
        "command": "python -m bench.stream_cost " + " ".join(sys.argv[1:]),
        "args": vars(args),
        "rows": summarise(results),
        "windows": results,
    }
    text = markdown(result)
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "stream_cost.json").write_text(json.dumps(result, indent=1) + "\n")
        (RESULTS / "stream_cost.md").write_text(text)


if __name__ == "__main__":
    main()
