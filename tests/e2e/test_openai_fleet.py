"""The OpenAI edge in a launched fleet (one OS process per tier, as `meridian up` runs it,
with mutual TLS between tiers and a Redis user per tier): the global process serves it on
its resolved ``openai_listen`` beside V2 gRPC, and so does a local tier whose zone entry
asks for one, authenticating clients and billing them as the global edge does."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import openai
import pytest
import redis
import yaml

from cli.launcher import Fleet
from common.tenancy.usage import USAGE_STREAM, UsageRecord
from tests.client import V2Client
from tests.conftest import small_fleet_spec


def test_the_global_and_a_local_process_serve_openai_beside_v2(
    fleet_factory: Callable[..., Fleet],
) -> None:
    spec = small_fleet_spec(regions=1, zones=1, gpus=1)
    spec["auth"] = {"enabled": True, "tenants": [{"id": "demo", "api_key": "generate"}]}
    zone = spec["regions"][0]["zones"][0]
    zone["openai_listen"] = "127.0.0.1:0"
    fleet = fleet_factory(spec)
    assert fleet.openai_url is not None and not fleet.openai_url.endswith(":8000/v1")
    local = fleet.openai_url_of(f"local-{zone['name']}")
    assert local is not None and not local.endswith(":0/v1")
    # The resolved address is the one in the topology every process read.
    written = yaml.safe_load(fleet.config_path.read_text())
    assert local == f"http://{written['regions'][0]['zones'][0]['openai_listen']}/v1"
    assert fleet.openai_url_of(f"regional-{spec['regions'][0]['name']}") is None
    key = fleet.tenant_keys["demo"]
    for url in (fleet.openai_url, local):
        with openai.OpenAI(base_url=url, api_key=key, max_retries=0) as client:
            assert [m.id for m in client.models.list()] == ["demo-llm"]
            done = client.completions.create(model="demo-llm", prompt="hello there", max_tokens=3)
            assert done.usage is not None and done.usage.completion_tokens == 3
            stream = client.chat.completions.create(
                model="demo-llm",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                stream=True,
            )
            assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) == 3
        with openai.OpenAI(base_url=url, api_key="mk_forged", max_retries=0) as stranger:
            with pytest.raises(openai.AuthenticationError):
                stranger.completions.create(model="demo-llm", prompt="hi", max_tokens=1)
    with V2Client(fleet.global_address) as v2:  # the same process still speaks V2
        assert v2.infer(metadata=[("authorization", f"Bearer {key}")]).text
    # Each request billed once (the V2 one too), the local edge's as its own Redis user,
    # with the whole route: region, zone, GPU.
    deadline = time.monotonic() + 10
    while len(records := fleet_usage(fleet)) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(records) == 5
    where = {(r.region, r.zone, r.gpu) for r in records}
    assert where == {(spec["regions"][0]["name"], zone["name"], zone["gpus"][0]["name"])}


def fleet_usage(fleet: Fleet) -> list[UsageRecord]:
    client = redis.Redis.from_url(fleet.topology.redis_url)
    try:
        entries: Any = client.xrange(USAGE_STREAM)
    finally:
        client.close()
    return [UsageRecord.from_fields(fields) for _, fields in entries]
