"""Regenerate docs/dashboard.png: the demo fleet under load, in headless Chromium.

    python -m bench.screenshot [--out docs/dashboard.png] [--warmup 45]

Starts the whole demo fleet (3 regions x 2 zones x 4 GPUs, real time scale),
sends closed-loop load from New York, Dublin and Singapore so the regions are
busy to different degrees, waits for the charts to fill, opens the dashboard,
clicks the newest trace and saves the window. Needs `make browser`.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench.browser import chromium, missing, show_trace
from cli.launcher import DEMO_FLEET, Fleet
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.routing import CLIENT_GEO
from common.request.v2 import generate_request

ROOT = Path(__file__).resolve().parent.parent
# (client location, closed-loop clients): New York keeps us-east busiest.
CLIENTS = (("40.71,-74.01", 56), ("53.35,-6.26", 28), ("1.35,103.82", 10))


def demo_spec() -> dict[str, Any]:
    """The demo fleet in real time, off `make up`'s fixed ports, without API keys."""
    spec: dict[str, Any] = yaml.safe_load(DEMO_FLEET.read_text())
    spec["global"]["listen"] = spec["global"]["ops_listen"] = "127.0.0.1:0"
    spec["time_scale"] = 1.0
    spec["auth"] = {"enabled": False, "tenants": []}
    return spec


@contextmanager
def closed_loop(address: str, geo: str, clients: int, max_tokens: int) -> Iterator[None]:
    """``clients`` threads each sending one request from ``geo`` after another."""
    stop = threading.Event()

    def client() -> None:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            request = generate_request("demo-llm", "screenshot", max_tokens)
            while not stop.is_set():
                try:
                    stub.ModelInfer(request, metadata=((CLIENT_GEO, geo),), timeout=30)
                except grpc.RpcError:
                    time.sleep(0.1)  # shed or failed: it shows on the dashboard

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(35)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "docs" / "dashboard.png"))
    parser.add_argument("--warmup", type=float, default=45.0, help="seconds of load first")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    absent = missing()
    if absent:
        raise SystemExit(f"needs {', '.join(absent)}; `make browser` installs it")
    with tempfile.TemporaryDirectory(prefix="meridian-shot-") as tmp, ExitStack() as stack:
        config = Path(tmp) / "fleet.yaml"
        config.write_text(yaml.safe_dump(demo_spec()))
        fleet = Fleet(config, Path(tmp) / "run")
        stack.callback(fleet.stop)
        fleet.start(timeout_s=90)
        for geo, clients in CLIENTS:
            stack.enter_context(closed_loop(fleet.global_address, geo, clients, args.max_tokens))
        time.sleep(args.warmup)
        ops = fleet.topology.global_tier.ops
        assert ops is not None
        gpus = sum(len(z.gpus) for r in fleet.topology.regions for z in r.zones)
        with chromium(1360, 1060) as driver:  # the whole page
            show_trace(driver, f"http://{ops.address}/", gpus)
            time.sleep(2.5)  # one more poll of every panel after the click
            rows = driver.find_elements("css selector", "#timeline .span-row")
            if rows:  # show one decision's attributes below the timeline
                picks = [r for r in rows if "pick" in r.text] or rows
                driver.execute_script("arguments[0].click()", picks[-1])
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
