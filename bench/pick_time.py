"""How long one local-tier pick takes as the zone grows (a benchmark, not a test).

For each fleet size N it builds one ``LocalView`` of N GPUs (mixed hardware,
16 slots each, random moderate load, some load reports stale), fills the
prefix index with realistic traffic (50 shared 256-token system prompts, each
request adding its own user blocks), and times ``picker.rank(...)`` on the
model's free pool with ``time.perf_counter_ns`` — exactly the call the
balancer makes per attempt. The state is not changed between picks, so only
the picker's own cost is measured.

    .venv/bin/python -m bench.pick_time            # full run, writes bench/results/
    .venv/bin/python -m bench.pick_time --picks 2000 --sizes 64,1024 --no-write
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.report import machine
from common.basics.vocabulary import Priority
from common.config.gpu import HARDWARE_SPEED
from common.config.node import Endpoint
from common.request.pick import PickRequest
from common.request.prefix import BLOCK_TOKENS
from local_lb.load_book import LoadSample
from local_lb.policies import make_picker
from local_lb.state import GpuChild, LocalView

MODEL = "bench-llm"
SLOTS = 16
A100_WORK_PER_S = 2000.0  # as local_lb.server seeds each GPU's rate
SYSTEM_PROMPTS = 50
SYSTEM_BLOCKS = 256 // BLOCK_TOKENS  # 16 blocks
USER_BLOCKS = 8  # a 128-token user turn after the system prompt
WARM_REQUESTS = 20_000  # past requests recorded into the prefix index
SESSIONS = 2_000
SESSION_SHARE = 0.3
SIZES = (64, 256, 1024, 4096)
POLICIES = ("default", "least_connections", "sglang_cache_aware")
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Cell:
    n_gpus: int
    policy: str
    picks: int
    median_us: float
    p99_us: float
    mean_us: float


def build_view(n: int, rng: random.Random) -> LocalView:
    """N GPUs with moderate load, ~10% of them full (out of the free pool)."""
    hardware = list(HARDWARE_SPEED)
    gpus = []
    for i in range(n):
        hw = rng.choice(hardware)
        speed = HARDWARE_SPEED[hw] * rng.choice((1.0, 1.0, 1.0, 0.8))  # some throttled
        gpu = GpuChild(
            name=f"gpu-{i:05d}",
            endpoint=Endpoint("127.0.0.1", 1),
            models=frozenset({MODEL}),
            speed=speed,
            hardware=hw,
            slots=SLOTS,
            rate=speed * A100_WORK_PER_S * rng.uniform(0.8, 1.2),
        )
        gpu.outstanding_requests = SLOTS if rng.random() < 0.1 else rng.randint(0, 12)
        gpu.outstanding_work = gpu.outstanding_requests * rng.uniform(150, 600)
        gpu.latency_ewma_s = rng.uniform(0.5, 4.0)
        gpus.append(gpu)
    view = LocalView(gpus=tuple(gpus))
    view.inflight_total = sum(g.outstanding_requests for g in gpus)
    for gpu in gpus:
        if rng.random() < 0.8:  # a fresh report (picks run at now=1.0); the rest are unknown
            running = min(gpu.outstanding_requests + rng.randint(0, 4), SLOTS)
            sample = LoadSample(running, rng.randint(0, 3), 0.5, taken_at=0.0, source="metrics")
            view.load.update(gpu.name, sample)
    return view


def traffic(rng: random.Random, count: int) -> list[PickRequest]:
    """Requests: one of the shared system prompts, then a user turn of its own."""
    systems = [[rng.getrandbits(64) for _ in range(SYSTEM_BLOCKS)] for _ in range(SYSTEM_PROMPTS)]
    requests = []
    for _ in range(count):
        system = rng.choice(systems)
        user = [rng.getrandbits(64) for _ in range(USER_BLOCKS)]
        session = f"s{rng.randrange(SESSIONS)}" if rng.random() < SESSION_SHARE else None
        prompt = (SYSTEM_BLOCKS + USER_BLOCKS) * BLOCK_TOKENS + rng.randrange(BLOCK_TOKENS)
        requests.append(
            PickRequest(
                model=MODEL,
                version="",
                origin=None,
                session=session,
                priority=Priority.STANDARD,
                prompt_tokens=prompt,
                max_tokens=rng.choice((64, 128, 256, 512)),
                prefix_blocks=(*system, *user),
            )
        )
    return requests


def warm_prefix_index(view: LocalView, history: list[PickRequest], rng: random.Random) -> None:
    for request in history:
        view.prefix.record(request.prefix_blocks, rng.choice(view.gpus).name)


def time_policy(
    policy: str, view: LocalView, requests: list[PickRequest], budget_s: float, rng: random.Random
) -> Cell:
    picker = make_picker(policy, view, rng)
    pool = view.free[MODEL]
    now = 1.0
    for request in requests[:200]:  # warm-up, not recorded
        picker.rank(request, pool, now)
    gc.collect()
    samples: list[int] = []
    deadline = time.perf_counter() + budget_s
    clock = time.perf_counter_ns
    for i, request in enumerate(requests):
        start = clock()
        picker.rank(request, pool, now)
        samples.append(clock() - start)
        if i % 256 == 255 and time.perf_counter() > deadline:
            break
    samples.sort()
    return Cell(
        n_gpus=len(view.gpus),
        policy=policy,
        picks=len(samples),
        median_us=statistics.median(samples) / 1000,
        p99_us=samples[min(len(samples) - 1, int(0.99 * len(samples)))] / 1000,
        mean_us=statistics.fmean(samples) / 1000,
    )


def markdown(cells: list[Cell], info: dict[str, str | int | None], ratio: float | None) -> str:
    lines = [
        "# Local pick time",
        "",
        f"{info['date']} · {info['cpu']} · nproc {info['nproc']} · "
        f"{info['implementation']} {info['python']} · {info['platform']}",
        "",
        "One `picker.rank(request, view.free[model], now)` call, µs "
        "(16 slots per GPU, mixed V100/A100/H100/H200, ~10% of GPUs full, 50 shared "
        "256-token system prompts + 128-token user turns, 30% of requests with a session). "
        "The baselines are this repo's Python re-implementations (O(pool) per pick), not the "
        "original systems' code; a cell stops early after its time budget (see picks).",
        "",
        "| GPUs | policy | picks | median µs | P99 µs | mean µs |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for c in cells:
        lines.append(
            f"| {c.n_gpus} | {c.policy} | {c.picks} | {c.median_us:.1f} | {c.p99_us:.1f} "
            f"| {c.mean_us:.1f} |"
        )
    if ratio is not None:
        lines += [
            "",
            f"Default policy, median at the largest N / median at the smallest: **{ratio:.2f}**",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--picks", type=int, default=20_000, help="most timed picks per cell")
    parser.add_argument("--budget-s", type=float, default=5.0, help="most seconds per cell")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    policies = args.policies.split(",")

    cells: list[Cell] = []
    for n in sizes:
        rng = random.Random(args.seed)
        view = build_view(n, rng)
        warm_prefix_index(view, traffic(rng, WARM_REQUESTS), rng)
        requests = traffic(rng, args.picks)
        for policy in policies:
            cell = time_policy(policy, view, requests, args.budget_s, random.Random(args.seed))
            cells.append(cell)
            print(
                f"N={n:5d} {policy:20s} picks={cell.picks:6d} median={cell.median_us:8.1f}µs "
                f"p99={cell.p99_us:8.1f}µs",
                flush=True,
            )

    default = {c.n_gpus: c.median_us for c in cells if c.policy == "default"}
    ratio = default[max(default)] / default[min(default)] if len(default) > 1 else None
    info = machine()
    table = markdown(cells, info, ratio)
    print()
    print(table)
    if args.no_write:
        return
    RESULTS.mkdir(exist_ok=True)
    payload = {
        "benchmark": "pick_time",
        "machine": info,
        "cells": [asdict(c) for c in cells],
        "default_median_ratio_largest_vs_smallest": ratio,
    }
    (RESULTS / "pick_time.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS / "pick_time.md").write_text(table)
    print(f"wrote {RESULTS / 'pick_time.json'} and {RESULTS / 'pick_time.md'}")


if __name__ == "__main__":
    main()
