"""What admitting one request costs the edge and Redis: this checkout against others, one run.

The global tier admits every request against its tenant's limits in Redis
(``common.tenancy.admission.edge_admission``). This bench runs that admission
alone, without gRPC, so its CPU is not lost in the noise of a whole tier: one
tenant with ``max_concurrent``, ``requests_per_s`` and ``tokens_per_min`` (limits
that never bind, but are counted in Redis on every request), ``--concurrency``
callers in one event loop, each admitting a request, yielding once (the
request's work) and releasing it, for ``--seconds``. Figures per admission: CPU
of the admitting process (``time.process_time``) and of Redis (``INFO cpu``,
user + sys), and admissions per second.

Each variant (this checkout, and every ``--compare DIR``) runs in a process of
its own with its checkout first on the path and a fresh embedded Redis, rounds
interleaved (every other round backwards); medians over rounds, ratios against
the first ``--compare`` in the same run.

    .venv/bin/python -m bench.admission --compare /tmp/before      # writes results/admission.*
    .venv/bin/python -m bench.admission --rounds 1 --no-write      # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
HERE = Path(__file__).resolve()
CHECKOUT = HERE.parent.parent


async def _admissions(url: str, seconds: float, concurrency: int) -> dict[str, float]:
    """In the child, on the checkout under test: admit for ``seconds``, return the figures."""
    import redis

    from common.basics.vocabulary import Priority
    from common.config.access import AuthConfig, TenantConfig
    from common.request.pick import PickRequest
    from common.request.routing import parse_hints
    from common.tenancy.admission import edge_admission
    from common.tenancy.auth import hash_key

    key = "mk_bench"
    who = TenantConfig(
        id="bench",
        key_hashes=frozenset({hash_key(key)}),
        requests_per_s=1e6,
        tokens_per_min=1e9,
        max_concurrent=4096,
    )
    admission = edge_admission(AuthConfig(enabled=True, tenants=(who,)), url)
    await admission.start()
    metadata = [("authorization", f"Bearer {key}")]
    hints = admission.identify(metadata, parse_hints(metadata, trust_internal=False))
    pick = PickRequest("demo-llm", "", None, None, Priority.STANDARD, 10, 1)
    stats = redis.Redis.from_url(url)

    def redis_cpu() -> float:
        cpu = stats.info("cpu")
        return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])

    done = 0

    async def caller(until: float) -> None:
        nonlocal done
        while time.monotonic() < until:
            release = await admission.admit(hints, pick)
            await asyncio.sleep(0)
            release()
            done += 1

    async def window(s: float) -> None:
        until = time.monotonic() + s
        await asyncio.gather(*(caller(until) for _ in range(concurrency)))

    try:
        await window(0.5)  # connections, scripts loaded
        done = 0
        cpu, rcpu, started = time.process_time(), redis_cpu(), time.monotonic()
        await window(seconds)
        wall = time.monotonic() - started
        cpu, rcpu = time.process_time() - cpu, redis_cpu() - rcpu
    finally:
        await admission.stop()
        stats.close()
    n = max(done, 1)
    return {"per_s": done / wall, "edge_us": 1e6 * cpu / n, "redis_us": 1e6 * rcpu / n}


def _child(seconds: float, concurrency: int) -> None:
    from common.basics.redis_embed import EmbeddedRedis

    server = EmbeddedRedis()
    server.start()
    try:
        figures = asyncio.run(_admissions(server.url, seconds, concurrency))
    finally:
        server.close()
    print(json.dumps(figures))


def _run_variant(path: Path, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(path)}
    argv = [sys.executable, str(HERE), "--child", "--seconds", str(args.seconds),
            "--concurrency", str(args.concurrency)]  # fmt: skip
    out = subprocess.run(argv, cwd=path, env=env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"admission bench on {path} failed:\n{out.stderr[-2000:]}")
    figures: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return figures


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from bench.report import git_head  # here, not at the top: the child runs another checkout

    variants = [("this checkout", CHECKOUT)] + [
        (f"compared {i + 1}", Path(p).resolve()) for i, p in enumerate(args.compare)
    ]
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name, _ in variants}
    for r in range(args.rounds):
        for name, path in variants if r % 2 == 0 else variants[::-1]:
            figures = _run_variant(path, args)
            rounds[name].append(figures)
            line = f"round {r + 1} {name:14s} {figures['per_s']:7.0f}/s  edge "
            print(f"{line}{figures['edge_us']:5.0f} µs  redis {figures['redis_us']:5.0f} µs")
    rows = []
    for name, path in variants:
        med = {k: statistics.median(f[k] for f in rounds[name]) for k in rounds[name][0]}
        rows.append({"name": name, "path": str(path), "head": git_head(path), **med,
                     "rounds": rounds[name]})  # fmt: skip
    return {"rows": rows, "seconds": args.seconds, "rounds": args.rounds,
            "concurrency": args.concurrency}  # fmt: skip


def markdown(result: dict[str, Any], machine: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        "# Admission at the edge — CPU per request, this checkout against others",
        "",
        f"`python -m bench.admission` ({machine.get('nproc')} CPUs, Python "
        f"{machine.get('python')}; load average at the end {machine.get('load')}). "
        f"{result['concurrency']} callers in one event loop, {result['seconds']} s windows, "
        f"{result['rounds']} interleaved rounds, medians; one tenant with max_concurrent, "
        "requests_per_s and tokens_per_min, each variant on a fresh embedded Redis.",
        "",
        "| variant | code | admissions/s | edge CPU µs/admission | Redis CPU µs/admission |",
        "|---|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['name']} | `{row['path']}` at {row['head'].split()[0]} | {row['per_s']:.0f} | "
            f"{row['edge_us']:.0f} | {row['redis_us']:.0f} |"
        )
    if len(rows) > 1:
        base = rows[1]
        lines += ["", f"Against {base['name']} (`{base['path']}`), same run:", ""]
        for row in rows[:1] + rows[2:]:
            lines.append(
                f"- {row['name']}: edge CPU {row['edge_us'] / base['edge_us']:.2f}×, Redis CPU "
                f"{row['redis_us'] / base['redis_us']:.2f}×, admissions/s "
                f"{row['per_s'] / base['per_s']:.2f}×"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--compare", action="append", default=[], metavar="DIR",
                        help="another checkout to run beside this one (repeatable)")  # fmt: skip
    parser.add_argument("--name", default="admission", help="results file name")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.seconds, args.concurrency)
        return
    from bench.report import machine, write_json_and_markdown

    result = measure(args)
    host = machine()
    host["load"] = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    result["machine"] = host
    text = markdown(result, host)
    print(text)
    if not args.no_write:
        write_json_and_markdown(RESULTS, args.name, result, text)


if __name__ == "__main__":
    main()
