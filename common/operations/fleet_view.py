"""The whole fleet seen from the global tier: what the dashboard and ``meridian top`` show.

The global process holds the full topology, which names every tier's ops address,
so its ops server can answer for the fleet. ``FleetView`` adds to it:

* ``/api/fleet``: regions → zones → GPUs with health, utilisation, queues and
  in-flight requests, merged from the global's own view of its regions and each
  regional and local tier's ``/api/state``;
* ``/api/fleet/traces``: the newest traces with every tier's spans
  (``common.observability.trace_view``), each marked ``complete`` unless a tier it passed through
  did not answer (its spans may then be missing);
* ``/`` and ``/dashboard``: the live dashboard page (``dashboard.html``, one static
  file, no build step, nothing loaded from elsewhere).

Inner tiers are asked concurrently, at the ops address the topology names (one
bound to a wildcard such as ``0.0.0.0`` over loopback), with a short timeout. A tier
that does not answer in time, or answers something that is not its ``/api/state``,
is shown as unreachable (its GPUs as unknown, taken from the topology), never
failing the whole answer; a field of the wrong type reads as unknown. Answers are
shared for ``max_age_s``, so many open dashboards cost the inner tiers no more than
one; a computation that fails is not shared, the next viewer starts a new one.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from common.config.node import Endpoint
from common.config.topology import Topology
from common.observability import tracing as tm
from common.observability.trace_view import merge_traces, passed_through, recent_traces
from common.operations.ops_http import OpsServer

DASHBOARD_HTML = Path(__file__).with_name("dashboard.html")
_WILDCARD = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "[::1]", "": "127.0.0.1"}


def reachable_address(endpoint: Endpoint) -> str:
    """``host:port`` to call a listener at: a wildcard bind is reached over loopback."""
    return Endpoint(_WILDCARD.get(endpoint.host, endpoint.host), endpoint.port).address


@dataclass(frozen=True)
class OpsTarget:
    """An inner tier with an ops endpoint: ``kind`` regional or local."""

    kind: str
    region: str
    name: str
    address: str

    @property
    def label(self) -> str:
        return f"{self.kind} {self.name}"


def ops_targets(topology: Topology) -> list[OpsTarget]:
    """Every regional and local tier of ``topology`` that serves ops HTTP."""
    out = []
    for region in topology.regions:
        if region.ops is not None:
            address = reachable_address(region.ops)
            out.append(OpsTarget("regional", region.name, region.name, address))
        for zone in region.zones:
            if zone.ops is not None:
                out.append(OpsTarget("local", region.name, zone.name, reachable_address(zone.ops)))
    return out


@dataclass
class Fetched:
    """One tier's answer, or why there is none."""

    body: dict[str, Any] | None
    error: str = ""


# Another process's answer, read field by field: a wrong type reads as unknown.
def _number(value: Any) -> int | float | None:
    """A finite number (JSON's NaN and Infinity would not survive the answer), or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if math.isfinite(value) else None


def _count(value: Any) -> int:
    """A count as protobuf JSON writes it (a number, or a string for 64-bit); 0 if not."""
    try:
        return int(value) if isinstance(value, int | float | str) else 0
    except (ValueError, OverflowError):
        return 0


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _capacity(summary: Any) -> dict[str, Any]:
    """Slots, busy slots, queue and utilisation summed over a summary's models
    (``MessageToDict`` names, zero fields omitted)."""
    if not summary or not isinstance(summary, dict):
        return {"utilisation": None, "queued": None, "slots": None, "healthy_gpus": None}
    slots = busy = queued = healthy = 0
    models = summary.get("models")
    for model in models if isinstance(models, list) else ():
        model = _mapping(model)
        slots += _count(model.get("totalSlots"))
        busy += _count(model.get("busySlots"))
        queued += _count(model.get("queuedRequests"))
        healthy = max(healthy, _count(model.get("healthyGpus")))
    return {
        "utilisation": busy / slots if slots else 0.0,
        "queued": queued,
        "slots": slots,
        "healthy_gpus": healthy,
    }


def _gpu_state(gpu: Mapping[str, Any]) -> str:
    if not gpu.get("healthy"):
        return "down"
    if gpu.get("ejected"):
        return "ejected"
    if gpu.get("drained"):
        return "drained"
    return "ok"


def _gpu(
    cfg_name: str, hardware: str, slots: int, live: Mapping[str, Any] | None
) -> dict[str, Any]:
    if live is None:
        return {"name": cfg_name, "hardware": hardware, "slots": slots, "state": "unknown"}
    slots = _count(live.get("slots")) or slots
    outstanding = max(0, _count(live.get("outstanding_requests")))
    reported = _mapping(live.get("reported"))
    out = {
        "name": cfg_name,
        "hardware": _text(live.get("hardware")) or hardware,
        "slots": slots,
        "state": _gpu_state(live),
        "healthy": bool(live.get("healthy")),
        "outstanding": outstanding,
        "utilisation": min(1.0, outstanding / slots) if slots > 0 else 0.0,
        "running": _number(reported.get("running")),
        "waiting": _number(reported.get("waiting")),
        "kv_cache_usage": _number(reported.get("kv_cache_usage")),
        "last_error": _text(live.get("last_error")),
    }
    # Set by the admin API when present.
    if "drained" in live:
        out["drained"] = bool(live["drained"])
    if _number(live.get("weight")) is not None:
        out["weight"] = live["weight"]
    return out


def _children(state: Fetched | None) -> dict[str, dict[str, Any]]:
    """An answer's children by name (``_get`` checked that ``children`` is a list)."""
    if state is None or state.body is None:
        return {}
    return {
        c["name"]: c
        for c in state.body["children"]
        if isinstance(c, dict) and isinstance(c.get("name"), str)
    }


