"""The usage stream's own state: ``meridian usage`` says when the totals are short because
the stream was trimmed or reset, over a real Redis, instead of printing smaller totals."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from cli.usage import usage_main
from common.basics.redis_embed import EmbeddedRedis
from common.tenancy.usage import UsageRecorder, meta_key
from common.tenancy.usage_state import stream_state
from tests.common.tenancy.test_usage import make_record


@pytest.fixture
def stream() -> str:
    return f"test:usage:{uuid.uuid4().hex}"


@pytest.fixture
def sync_redis(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    try:
        yield client
    finally:
        client.close()


def usage_json(url: str, stream: str, since: str = "48h") -> dict:  # type: ignore[type-arg]
    return dict(json.loads(_run(url, stream, "--json", "--since", since)))


def _run(url: str, stream: str, *args: str) -> str:

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert usage_main(["--redis", url, "--stream", stream, *args]) == 0
    return out.getvalue()


def write(url: str, stream: str, first: int, n: int, **options: int) -> None:
    """Record ``n`` records through one recorder and stop it."""

    async def run() -> None:
        recorder = UsageRecorder(url, stream=stream, batch_size=50, **options)
        for i in range(first, first + n):
            recorder.record(make_record(i))
        await recorder.flush()
        await recorder.stop()

    asyncio.run(run())


def test_a_whole_stream_raises_no_warning_from_after_its_creation(
    redis_server: EmbeddedRedis, stream: str
) -> None:
    write(redis_server.url, stream, 0, 120)
    state = asyncio.run(stream_state(redis_server.url, stream))
    assert (state.length, state.added, state.trimmed, state.resets) == (120, 120, 0, 0)
    assert state.created_ms is not None and state.first_entry_ms is not None
    assert state.warnings(state.created_ms - 1) == [
        f"the usage stream begins at {_iso_s(state.created_ms)}, after the window starts: "
        "if Meridian served requests before then, Redis lost their records"
    ]
    assert state.warnings(state.created_ms) == []


def _iso_s(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


def test_trimmed_stream_is_reported_when_the_window_reaches_past_the_oldest_entry(
    redis_server: EmbeddedRedis, stream: str, capsys: pytest.CaptureFixture[str]
) -> None:
    write(redis_server.url, stream, 0, 1000, maxlen=10)
    state = asyncio.run(stream_state(redis_server.url, stream))
    assert state.length < 1000 and state.trimmed == 1000 - state.length
    doc = usage_json(redis_server.url, stream)
    assert doc["complete"] is False
    assert doc["stream_state"]["trimmed"] == state.trimmed
    assert any(f"{state.trimmed} of 1000 usage records were trimmed" in w for w in doc["warnings"])
    assert sum(t["requests"] for t in doc["totals"]) == state.length  # what is left, said so
    assert state.first_entry_ms is not None
    assert not any("trimmed" in w for w in state.warnings(state.first_entry_ms))
    capsys.readouterr()
    _run(redis_server.url, stream, "--since", "48h")
    assert "warning: " in capsys.readouterr().err


async def restart_between_writes(server: EmbeddedRedis, stream: str) -> None:
    recorder = UsageRecorder(server.url, stream=stream)
    for i in range(30):
        recorder.record(make_record(i))
    await recorder.flush()
    server.stop()
    server.start()  # empty
    for i in range(5):
        recorder.record(make_record(100 + i))
    with contextlib.suppress(redis.ConnectionError):
        await recorder.flush()  # on the pool's connection to the old process
    await recorder.flush()
    await recorder.stop()
    assert recorder.resets_seen == 1


def test_a_redis_that_lost_its_data_is_reported_as_a_reset(
    stream: str, capsys: pytest.CaptureFixture[str]
) -> None:
    server = EmbeddedRedis()  # no persistence: a restart empties it
    server.start()
    try:
        asyncio.run(restart_between_writes(server, stream))
        state = asyncio.run(stream_state(server.url, stream))
        assert (state.length, state.added, state.resets) == (5, 5, 1)
        doc = usage_json(server.url, stream)
        assert doc["complete"] is False
        assert doc["warnings"][0].startswith("the usage stream was reset at ")
        assert "records written before then are gone" in doc["warnings"][0]
        capsys.readouterr()
        _run(server.url, stream)
        assert "warning: the usage stream was reset" in capsys.readouterr().err
    finally:
        server.close()


def test_a_stream_without_metadata_says_it_cannot_tell(
    redis_server: EmbeddedRedis, stream: str, sync_redis: redis.Redis
) -> None:
    sync_redis.xadd(stream, make_record(1).to_fields())  # type: ignore[arg-type]
    assert not sync_redis.exists(meta_key(stream))
    doc = usage_json(redis_server.url, stream)
    assert doc["complete"] is False
    assert doc["warnings"] == [
        "the usage stream has no metadata (written by another writer): whether it was "
        "trimmed or reset cannot be told"
    ]


def test_no_stream_at_all_is_empty_and_complete(redis_server: EmbeddedRedis, stream: str) -> None:
    doc = usage_json(redis_server.url, stream)
    assert (doc["totals"], doc["warnings"], doc["complete"]) == ([], [], True)
