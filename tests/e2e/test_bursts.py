"""A legal burst is served, whole: stock clients send hundreds of calls at once on one
fresh connection to a launched fleet's edge (the global process, V2 gRPC and OpenAI
HTTP), and every call ends OK.

A gRPC client opens a burst's streams before it has read the server's HTTP/2 SETTINGS;
an edge that announced a stream limit below the burst would reset the excess with
REFUSED_STREAM (UNAVAILABLE to the client). No call is retried by the clients here
(tritonclient never retries, the openai client is told not to), so a refused call shows.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from cli.launcher import Fleet
from tests.conftest import small_fleet_spec, start_fleet

SCRIPT = Path(__file__).with_name("burst_client.py")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One region, one zone of two GPUs, every tier its own process, auth off (every
    caller is tenant ``anonymous``). A tenant may hold 128 streams open by default
    (``limits.max_open_streams_per_tenant``, shed with RESOURCE_EXHAUSTED): a tenant's
    limit, not the connection's, so this fleet's is above the 200-stream burst."""
    spec = small_fleet_spec(1, 1, gpus=2)
    spec["limits"] = {"max_open_streams_per_tenant": 256}
    started = start_fleet(tmp_path_factory.mktemp("bursts"), spec)
    try:
        yield started
    finally:
        started.stop()


def bursts(fleet: Fleet, mode: str) -> dict[str, dict[str, int]]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), fleet.global_address, mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, dict[str, int]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_stock_sync_tritonclient_bursts_on_a_fresh_connection_are_all_served(
    fleet: Fleet,
) -> None:
    assert bursts(fleet, "sync") == {"unary200": {"OK": 200}, "unary1000": {"OK": 1000}}


def test_stock_aio_tritonclient_bursts_and_streams_on_a_fresh_connection_are_all_served(
    fleet: Fleet,
) -> None:
    assert bursts(fleet, "aio") == {
        "unary200": {"OK": 200},
        "unary1000": {"OK": 1000},
        "streams200": {"OK": 200},
    }


def test_stock_openai_client_burst_is_all_served(fleet: Fleet) -> None:
    assert fleet.openai_url is not None

    async def burst() -> Counter[str]:
        async with openai.AsyncOpenAI(
            base_url=fleet.openai_url, api_key="unused", max_retries=0, timeout=30.0
        ) as client:
            outcomes = await asyncio.gather(
                *(
                    client.completions.create(model="demo-llm", prompt=f"burst {i}", max_tokens=2)
                    for i in range(200)
                ),
                return_exceptions=True,
            )
        return Counter(
            type(o).__name__ if isinstance(o, BaseException) else str(o.usage.completion_tokens)
            for o in outcomes
            if isinstance(o, BaseException) or o.usage is not None
        )

    assert asyncio.run(burst()) == {"2": 200}  # each served, with the 2 tokens it asked for
