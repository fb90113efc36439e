"""The fleet as the global tier shows it: /api/fleet, /api/fleet/traces, /api/series,
the dashboard page in a real headless Chromium, and `meridian top --once`.

One fleet (2 regions x 2 zones x 1 GPU, every request traced) serves the module;
the test that kills a tier restarts it before it ends. The page's own failure
handling is tested against a stand-in server with canned answers.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli.launcher import Fleet
from common.observability.trace_view import merge_traces, recent_traces
from common.operations.fleet_overview import overview
from common.operations.fleet_view import DASHBOARD_HTML
from tests.browser import chromium, require_chromium, show_trace, wait_for
from tests.cli.test_top import FLEET
from tests.client import V2Client
from tests.common.observability.test_trace_view import one_request
from tests.conftest import small_fleet_spec, start_fleet
from tests.e2e.test_ops import get, wait_until

ROOT = Path(__file__).resolve().parents[2]
# Set to a path (e.g. docs/dashboard.png) to keep the browser test's screenshot there.
SCREENSHOT_ENV = "MERIDIAN_DASHBOARD_SCREENSHOT"
ALL_TIERS = ["global", "regional", "local"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with pytest.MonkeyPatch.context() as env:
        # Every request traced, so each test's requests show up (the default is 1 in 10).
        env.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
        env.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
        env.delenv("OTEL_SDK_DISABLED", raising=False)
        fleet = start_fleet(tmp_path_factory.mktemp("dashboard"), small_fleet_spec(2, 2, 1))
    try:
        yield fleet
    finally:
        fleet.stop()


def ops(fleet: Fleet) -> str:
    endpoint = fleet.topology.global_tier.ops
    assert endpoint is not None
    return endpoint.address


def get_json(address: str, path: str) -> dict[str, Any]:
    status, text = get(address, path)
    assert status == 200, text
    body: dict[str, Any] = json.loads(text)
    return body


def send(fleet: Fleet, n: int, geo: str = "53.35,-6.26") -> list[str]:
    """``n`` requests from ``geo``; their routes."""
    with V2Client(fleet.global_address) as client:
        return [
            client.infer(f"dashboard {i}", 3, metadata=[("x-meridian-client-geo", geo)]).route
            for i in range(n)
        ]


def gpus(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["name"]: g for r in body["regions"] for z in r["zones"] for g in z["gpus"]}


def whole_traces(address: str, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` traces, once the newest has every tier's spans.

    Each inner tier's /api/traces is asked with a short timeout; on a loaded machine
    one may answer late, and the merged trace then lacks its spans (and says so:
    ``complete`` false). Asking again a moment later gets the whole trace."""
    found: list[dict[str, Any]] = []

    def whole() -> bool:
        found[:] = get_json(address, f"/api/fleet/traces?limit={limit}")["traces"]
        return bool(found) and found[0]["complete"] and found[0]["tiers"] == ALL_TIERS

    wait_until(whole)
    return found


def test_fleet_shows_every_region_zone_and_gpu(fleet: Fleet) -> None:
    def all_ok() -> bool:
        return all(g["state"] == "ok" for g in gpus(get_json(ops(fleet), "/api/fleet")).values())

    wait_until(all_ok)
    body = get_json(ops(fleet), "/api/fleet")
    topo = fleet.topology
    assert [r["name"] for r in body["regions"]] == [r.name for r in topo.regions]
    for region, cfg in zip(body["regions"], topo.regions, strict=True):
        assert region["reachable"] is True and region["healthy"] is True
        assert [z["name"] for z in region["zones"]] == [z.name for z in cfg.zones]
        for zone in region["zones"]:
            assert zone["reachable"] is True and zone["ready"] is True
            assert set(zone["queue"]) == {"critical", "standard", "sheddable"}
    found = gpus(body)
    assert set(found) == {g.name for r in topo.regions for z in r.zones for g in z.gpus}
    for gpu in found.values():
        assert gpu["hardware"] and gpu["slots"] == 16
        assert 0.0 <= gpu["utilisation"] <= 1.0
    assert body["totals"]["gpus"] == body["totals"]["gpus_ok"] == len(found)


