"""The Markdown report of bench.tracing_overhead."""

from __future__ import annotations

from typing import Any

from bench.tracing_hooks import POSITIONS

# Windows: tracing off, off again on a second tier (how far two identical tiers lie
# apart in a run: the floor under the others), every request traced, the default.
MODES = ("off", "off, again", "on", "10%")
HOOK_MODES = ("off", "on", "10%")


def window_rows(r: dict[str, Any]) -> str:
    rps, cpu = r["runs_rps"], r["runs_cpu_us"]
    lines = []
    for i in range(len(rps["off"])):
        cells = " | ".join(f"{rps[m][i]:.0f} / {cpu[m][i]:.0f}" for m in MODES)
        lines.append(f"| {i + 1} | {cells} |")
    rps_m, cpu_m = r["median_rps"], r["median_cpu_us"]
    medians = " | ".join(f"**{rps_m[m]:.0f} / {cpu_m[m]:.0f}**" for m in MODES)
    lines.append(f"| **median** | {medians} |")
    return "\n".join(lines)


def _pct(figure: dict[str, float]) -> str:
    return f"{figure['median']:.1f} % ± {figure['stderr']:.1f}"


def paired_rows(r: dict[str, Any]) -> str:
    lost, added = r["paired_rps_lost_pct"], r["paired_cpu_added_pct"]
    apart = r["untraced_apart_pct"]
    return "\n".join(
        [
            f"| a second untraced tier (the noise floor) | {_pct(apart['rps'])} "
            f"| {_pct(apart['cpu'])} |",
            f"| every request traced | {_pct(lost['on'])} | {_pct(added['on'])} |",
            f"| the default, 1 in 10 | {_pct(lost['10%'])} | {_pct(added['10%'])} |",
        ]
    )


def hook_rows(r: dict[str, Any]) -> str:
    hooks, chain = r["hooks_us"], r["hooks_chain_us"]
    lines = [
        f"| {position} | " + " | ".join(f"{hooks[m][position]:.1f}" for m in HOOK_MODES) + " |"
        for position in POSITIONS
    ]
    chained = " | ".join(f"{chain[m]:.1f}" for m in HOOK_MODES)
    lines.append(f"| chain of three tiers | {chained} |")
    return "\n".join(lines)


def markdown(r: dict[str, Any]) -> str:
    p, m = r["params"], r["machine"]
    chain, cpu = r["hooks_chain_us"], r["median_cpu_us"]
    cpu_off = (cpu["off"] + cpu["off, again"]) / 2
    edge_added = r["hooks_us"]["10%"]["edge"] - r["hooks_us"]["off"]["edge"]
    chain_added = chain["10%"] - chain["off"]
    return f"""# Tracing overhead: a local tier with tracing off, every request traced, 1 in 10

`python -m bench.tracing_overhead` ({m["nproc"]} CPUs, Python {m["python"]}, {m["date"]},
commit {r["revision"]["commit"]}{" with changes" if r["revision"]["dirty"] else ""}).

**Windows.** One process: {p["gpus"]} emulated A100s at time scale {p["time_scale"]} (the
router is the bottleneck), and a local tier per mode over them, all four serving at once; a
closed loop of {p["concurrency"]} clients sends 1-token generate requests to one tier for
{p["seconds"]} s, then to the next, {p["runs"]} rounds, every other round backwards.
*Off* = the proxy's default no-op tracer; *off, again* = the same on a second tier (how
far two identical tiers lie apart in this run). *On* = `setup_tracing` with
`OTEL_TRACES_SAMPLER=parentbased_always_on` and the in-memory span ring: 3 spans per
request (server, pick, attempt), W3C context injected into every GPU call. *10 %* =
`setup_tracing` with no sampler variable: Meridian's default, 1 in 10
(`parentbased_traceidratio` at 0.1). Each cell: requests/s / the process's CPU µs per
request (client, tier and GPUs, every thread).

| round | off | off, again | on | 10 % |
|---|---|---|---|---|
{window_rows(r)}

Each traced window against the mean of the two untraced windows of its round, and the
second untraced window against the first: the median over the rounds ± its standard error
(1.2533 σ/√n), which is how finely this run can tell:

| mode | requests/s lost | CPU per request added |
|---|---|---|
{paired_rows(r)}

**Tracing's own code** (`bench/tracing_hooks.py`): µs of CPU per request for the tracing
calls a tier makes (server span, `pick` span, attempt span, context into the child's
metadata, spans ended), with the same providers, medians of {p["hook_rounds"]} interleaved
rounds of {p["hook_requests"]} requests. *Off* makes the same calls against the no-op
tracer (a tier with tracing off skips them altogether). The chain's row is the edge plus
two tiers below it, each traced when the edge traced the request.

| position | off | on | 10 % |
|---|---|---|---|
{hook_rows(r)}

At the default sampler tracing's own code adds **{edge_added:.0f} µs** per request to a
tier at the edge, **{100 * edge_added / cpu_off:.1f} %** of the CPU per request of the
untraced windows above (which also hold the clients' and GPUs' CPU, so the share of the tier's
own CPU is larger, and of a chain's smaller), and **{chain_added:.0f} µs** to a request
through a chain of three tiers. Not in these figures: gRPC and Meridian handling the
`traceparent` header itself on each call (the windows hold it).
"""
