"""The topology's gray-failure keys: defaults, values read, and each bad value's key path."""

from __future__ import annotations

from typing import Any

import pytest

from common.config.liveness import STOCK_SERVER_KEEPALIVE, Keepalive, Liveness, PerTryTimeout
from common.config.node import ConfigError
from common.config.topology import topology_from_mapping
from common.request.keepalive import keepalive_channel_args, keepalive_server_args
from sim.topology import one_zone_mapping


def topology(**settings: Any) -> Liveness:
    return topology_from_mapping(one_zone_mapping("redis://127.0.0.1:1/0", **settings)).liveness


def test_defaults_ping_tiers_every_second_and_gpu_servers_as_stock_servers_allow() -> None:
    liveness = topology()
    assert liveness.keepalive == Keepalive(time_s=1.0, timeout_s=0.75, without_calls=True)
    # found within 1.75 s: a held-up request is answered elsewhere inside the 2 s a
    # partition may take (tests/multihost/test_partition.py)
    assert liveness.keepalive.detects_hang_s == 1.75
    # Triton and gRPC's own servers accept one ping per 5 minutes, none without a call.
    assert liveness.gpu_keepalive == STOCK_SERVER_KEEPALIVE
    assert STOCK_SERVER_KEEPALIVE.time_s >= 300 and not STOCK_SERVER_KEEPALIVE.without_calls
    assert liveness.per_try_timeout == PerTryTimeout(True, 4.0, 1.0, 0.0)
    assert (liveness.panic_threshold, liveness.slow_probes_before_down) == (0.5, 3)


def test_every_key_is_read() -> None:
    liveness = topology(
        keepalive={"time_s": 2, "timeout_s": 0.5, "without_calls": False},
        gpu_keepalive={"time_s": 1},
        per_try_timeout={"enabled": True, "multiple": 2, "floor_s": 0.5, "upper_s_per_token": 0.01},
        panic_threshold=0.3,
        slow_probes_before_down=5,
    )
    assert liveness.keepalive == Keepalive(2.0, 0.5, False)
    # Keys left out of a section keep that section's own defaults.
    assert liveness.gpu_keepalive == Keepalive(1.0, 20.0, False)
    assert liveness.per_try_timeout == PerTryTimeout(True, 2.0, 0.5, 0.01)
    assert (liveness.panic_threshold, liveness.slow_probes_before_down) == (0.3, 5)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"keepalive": {"time_s": 0.5}}, r"^keepalive\.time_s: must be >= 1\.0"),
        ({"keepalive": {"timeout_s": 0}}, r"^keepalive\.timeout_s: must be > 0"),
        ({"keepalive": {"every": 1}}, r"^keepalive\.every: unknown key"),
        ({"gpu_keepalive": {"without_calls": "yes"}}, r"^gpu_keepalive\.without_calls: expected"),
        ({"gpu_keepalive": 300}, r"^gpu_keepalive: expected a mapping"),
        ({"per_try_timeout": {"multiple": 0.5}}, r"^per_try_timeout\.multiple: must be >= 1"),
        ({"per_try_timeout": {"floor_s": 0}}, r"^per_try_timeout\.floor_s: must be > 0"),
        (
            {"per_try_timeout": {"upper_s_per_token": -1}},
            r"^per_try_timeout\.upper_s_per_token: must be >= 0",
        ),
        ({"panic_threshold": 1.5}, r"^panic_threshold: must be between 0 and 1"),
        ({"panic_threshold": "half"}, r"^panic_threshold: expected float"),
        ({"slow_probes_before_down": 0}, r"^slow_probes_before_down: must be >= 1"),
    ],
    ids=[
        "keepalive-too-fast",
        "keepalive-no-timeout",
        "keepalive-unknown-key",
        "gpu-without-calls-not-bool",
        "gpu-keepalive-not-a-mapping",
        "per-try-below-expected",
        "per-try-no-floor",
        "per-try-negative-rate",
        "panic-above-one",
        "panic-not-a-number",
        "slow-probes-zero",
    ],
)
def test_a_bad_value_names_its_key(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        topology(**settings)


def test_keepalive_waits_for_a_ping_answer_no_longer_than_its_timeout() -> None:
    # grpc-core waits for a keepalive ping's answer for grpc.http2.ping_timeout_ms
    # (1 minute by default): without it a hung peer went unnoticed for a minute.
    args = dict(keepalive_channel_args(Keepalive(1.0, 0.5, True)))
    assert args["grpc.keepalive_time_ms"] == 1000
    assert args["grpc.keepalive_timeout_ms"] == args["grpc.http2.ping_timeout_ms"] == 500
    assert args["grpc.keepalive_permit_without_calls"] == 1
    assert args["grpc.http2.max_pings_without_data"] == 0  # a long call stays watched
    assert (
        dict(keepalive_channel_args(STOCK_SERVER_KEEPALIVE))["grpc.keepalive_permit_without_calls"]
        == 0
    )


def test_servers_accept_pings_from_a_client_at_the_fastest_allowed_keepalive() -> None:
    args = dict(keepalive_server_args(Keepalive()))
    # A client pinging every second (the lowest time_s) is never taken for an abuser.
    assert args["grpc.http2.min_ping_interval_without_data_ms"] * 2 <= 1000
    assert args["grpc.keepalive_permit_without_calls"] == 1