def test_series_and_traces_move_with_traffic(fleet: Fleet) -> None:
    address = ops(fleet)
    started = time.time()
    routes = send(fleet, 20)
    assert all(r.startswith("eu-west/") for r in routes)

    def answered_since_start() -> float:
        points = get_json(address, "/api/series")["points"]
        return sum(p["requests"] for p in points if p["t"] > started)

    wait_until(lambda: answered_since_start() >= 20)
    assert answered_since_start() == 20
    points = get_json(address, "/api/series?seconds=5")["points"]
    assert 1 <= len(points) <= 5
    keys = {"t", "requests", "errors", "rps", "errors_per_s", "p50_ms", "p90_ms", "p99_ms"}
    assert set(points[0]) == keys
    latencies = [p["p50_ms"] for p in get_json(address, "/api/series")["points"]]
    assert any(v is not None and v > 0 for v in latencies)

    traces = whole_traces(address, 5)
    assert len(traces) == 5
    assert traces == sorted(traces, key=lambda t: t["start_ns"], reverse=True)
    newest = traces[0]
    assert newest["tiers"] == ALL_TIERS
    route = newest["route"]
    assert f"{route['region']}/{route['zone']}/{route['gpu']}" in routes
    reasons = {h["tier"]: h["reason"] for h in newest["hops"]}
    assert reasons["global"] == "nearest region"
    assert reasons["regional"] and reasons["local"]
    assert {h["child"] for h in newest["hops"]} >= {route["region"], route["zone"], route["gpu"]}
    sources = {s["source"] for s in newest["spans"]}
    assert sources == {"global", f"regional {route['region']}", f"local {route['zone']}"}
    assert get(address, "/api/fleet/traces?limit=x")[0] == 400


def test_only_the_global_serves_the_dashboard(fleet: Fleet) -> None:
    status, page = get(ops(fleet), "/")
    assert status == 200 and 'id="fleet"' in page and "<script>" in page
    assert get(ops(fleet), "/dashboard")[0] == 200
    region = fleet.topology.regions[0].ops
    assert region is not None
    assert get(region.address, "/")[0] == 404
    assert get(region.address, "/api/series")[0] == 200


def test_top_once_prints_the_fleet(fleet: Fleet) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "top", "--once", "--ops", ops(fleet)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "\x1b[" not in out  # not a terminal: no colour codes
    assert "requests/s" in out and "REGION / ZONE / GPU" in out
    for region in fleet.topology.regions:
        assert region.name in out
        for zone in region.zones:
            assert zone.name in out
            for gpu in zone.gpus:
                assert any(
                    line.split()[:3] == [gpu.name, gpu.hardware, "ok"] for line in out.splitlines()
                ), out


def test_dashboard_in_headless_chromium(fleet: Fleet, tmp_path: Path) -> None:
    require_chromium()
    send(fleet, 6, geo="40.71,-74.01")
    whole_traces(ops(fleet), 25)  # and the page clicks only a complete one
    n_gpus = len(gpus(get_json(ops(fleet), "/api/fleet")))
    with chromium() as driver:
        trace_id = show_trace(driver, f"http://{ops(fleet)}/", n_gpus)
        tiles = driver.find_elements("css selector", "#fleet .gpu[data-state='ok']")
        assert len(tiles) == n_gpus
        rows = driver.find_elements("css selector", "#timeline .span-row")
        assert {r.get_attribute("data-tier") for r in rows} == set(ALL_TIERS)
        selected = driver.find_elements("css selector", "#traces tr.trace.selected")
        assert [r.get_attribute("data-trace-id") for r in selected] == [trace_id]
        # The row says why each hop chose (read in one script call: rows are re-rendered).
        row_text = driver.execute_script(
            "return document.querySelector('#traces tr.trace.selected').textContent"
        )
        listed = get_json(ops(fleet), "/api/fleet/traces?limit=25")["traces"]
        hops = next(t["hops"] for t in listed if t["trace_id"] == trace_id)
        assert all(h["reason"] and h["reason"] in row_text for h in hops), (row_text, hops)
        assert driver.find_elements("css selector", "#rate-chart polyline")
        # Live without reloading: the page keeps polling.
        polls = int(driver.find_element("tag name", "body").get_attribute("data-fleet-polls"))
        wait_until(
            lambda: (
                int(driver.find_element("tag name", "body").get_attribute("data-fleet-polls"))
                > polls + 1
            )
        )
        # A click on a zone shows its GPUs in full.
        zone = fleet.topology.regions[1].zones[0]
        driver.execute_script(
            f"document.querySelector('[data-zone=\"{zone.name}\"] .head').click()"
        )
        wait_for(driver, f"#drill[data-kind='zone'][data-name='{zone.name}'] tr.gpu-row")
        shown = driver.execute_script(
            "return [...document.querySelectorAll('#drill tr.gpu-row')].map((r) => r.dataset.gpu)"
        )
        assert shown == [g.name for g in zone.gpus]
        shot = tmp_path / "dashboard.png"
        assert driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        if os.environ.get(SCREENSHOT_ENV):
            driver.save_screenshot(os.environ[SCREENSHOT_ENV])


def test_an_unreachable_tier_is_shown_not_fatal(fleet: Fleet) -> None:
    """Last: it kills a local tier (and restarts it)."""
    zone = fleet.topology.regions[1].zones[0]
    fleet.kill(f"local-{zone.name}")
    try:

        def zone_view() -> dict[str, Any]:
            body = get_json(ops(fleet), "/api/fleet")
            return next(z for r in body["regions"] for z in r["zones"] if z["name"] == zone.name)

        wait_until(lambda: zone_view()["reachable"] is False and zone_view()["healthy"] is False)
        view = zone_view()
        assert view["error"]
        assert [g["state"] for g in view["gpus"]] == ["unknown"]
        assert [g["name"] for g in view["gpus"]] == [g.name for g in zone.gpus]
    finally:
        fleet.restart(f"local-{zone.name}")


