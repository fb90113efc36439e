"""The fleet the capacity_flow measurements run on, and what they share.

A cut-down demo fleet (us-east and eu-west, one zone of two GPUs each), the names the
measurements kill and watch in it, a restart that times readiness to 10 ms, and the
millisecond formatting every printed line and report table uses.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import grpc
import yaml

from cli.launcher import DEMO_FLEET, Fleet, tier_ready

MODEL = "demo-llm"
DUBLIN = "53.35,-6.26"
REGION, ZONE = "eu-west", "eu-west-1a"
READY_POLL_S = 0.01


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f} ms"


def fleet_spec(time_scale: float) -> dict[str, Any]:
    """us-east and eu-west from the demo fleet, one zone each, two GPUs per zone, no auth."""
    spec: dict[str, Any] = yaml.safe_load(DEMO_FLEET.read_text())
    spec["global"]["listen"] = "127.0.0.1:0"
    spec["time_scale"] = time_scale
    if "auth" in spec:  # as the routing tests do: this measures routing, not API keys
        spec["auth"] = {"enabled": False, "tenants": []}
    spec["regions"] = [r for r in spec["regions"] if r["name"] in ("us-east", "eu-west")]
    for region in spec["regions"]:
        region["zones"] = region["zones"][:1]
        region["zones"][0]["gpus"] = region["zones"][0]["gpus"][:2]
    return spec


def all_ready(addresses: Sequence[str], credentials: grpc.ChannelCredentials | None) -> bool:
    return all(tier_ready(a, credentials, timeout_s=0.2) for a in addresses)


def restart_precisely(fleet: Fleet, name: str, addresses: Sequence[str], timeout_s: float) -> float:
    """``Fleet.restart`` with a 10 ms readiness poll; returns when all ``addresses`` were ready."""
    proc = fleet.processes[name]
    credentials = fleet.credentials_for(name)  # inner tiers speak mutual TLS
    proc.stop()
    proc.start()
    deadline = time.monotonic() + timeout_s
    while not all_ready(addresses, credentials):
        if not proc.alive():
            raise RuntimeError(f"{name} exited at start; see {proc.log_path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not ready after {timeout_s} s; see {proc.log_path}")
        time.sleep(READY_POLL_S)
    return time.monotonic()
