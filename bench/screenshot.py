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
import time
from contextlib import ExitStack
from pathlib import Path

from tests.browser import chromium, require_chromium, show_trace
from tests.client import LoadLoop
from tests.conftest import demo_fleet_spec, start_fleet

ROOT = Path(__file__).resolve().parent.parent
# (client location, closed-loop clients): New York keeps us-east busiest.
CLIENTS = (("40.71,-74.01", 56), ("53.35,-6.26", 28), ("1.35,103.82", 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "docs" / "dashboard.png"))
    parser.add_argument("--warmup", type=float, default=45.0, help="seconds of load first")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    try:
        require_chromium()
    except BaseException as exc:  # pytest's skip outside pytest
        raise SystemExit(str(exc)) from None
    spec = demo_fleet_spec()
    spec["time_scale"] = 1.0
    with tempfile.TemporaryDirectory(prefix="meridian-shot-") as tmp, ExitStack() as stack:
        fleet = start_fleet(Path(tmp), spec)
        stack.callback(fleet.stop)
        for geo, clients in CLIENTS:
            stack.enter_context(
                LoadLoop(
                    fleet.global_address,
                    [("x-meridian-client-geo", geo)],
                    clients=clients,
                    max_requests=10**9,
                    max_tokens=args.max_tokens,
                )
            )
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