def _queue(state: Fetched | None) -> dict[str, int] | None:
    """A local tier's queue by priority, or None when it did not say (or said nonsense)."""
    queue = (state.body or {}).get("queue") if state is not None else None
    if not isinstance(queue, dict) or any(_number(v) is None for v in queue.values()):
        return None
    return {k: _count(v) for k, v in queue.items()}


def _seen(child: Mapping[str, Any]) -> dict[str, Any]:
    """What a tier says of one of its children (a region or a zone)."""
    return {
        "healthy": _flag(child.get("healthy")),
        "drained": _flag(child.get("drained")),
        "last_error": _text(child.get("last_error")),
        "outstanding": _number(child.get("outstanding_requests")),
        "summary_age_s": _number(child.get("summary_age_s")),
        **_capacity(child.get("summary")),
    }


def merge_fleet(
    topology: Topology, own: Mapping[str, Any], fetched: Mapping[str, Fetched]
) -> dict[str, Any]:
    """Regions → zones → GPUs from the global's own state and each inner tier's
    (``fetched`` by ``OpsTarget.label``); the topology fills in what no tier said."""
    regions_seen = {c["name"]: c for c in own.get("children", ())}
    regions = []
    totals = {"gpus": 0, "gpus_ok": 0, "slots": 0, "outstanding": 0, "queued": 0}
    for region in topology.regions:
        regional = fetched.get(f"regional {region.name}")
        zones_seen = _children(regional)
        seen = regions_seen.get(region.name, {})
        zones = []
        for zone in region.zones:
            local = fetched.get(f"local {zone.name}")
            gpus_seen = _children(local)
            zone_seen = zones_seen.get(zone.name, {})
            gpus = [
                _gpu(g.name, g.hardware, g.max_concurrency, gpus_seen.get(g.name))
                for g in zone.gpus
            ]
            queue = _queue(local)
            tier_queued = sum(queue.values()) if queue is not None else None
            for g in gpus:
                totals["gpus"] += 1
                totals["gpus_ok"] += g["state"] == "ok"
                totals["slots"] += g["slots"]
                totals["outstanding"] += g.get("outstanding", 0)
                totals["queued"] += max(0, int(g.get("waiting") or 0))
            totals["queued"] += tier_queued or 0
            zones.append(
                {
                    "name": zone.name,
                    **_reach(local),
                    **_seen(zone_seen),
                    "tier_queued": tier_queued,
                    "queue": queue,
                    "gpus": gpus,
                }
            )
        regions.append(
            {
                "name": region.name,
                "location": [region.location.lat, region.location.lon],
                **_reach(regional),
                **_seen(seen),
                "zones": zones,
            }
        )
    slots = totals["slots"]
    return {
        "generated_at": time.time(),
        "global": {"name": own.get("name", "global"), "ready": own.get("ready")},
        "totals": {**totals, "utilisation": totals["outstanding"] / slots if slots else 0.0},
        "regions": regions,
    }


def _reach(state: Fetched | None) -> dict[str, Any]:
    if state is None:
        return {"reachable": None, "ready": None, "error": "no ops_listen"}
    if state.body is None:
        return {"reachable": False, "ready": None, "error": state.error}
    return {"reachable": True, "ready": _flag(state.body.get("ready")), "error": ""}