class StandIn:
    """A stand-in for the global's ops HTTP, for the page alone: the real dashboard
    page at ``/`` and, per API path, a canned ``(status, JSON body)`` the test sets."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[int, Any]] = {}
        answers = self.answers

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = urllib.parse.urlsplit(self.path).path
                if path == "/":
                    status, body = 200, DASHBOARD_HTML.read_bytes()
                    kind = "text/html; charset=utf-8"
                else:
                    code, value = answers.get(path, (404, {"error": "no such path"}))
                    status, body, kind = code, json.dumps(value).encode(), "application/json"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/"

    def __enter__(self) -> StandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def canned_trace(complete: bool) -> dict[str, Any]:
    """One summarized trace (all three tiers), as /api/fleet/traces lists it."""
    (trace,) = recent_traces(merge_traces(one_request()), 1)
    if not complete:  # what is left when the local tier did not answer
        trace["spans"] = [s for s in trace["spans"] if s["tier"] != "local"]
        trace["hops"] = [h for h in trace["hops"] if h["tier"] != "local"]
    return {**trace, "complete": complete}


def test_page_draws_what_answered_and_says_what_did_not() -> None:
    require_chromium()
    with StandIn() as site, chromium() as driver:
        site.answers["/api/fleet/overview"] = (200, overview(FLEET))
        site.answers["/api/series"] = (500, {"error": "boom"})
        site.answers["/api/fleet/traces"] = (200, {"traces": [canned_trace(complete=False)]})
        driver.get(site.url)
        # The fleet is drawn although /api/series fails, and the status says so.
        wait_for(driver, "#fleet .gpu[data-state]", 2)
        (status,) = wait_for(driver, "#status[data-state='partial']")
        assert "api/series: HTTP 500" in status.text
        assert not driver.find_elements("css selector", "#rate-chart polyline")
        # A partial trace is listed as such; selected, it is redrawn once it is whole.
        (row,) = wait_for(driver, "#traces tr.trace[data-complete='false']")
        assert "partial" in row.text
        driver.execute_script("arguments[0].click()", row)
        partial_rows = len(wait_for(driver, "#timeline .span-row", 3))
        site.answers["/api/fleet/traces"] = (200, {"traces": [canned_trace(complete=True)]})
        site.answers["/api/series"] = (200, {"points": []})
        wait_for(driver, "#traces tr.trace.selected[data-complete='true']")
        tiers = {r.get_attribute("data-tier") for r in wait_for(driver, "#timeline .span-row")}
        assert tiers == set(ALL_TIERS)
        assert len(driver.find_elements("css selector", "#timeline .span-row")) > partial_rows
        wait_for(driver, "#status[data-state='live']")
        # Then nothing answers: the page keeps what it drew and says since when.
        for path in ("/api/fleet/overview", "/api/series"):
            site.answers[path] = (503, {"error": "gone"})
        (status,) = wait_for(driver, "#status[data-state='stale']")
        assert status.text.startswith("no answer for ") and "HTTP 503" in status.text
        assert len(driver.find_elements("css selector", "#fleet .gpu[data-state]")) == 2


def test_page_says_no_answer_when_nothing_ever_answers() -> None:
    require_chromium()
    with StandIn() as site, chromium() as driver:
        for path in ("/api/fleet/overview", "/api/series", "/api/fleet/traces"):
            site.answers[path] = (503, {"error": "starting"})
        driver.get(site.url)
        (status,) = wait_for(driver, "#status[data-state='error']")
        assert status.text.startswith("no answer: ") and "HTTP 503" in status.text
        assert "HTTP 503" in driver.find_element("id", "traces-note").text
        assert driver.find_element("tag name", "body").get_attribute("data-fleet-polls") == "0"


def test_a_drill_down_that_fails_says_why_and_closes() -> None:
    require_chromium()
    with StandIn() as site, chromium() as driver:
        site.answers["/api/fleet/overview"] = (200, overview(FLEET))
        site.answers["/api/series"] = (200, {"points": []})
        site.answers["/api/fleet/traces"] = (200, {"traces": []})
        # The zone is gone by the time it is clicked (a reloaded topology).
        site.answers["/api/fleet"] = (404, {"error": "the fleet has no zone 'eu-1a'"})
        driver.get(site.url)
        wait_for(driver, "#fleet .gpu[data-state]", 2)
        driver.execute_script("document.querySelector('[data-zone=\"eu-1a\"] .head').click()")
        wait_for(driver, "#drill .err")  # redrawn each poll: read in one script call
        note = driver.execute_script("return document.querySelector('#drill .err').textContent")
        assert "api/fleet?zone=eu-1a: HTTP 404" in note
        driver.execute_script("document.querySelector('#drill button').click()")
        wait_for(driver, "#drill[hidden]")
        assert not driver.find_elements("css selector", "#fleet .selected")
