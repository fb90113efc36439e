"""The OpenAI edge in a launched fleet (one OS process per tier, as `meridian up` runs it):
the global process serves it on its resolved ``openai_listen`` beside V2 gRPC."""

from __future__ import annotations

from collections.abc import Callable

import openai

from cli.launcher import Fleet
from tests.client import V2Client
from tests.conftest import small_fleet_spec


def test_the_global_process_serves_openai_beside_v2(fleet_factory: Callable[..., Fleet]) -> None:
    spec = small_fleet_spec(regions=1, zones=1, gpus=1)
    spec["auth"] = {"enabled": True, "tenants": [{"id": "demo", "api_key": "generate"}]}
    fleet = fleet_factory(spec)
    assert fleet.openai_url is not None and not fleet.openai_url.endswith(":8000/v1")
    key = fleet.tenant_keys["demo"]
    with openai.OpenAI(base_url=fleet.openai_url, api_key=key, max_retries=0) as client:
        assert [m.id for m in client.models.list()] == ["demo-llm"]
        completion = client.completions.create(model="demo-llm", prompt="hello there", max_tokens=3)
        assert completion.usage is not None and completion.usage.completion_tokens == 3
        stream = client.chat.completions.create(
            model="demo-llm",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
        )
        assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) == 3
    with V2Client(fleet.global_address) as v2:  # the same process still speaks V2
        assert v2.infer(metadata=[("authorization", f"Bearer {key}")]).text
