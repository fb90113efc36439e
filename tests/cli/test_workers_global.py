"""``meridian global --workers 2`` in front of a real chain (GPU worker, local, regional):
both workers serve the V2 port and the OpenAI HTTP port, each counts its own calls on its
own ops port; the regional tier behind it runs 2 workers too, of which only one
publishes the region's summary (the global would add the same aggregate up twice)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import redis
import yaml

from cli.launcher import resolve_ports
from common.basics.redis_embed import EmbeddedRedis, free_port
from common.capacity.streams import SUMMARY_FIELD, region_stream
from common.gen.meridian.v1 import capacity_pb2
from tests.cli.conftest import Launch
from tests.cli.test_workers import MODEL, call, http_get, two_free_ports
from tests.conftest import small_fleet_spec
from tests.until import wait_until


def served(ops: int) -> float:
    status, text = http_get(f"http://127.0.0.1:{ops}/metrics")
    assert status == 200
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("meridian_requests_total{")
    )


def completion(openai: str, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"http://{openai}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
    return answer


def test_two_global_workers_serve_v2_and_openai_each_counting_its_own(
    tmp_path: Path, redis_server: EmbeddedRedis, launch: Launch
) -> None:
    spec = resolve_ports(small_fleet_spec(regions=1, zones=1, gpus=1))
    spec["redis_url"] = redis_server.url
    ops = two_free_ports()
    spec["global"].update(
        listen=f"127.0.0.1:{free_port()}",
        ops_listen=f"127.0.0.1:{ops}",
        openai_listen=f"127.0.0.1:{free_port()}",
    )
    spec["regions"][0]["ops_listen"] = f"127.0.0.1:{two_free_ports()}"
    config = tmp_path / "topology.yaml"
    config.write_text(yaml.safe_dump(spec))
    region, zone = spec["regions"][0]["name"], spec["regions"][0]["zones"][0]["name"]
    where = ["--config", str(config)]
    launch(["worker", *where, "--region", region, "--zone", zone], "gpus")
    launch(["local", *where, "--region", region, "--zone", zone], "local")
    regional = launch(
        ["regional", *where, "--region", region, "--workers", "2", "--log-format", "json"],
        "regional",
    )
    edge = launch(["global", *where, "--workers", "2", "--log-format", "json"], "global")

    def ready() -> bool:
        return all(http_get(f"http://127.0.0.1:{ops + w}/readyz")[0] == 200 for w in (0, 1))

    wait_until(ready, 60.0, "the global workers did not become ready")
    texts = [call(spec["global"]["listen"], f"edge {i}") for i in range(24)]
    assert all(texts)
    counts = [served(ops), served(ops + 1)]
    assert sum(counts) == 24 and min(counts) > 0, counts
    # Both workers bound the OpenAI port too (without SO_REUSEPORT the second could not
    # start, and the supervisor would be restarting it): answers keep coming.
    answers = [completion(spec["global"]["openai_listen"], f"http {i}") for i in range(8)]
    assert all(a["choices"][0]["text"] for a in answers)
    assert not edge.events("worker_died") and edge.popen.poll() is None
    assert len(edge.events("tier_started")) == 2

    (started,) = regional.events("workers_started")
    pids = started["pids"].split()
    r = redis.Redis.from_url(redis_server.url)
    try:
        entries = r.xrevrange(region_stream(region), count=200)
    finally:
        r.close()
    sources = {
        capacity_pb2.CapacitySummary.FromString(fields[SUMMARY_FIELD]).source_id
        for _, fields in entries
    }
    ours = {s for s in sources if s.rsplit("/", 1)[1].split("-")[0] in pids}
    assert len(ours) == 1 and pids[0] in next(iter(ours)), (ours, pids)  # worker 0 only
