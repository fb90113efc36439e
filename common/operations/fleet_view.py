"""The whole fleet seen from the global tier: what the dashboard and ``meridian top`` show.

The global process holds the full topology, which names every tier's ops address,
so its ops server can answer for the fleet. ``FleetView`` adds to it:

* ``/api/fleet``: regions → zones → GPUs with health, utilisation, queues and
  in-flight requests, merged from the global's own view of its regions and each
  regional and local tier's ``/api/state``; ``?region=R`` or ``?zone=Z`` cuts it
  to that region or zone (404 when the topology has none of that name);
* ``/api/fleet/overview``: what the dashboard draws, compact at any fleet size:
  aggregates per region and zone, and one packed heat-map cell per GPU
  (``common.operations.fleet_overview``);
* ``/api/fleet/traces``: the newest traces with every tier's spans
  (``common.observability.trace_view``), each marked ``complete`` unless a tier it passed through
  did not answer (its spans may then be missing);
* ``/`` and ``/dashboard``: the live dashboard page (``dashboard.html``, one static
  file, no build step, nothing loaded from elsewhere).

Merging the answers into one fleet is pure and lives in ``common.operations.fleet_merge``.

Inner tiers are asked concurrently, at the ops address the topology names (one
bound to a wildcard such as ``0.0.0.0`` over loopback), with a short timeout. A tier
that does not answer in time, or answers something that is not its ``/api/state``,
is shown as unreachable (its GPUs as unknown, taken from the topology), never
failing the whole answer; a field of the wrong type reads as unknown. With
``auth.enabled`` on, the viewer's ``Authorization`` header (its operator key, which
the global's ops server has just accepted: ``common.operations.ops_access``) goes on
to the inner tiers, which check it against the same ``auth.operator_key_sha256``;
the global holds no key of its own. Answers are
shared for ``max_age_s``, so many open dashboards cost the inner tiers no more than
one; a computation that fails is not shared, the next viewer starts a new one.
"""

from __future__ import annotations

import asyncio
import functools
import json
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
from common.operations.fleet_merge import Fetched, merge_fleet
from common.operations.fleet_overview import overview as compact_overview
from common.operations.fleet_overview import part
from common.operations.ops_http import OpsServer

DASHBOARD_HTML = Path(__file__).with_name("dashboard.html")
_DUMPS = functools.partial(json.dumps, separators=(",", ":"))
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


class FleetView:
    """The global ops server's fleet endpoints: an extension of its ``OpsServer``, which
    hands itself over when it builds its app (``install``), so the fleet view reads the
    global tier's own state and traces from it."""

    def __init__(
        self,
        topology: Topology,
        *,
        timeout_s: float = 0.8,
        max_age_s: float = 0.5,
    ) -> None:
        self.topology = topology
        self.ops: OpsServer | None = None
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

    def install(self, app: web.Application, ops: OpsServer) -> None:
        self.ops = ops
        app.router.add_get("/", self._page)
        app.router.add_get("/dashboard", self._page)
        app.router.add_get("/api/fleet", self._fleet)
        app.router.add_get("/api/fleet/overview", self._overview)
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

    async def _get(
        self, target: OpsTarget, path: str, listed: str, authorization: str | None = None
    ) -> Fetched:
        """``target``'s JSON answer at ``path``: an object with a list under ``listed``
        (``children``, ``traces``), or why there is none. ``authorization`` is sent as
        the ``Authorization`` header (the viewer's operator key)."""
        headers = {} if authorization is None else {"Authorization": authorization}
        url = f"http://{target.address}{path}"
        try:
            async with self._client().get(url, headers=headers) as reply:
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

    async def fleet(self, authorization: str | None = None) -> dict[str, Any]:
        answers = await asyncio.gather(
            *(self._get(t, "/api/state", "children", authorization) for t in self.targets)
        )
        fetched = {t.label: a for t, a in zip(self.targets, answers, strict=True)}
        assert self.ops is not None, "installed on an ops server"
        return merge_fleet(self.topology, self.ops.state(), fetched)

    async def traces(self, limit: int, authorization: str | None = None) -> dict[str, Any]:
        # Only traces whose global server span has ended: it ends last, so the request
        # is over and every tier below has its spans in its ring.
        assert self.ops is not None, "installed on an ops server"
        own = self.ops.traces(2 * limit)
        own["traces"] = [t for t in own["traces"] if any(_is_global(s) for s in t["spans"])][:limit]
        ids = [t["trace_id"] for t in own["traces"]]
        sources: list[tuple[str, Mapping[str, Any]]] = [("global", own)]
        silent: set[str] = set()  # inner tiers that did not answer
        if ids:
            query = f"/api/traces?limit={len(ids)}&ids={','.join(ids)}"
            answers = await asyncio.gather(
                *(self._get(t, query, "traces", authorization) for t in self.targets)
            )
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

    async def overview(self, authorization: str | None = None) -> dict[str, Any]:
        fleet = await self._shared_answer("fleet", lambda: self.fleet(authorization))
        return compact_overview(fleet)

    # Answers are shared between viewers whatever key each presented: every one of
    # them has passed the same operator-key check before reaching these handlers.
    async def _fleet(self, request: web.Request) -> web.Response:
        authorization = request.headers.get("Authorization")
        body = await self._shared_answer("fleet", lambda: self.fleet(authorization))
        region, zone = request.query.get("region"), request.query.get("zone")
        if region is not None or zone is not None:
            cut = part(body, region=region, zone=zone)
            if cut is None:
                wanted = f"zone {zone!r}" if zone is not None else f"region {region!r}"
                return web.json_response({"error": f"the fleet has no {wanted}"}, status=404)
            body = cut
        return _compact_json(body)

    async def _overview(self, request: web.Request) -> web.Response:
        authorization = request.headers.get("Authorization")
        body = await self._shared_answer("overview", lambda: self.overview(authorization))
        return _compact_json(body)

    async def _traces(self, request: web.Request) -> web.Response:
        try:
            limit = max(1, min(100, int(request.query.get("limit", "20"))))
        except ValueError:
            return web.json_response({"error": "limit must be an integer"}, status=400)
        authorization = request.headers.get("Authorization")
        body = await self._shared_answer(
            f"traces:{limit}", lambda: self.traces(limit, authorization)
        )
        return web.json_response(body)

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self._html,
            content_type="text/html",
            charset="utf-8",
            headers={"Cache-Control": "no-cache"},
        )


def _compact_json(body: dict[str, Any]) -> web.Response:
    """``body`` as JSON without spaces, gzip- or deflate-encoded when the client accepts
    it (aiohttp reads Accept-Encoding; a browser asks, ``meridian top`` does not): JSON
    this repetitive shrinks several-fold."""
    response = web.json_response(body, dumps=_DUMPS)
    response.enable_compression()
    return response


def _is_global(span: Mapping[str, Any]) -> bool:
    return bool(span.get("attributes", {}).get(tm.TIER) == "global")