class FleetView:
    """The global ops server's fleet endpoints; ``install(app)`` adds the routes."""

    def __init__(
        self,
        topology: Topology,
        ops: OpsServer,
        *,
        timeout_s: float = 0.8,
        max_age_s: float = 0.5,
    ) -> None:
        self.topology = topology
        self.ops = ops
        self.targets = ops_targets(topology)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.max_age_s = max_age_s
        self._session: aiohttp.ClientSession | None = None
        self._shared: dict[str, tuple[float, asyncio.Task[dict[str, Any]]]] = {}
        # Read once: a missing page fails the tier's start, not a viewer later.
        self._html = DASHBOARD_HTML.read_bytes()

    def follow(self, topology: Topology) -> None:
        """Show what a reloaded topology names (the Admin API's ReloadTopology)."""
        self.topology = topology
        self.targets = ops_targets(topology)

    def install(self, app: web.Application) -> None:
        app.router.add_get("/", self._page)
        app.router.add_get("/dashboard", self._page)
        app.router.add_get("/api/fleet", self._fleet)
        app.router.add_get("/api/fleet/traces", self._traces)
        app.on_cleanup.append(self._close)

    async def _close(self, app: web.Application) -> None:
        for _, task in self._shared.values():
            task.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # created inside the running loop, on first use
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self._session

    async def _get(self, target: OpsTarget, path: str, listed: str) -> Fetched:
        """``target``'s JSON answer at ``path``: an object with a list under ``listed``
        (``children``, ``traces``), or why there is none."""
        try:
            async with self._client().get(f"http://{target.address}{path}") as reply:
                if reply.status != 200:
                    return Fetched(None, f"HTTP {reply.status}")
                body = await reply.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return Fetched(None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        if not isinstance(body, dict) or not isinstance(body.get(listed), list):
            return Fetched(None, f"malformed answer: no {listed!r} list")
        return Fetched(body)

    async def _shared_answer(
        self, key: str, make: Callable[[], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        """One computation per ``key`` every ``max_age_s``, awaited by every caller.

        A computation that fails is forgotten as it fails: its callers see the
        error, the next caller starts afresh rather than meeting the same error."""
        now = time.monotonic()
        entry = self._shared.get(key)
        if entry is None or now - entry[0] > self.max_age_s:
            entry = (now, asyncio.ensure_future(make()))
            self._shared[key] = entry
            entry[1].add_done_callback(functools.partial(self._forget_failed, key))
        return await asyncio.shield(entry[1])

    def _forget_failed(self, key: str, task: asyncio.Future[dict[str, Any]]) -> None:
        if task.cancelled() or task.exception() is not None:
            entry = self._shared.get(key)
            if entry is not None and entry[1] is task:
                del self._shared[key]

    async def fleet(self) -> dict[str, Any]:
        answers = await asyncio.gather(
            *(self._get(t, "/api/state", "children") for t in self.targets)
        )
        fetched = {t.label: a for t, a in zip(self.targets, answers, strict=True)}
        return merge_fleet(self.topology, self.ops.state(), fetched)

    async def traces(self, limit: int) -> dict[str, Any]:
        # Only traces whose global server span has ended: it ends last, so the request
        # is over and every tier below has its spans in its ring.
        own = self.ops.traces(2 * limit)
        own["traces"] = [t for t in own["traces"] if any(_is_global(s) for s in t["spans"])][:limit]
        ids = [t["trace_id"] for t in own["traces"]]
        sources: list[tuple[str, Mapping[str, Any]]] = [("global", own)]
        silent: set[str] = set()  # inner tiers that did not answer
        if ids:
            query = f"/api/traces?limit={len(ids)}&ids={','.join(ids)}"
            answers = await asyncio.gather(*(self._get(t, query, "traces") for t in self.targets))
            for target, answer in zip(self.targets, answers, strict=True):
                if answer.body is not None:
                    sources.append((target.label, answer.body))
                else:
                    silent.add(target.name)
        merged = merge_traces(sources)
        merged = {tid: merged[tid] for tid in ids if tid in merged}
        traces = recent_traces(merged, limit)
        for trace in traces:
            trace["complete"] = not passed_through(trace) & silent
        body: dict[str, Any] = {"traces": traces}
        if "note" in own:
            body["note"] = own["note"]
        return body

    async def _fleet(self, request: web.Request) -> web.Response:
        return web.json_response(await self._shared_answer("fleet", self.fleet))

    async def _traces(self, request: web.Request) -> web.Response:
        try:
            limit = max(1, min(100, int(request.query.get("limit", "20"))))
        except ValueError:
            return web.json_response({"error": "limit must be an integer"}, status=400)
        body = await self._shared_answer(f"traces:{limit}", lambda: self.traces(limit))
        return web.json_response(body)

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self._html,
            content_type="text/html",
            charset="utf-8",
            headers={"Cache-Control": "no-cache"},
        )


def _is_global(span: Mapping[str, Any]) -> bool:
    return bool(span.get("attributes", {}).get(tm.TIER) == "global")


def install_fleet_view(topology: Topology, ops: OpsServer | None) -> FleetView | None:
    """Serve the fleet endpoints and the dashboard on ``ops`` (the global's), if any."""
    if ops is None:
        return None
    view = FleetView(topology, ops)
    ops.extensions.append(view.install)
    return view
