import asyncio
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis

from cli.usage import parse_time, usage_main
from common.basics.redis_embed import EmbeddedRedis, free_port
from common.tenancy.usage import (
    USAGE_STREAM,
    UsageRecord,
    UsageRecorder,
    UsageTotals,
    summarise,
)
from common.tenancy.usage_state import stream_state
from tests.until import until

STATUSES = ("OK", "OK", "OK", "UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")
TENANTS = ("acme", "globex", "initech")
MODELS = ("demo-llm", "demo-llm@2")
# An hour ago: a record is always written after it finished (see summarise's docstring).
BASE_MS = int(time.time() * 1000) - 3_600_000


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


def make_record(i: int, *, finished_at_ms: int | None = None, request_id: str = "") -> UsageRecord:
    return UsageRecord(
        tenant=TENANTS[i % len(TENANTS)],
        model=MODELS[i % len(MODELS)],
        region="eu-west",
        zone="eu-west-1a",
        gpu=f"gpu-{i % 4}",
        prompt_tokens=100 + i,
        completion_tokens=i % 17,
        gpu_seconds=0.001 * i + 0.1,
        status=STATUSES[i % len(STATUSES)],
        trace_id=f"{i:032x}",
        request_id=request_id or uuid.uuid4().hex,
        finished_at_ms=BASE_MS + i if finished_at_ms is None else finished_at_ms,
    )


def expected_totals(records: list[UsageRecord]) -> dict[tuple[str, str], UsageTotals]:
    totals: dict[tuple[str, str], UsageTotals] = {}
    for rec in records:
        totals.setdefault((rec.tenant, rec.model), UsageTotals()).add(rec)
    return totals


def assert_totals_equal(
    got: dict[tuple[str, str], UsageTotals], want: dict[tuple[str, str], UsageTotals]
) -> None:
    assert got.keys() == want.keys()
    for key, w in want.items():
        g = got[key]
        assert (g.requests, g.ok_requests, g.prompt_tokens, g.completion_tokens, g.statuses) == (
            w.requests,
            w.ok_requests,
            w.prompt_tokens,
            w.completion_tokens,
            w.statuses,
        ), key
        assert g.gpu_seconds == pytest.approx(w.gpu_seconds, abs=1e-6), key


def test_record_round_trips_through_stream_fields() -> None:
    rec = make_record(7)
    rec = dataclasses.replace(rec, gpu_seconds=0.1 + 0.2)  # not exactly 0.3
    fields = rec.to_fields()
    assert all(isinstance(v, str) for v in fields.values())
    as_bytes = {k.encode(): v.encode() for k, v in fields.items()}
    assert UsageRecord.from_fields(as_bytes) == rec
    assert UsageRecord.from_fields({**fields, "added_later": "x"}) == rec
    reported = dataclasses.replace(rec, tokens_reported=True)
    assert reported.to_fields()["tokens_reported"] == "True"
    assert UsageRecord.from_fields(reported.to_fields()) == reported


def test_a_record_from_before_tokens_reported_reads_as_estimated() -> None:
    fields = dataclasses.replace(make_record(3), tokens_reported=True).to_fields()
    del fields["tokens_reported"]
    assert UsageRecord.from_fields(fields).tokens_reported is False


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompt_tokens": "many"}, "prompt_tokens"),
        ({"gpu_seconds": ""}, "gpu_seconds"),
        ({"tenant": None}, "tenant"),
        ({"tokens_reported": "yes"}, "tokens_reported"),
    ],
)
def test_from_fields_names_the_bad_field(change: dict[str, str | None], message: str) -> None:
    fields: dict[str, str] = make_record(1).to_fields()
    for key, value in change.items():
        if value is None:
            del fields[key]
        else:
            fields[key] = value
    with pytest.raises(ValueError, match=message):
        UsageRecord.from_fields(fields)


async def test_every_record_arrives_and_totals_match(
    redis_server: EmbeddedRedis, stream: str, sync_redis: redis.Redis
) -> None:
    records = [make_record(i) for i in range(1234)]
    recorder = UsageRecorder(redis_server.url, stream=stream, flush_interval_s=0.05)
    recorder.start()
    try:
        for rec in records:
            recorder.record(rec)
        await until(lambda: recorder.written == len(records))
    finally:
        await recorder.stop()
    assert (recorder.pending, recorder.dropped) == (0, 0)
    assert sync_redis.xlen(stream) == len(records)
    got = await summarise(redis_server.url, since_ms=None, until_ms=None, stream=stream, chunk=100)
    assert_totals_equal(got, expected_totals(records))
    assert sum(t.requests for t in got.values()) == len(records)
    assert {s for t in got.values() for s in t.statuses} == set(STATUSES)


async def test_record_fills_in_a_missing_request_id(
    redis_server: EmbeddedRedis, stream: str
) -> None:
    recorder = UsageRecorder(redis_server.url, stream=stream)
    for i in range(3):
        recorder.record(dataclasses.replace(make_record(i), request_id=""))
    await recorder.flush()
    await recorder.stop()
    got = await summarise(redis_server.url, since_ms=None, until_ms=None, stream=stream)
    assert sum(t.requests for t in got.values()) == 3


async def test_stop_flushes_what_is_buffered(
    redis_server: EmbeddedRedis, stream: str, sync_redis: redis.Redis
) -> None:
    recorder = UsageRecorder(redis_server.url, stream=stream, flush_interval_s=60)
    recorder.start()
    for i in range(10):
        recorder.record(make_record(i))
    await recorder.stop()
    assert sync_redis.xlen(stream) == 10


async def test_stop_ends_the_recorder_when_a_full_batch_wakes_it_as_it_is_cancelled(
    redis_server: EmbeddedRedis, stream: str, sync_redis: redis.Redis
) -> None:
    """A full batch wakes the recorder in the same loop turn as stop() cancels it:
    Python 3.11's wait_for took the wake-up and dropped the cancellation, and stop()
    waited for ever (the OpenAI edge's tests met it at teardown)."""
    recorder = UsageRecorder(redis_server.url, stream=stream, batch_size=2, flush_interval_s=60)
    recorder.start()
    await asyncio.sleep(0.05)  # the recorder waits for a batch
    recorder.record(make_record(0))
    recorder.record(make_record(1))  # a full batch: wake
    started = time.monotonic()
    async with asyncio.timeout(5):  # (a second cancellation, its own, would get through)
        await recorder.stop()
    assert time.monotonic() - started < 2, "stop() waited on a recorder that kept running"
    assert sync_redis.xlen(stream) == 2


async def test_time_window_is_half_open_on_finished_at(
    redis_server: EmbeddedRedis, stream: str
) -> None:
    records = [make_record(i, finished_at_ms=BASE_MS + 1000 * i) for i in range(10)]
    recorder = UsageRecorder(redis_server.url, stream=stream)
    for rec in records:
        recorder.record(rec)
    await recorder.stop()
    window = await summarise(
        redis_server.url, since_ms=BASE_MS + 2000, until_ms=BASE_MS + 7000, stream=stream
    )
    assert_totals_equal(window, expected_totals(records[2:7]))
    tail = await summarise(redis_server.url, since_ms=BASE_MS + 8000, until_ms=None, stream=stream)
    assert_totals_equal(tail, expected_totals(records[8:]))
    head = await summarise(redis_server.url, since_ms=None, until_ms=BASE_MS + 1, stream=stream)
    assert_totals_equal(head, expected_totals(records[:1]))


async def test_late_written_record_counts_in_its_own_window(
    redis_server: EmbeddedRedis, stream: str
) -> None:
    """A record buffered through a long outage is written hours after it finished."""
    long_ago = BASE_MS - 10 * 3_600_000
    recorder = UsageRecorder(redis_server.url, stream=stream)
    recorder.record(make_record(1, finished_at_ms=long_ago))
    await recorder.stop()
    got = await summarise(redis_server.url, since_ms=long_ago, until_ms=long_ago + 1, stream=stream)
    assert sum(t.requests for t in got.values()) == 1


async def test_duplicate_request_id_counts_once(
    redis_server: EmbeddedRedis, stream: str, sync_redis: redis.Redis
) -> None:
    records = [make_record(i) for i in range(20)]
    recorder = UsageRecorder(redis_server.url, stream=stream, batch_size=7)
    for rec in records + records[5:12] + records[:1]:  # a re-written batch, a lone repeat
        recorder.record(rec)
    await recorder.stop()
    assert sync_redis.xlen(stream) == 28
    got = await summarise(redis_server.url, since_ms=None, until_ms=None, stream=stream, chunk=3)
    assert_totals_equal(got, expected_totals(records))


async def test_duplicates_beyond_the_horizon_are_forgotten(
    redis_server: EmbeddedRedis, stream: str, sync_redis: redis.Redis
) -> None:
    """Memory is bounded by the horizon: ids are remembered for that much stream time only."""
    rec = make_record(1)
    sync_redis.xadd(stream, rec.to_fields(), id="1000-0")  # type: ignore[arg-type]
    sync_redis.xadd(stream, rec.to_fields(), id="5000-0")  # type: ignore[arg-type]
    near = await summarise(redis_server.url, since_ms=None, until_ms=None, stream=stream)
    far = await summarise(
        redis_server.url, since_ms=None, until_ms=None, stream=stream, dedup_horizon_ms=1000
    )
    assert sum(t.requests for t in near.values()) == 1
    assert sum(t.requests for t in far.values()) == 2


async def test_malformed_entries_are_skipped(
    redis_server: EmbeddedRedis, stream: str, sync_redis: redis.Redis
) -> None:
    sync_redis.xadd(stream, {"tenant": "acme", "prompt_tokens": "x"})
    sync_redis.xadd(stream, make_record(1).to_fields())  # type: ignore[arg-type]
    got = await summarise(redis_server.url, since_ms=None, until_ms=None, stream=stream)
    assert sum(t.requests for t in got.values()) == 1


async def test_redis_outage_loses_nothing_below_the_limit() -> None:
    server = EmbeddedRedis()
    server.start()
    stream = USAGE_STREAM
    records = [make_record(i) for i in range(200)]
    recorder = UsageRecorder(server.url, flush_interval_s=0.02, batch_size=50)
    recorder.start()
    try:
        server.stop()
        for i, rec in enumerate(records):
            recorder.record(rec)
            if i % 20 == 0:
                await asyncio.sleep(0.05)  # the recorder keeps trying and failing meanwhile
        await asyncio.sleep(0.3)
        assert (recorder.written, recorder.pending, recorder.dropped) == (0, 200, 0)
        server.start()
        await until(lambda: recorder.written == 200, timeout_s=10)
        client = redis.Redis.from_url(server.url)
        try:
            assert client.xlen(stream) == 200
        finally:
            client.close()
        got = await summarise(server.url, since_ms=None, until_ms=None)
        assert_totals_equal(got, expected_totals(records))
    finally:
        await recorder.stop(timeout_s=1.0)
        server.close()


async def test_overflow_drops_the_oldest_and_counts_them(
    redis_server: EmbeddedRedis, stream: str, caplog: pytest.LogCaptureFixture
) -> None:
    records = [make_record(i) for i in range(150)]
    recorder = UsageRecorder(redis_server.url, stream=stream, buffer_limit=100)
    for rec in records:  # not started: nothing is written, as if Redis were down
        recorder.record(rec)
    assert (recorder.pending, recorder.dropped) == (100, 50)
    assert "dropping the oldest" in caplog.text
    await recorder.stop()
    got = await summarise(redis_server.url, since_ms=None, until_ms=None, stream=stream)
    assert_totals_equal(got, expected_totals(records[50:]))


async def test_failed_batch_is_retried_whole_first_and_overflow_drops_the_oldest_after_it(
    sync_redis: redis.Redis,
) -> None:
    server = EmbeddedRedis()  # not started yet: every write fails
    records = [make_record(i) for i in range(35)]
    recorder = UsageRecorder(server.url, buffer_limit=20, batch_size=10)
    try:
        for rec in records[:20]:
            recorder.record(rec)
        write = asyncio.create_task(recorder.flush())
        await asyncio.sleep(0)  # the first batch (records 0..9) is now in flight
        for rec in records[20:30]:
            recorder.record(rec)  # buffer full again: 10..29
        with pytest.raises((redis.RedisError, OSError)):
            await write
        # 0..9 may have landed: kept apart, whole, to be retried under their batch id
        assert (recorder.pending, recorder.dropped) == (30, 0)
        for rec in records[30:35]:
            recorder.record(rec)  # the buffer's oldest (10..14) make room
        assert (recorder.pending, recorder.dropped) == (30, 5)
        server.start()
        await recorder.flush()
        client = redis.Redis.from_url(server.url)
        try:
            ids = [UsageRecord.from_fields(f).request_id for _, f in client.xrange(USAGE_STREAM)]
        finally:
            client.close()
        assert ids == [r.request_id for r in records[:10] + records[15:35]]
    finally:
        await recorder.stop(timeout_s=0.2)
        server.close()


BUSY_FOR = """
local t = redis.call('TIME')
local stop = t[1] * 1000000 + t[2] + tonumber(ARGV[1])
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] >= stop
return 1
"""


async def test_a_write_that_timed_out_but_landed_is_not_written_twice(
    redis_server: EmbeddedRedis, stream: str, sync_redis: redis.Redis
) -> None:
    """Redis busy past the recorder's timeout: the batch lands after the recorder gave
    up on it, and its retry (redis-py's own and the recorder's) must not add it again."""
    records = [make_record(i) for i in range(45)]
    recorder = UsageRecorder(redis_server.url, stream=stream, socket_timeout_s=0.1)
    recorder.record(records[0])
    await recorder.flush()  # connected, script loaded: the next try reaches Redis whole
    for rec in records[1:]:
        recorder.record(rec)
    busy = threading.Thread(target=sync_redis.eval, args=(BUSY_FOR, 0, 700_000))
    busy.start()
    await asyncio.sleep(0.1)  # the script now holds Redis for 0.7 s
    try:
        with pytest.raises(redis.RedisError):
            await recorder.flush()  # sent, not answered within 0.1 s
        assert recorder.pending == 44
    finally:
        busy.join()
    await until(lambda: sync_redis.xlen(stream) == 45, timeout_s=2)  # Redis ran it once free
    await recorder.flush()  # the retry finds the batch's marker
    await recorder.stop()
    assert (recorder.written, recorder.pending) == (45, 0)
    entries = sync_redis.xrange(stream)
    assert [UsageRecord.from_fields(f).request_id for _, f in entries] == [
        r.request_id for r in records
    ]


async def test_sigkill_of_a_persistent_redis_loses_and_doubles_nothing(tmp_path: Path) -> None:
    """appendfsync always: what Redis acknowledged is on disk when it is killed; what it
    did not is retried; what landed unacknowledged is skipped by its batch marker."""
    server = EmbeddedRedis(data_dir=tmp_path / "redis")
    server.start()
    records = [make_record(i) for i in range(600)]
    recorder = UsageRecorder(server.url, flush_interval_s=0.01, batch_size=20)
    recorder.start()
    try:
        for i, rec in enumerate(records):
            recorder.record(rec)
            if i % 10 == 0:
                await asyncio.sleep(0.005)
            if i == 300:
                server.kill()  # mid-write, with batches in flight
                server.start()
        await until(lambda: recorder.pending == 0, timeout_s=15)
        client = redis.Redis.from_url(server.url)
        try:
            ids = [UsageRecord.from_fields(f).request_id for _, f in client.xrange(USAGE_STREAM)]
        finally:
            client.close()
        assert sorted(ids) == sorted(r.request_id for r in records)  # each once
        state = await stream_state(server.url)
        assert (state.length, state.added, state.resets, state.warnings(None)[1:]) == (
            600,
            600,
            0,
            [],
        )
    finally:
        await recorder.stop(timeout_s=1.0)
        server.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("now", 10_000_000_000),
        ("30s", 10_000_000_000 - 30_000),
        ("30m", 10_000_000_000 - 1_800_000),
        ("1h", 10_000_000_000 - 3_600_000),
        ("7d", 10_000_000_000 - 7 * 86_400_000),
        ("2025-01-31T12:00:00Z", 1_738_324_800_000),
        ("2025-01-31T12:00:00", 1_738_324_800_000),
        ("2025-01-31T13:00:00+01:00", 1_738_324_800_000),
        ("2025-01-31", 1_738_281_600_000),
    ],
)
def test_parse_time(text: str, expected: int) -> None:
    assert parse_time(text, now_ms=10_000_000_000) == expected


@pytest.mark.parametrize("text", ["yesterday", "1y", "-1h", "2025-13-01", ""])
def test_parse_time_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="ISO-8601"):
        parse_time(text, now_ms=0)


def _ms(iso: str) -> int:
    return int(datetime.fromisoformat(iso).replace(tzinfo=UTC).timestamp() * 1000)


def _seed(client: redis.Redis, stream: str) -> None:
    def rec(
        tenant: str, model: str, p: int, c: int, g: float, status: str, at: str,
        reported: bool | None = False,
    ) -> None:  # fmt: skip
        r = UsageRecord(
            tenant, model, "eu-west", "eu-west-1a", "gpu-0", p, c, g, status, "t",
            uuid.uuid4().hex, _ms(at), bool(reported),
        )  # fmt: skip
        fields = r.to_fields()
        if reported is None:  # written before records had the field: read as estimated
            del fields["tokens_reported"]
        client.xadd(stream, fields)  # type: ignore[arg-type]

    rec("acme", "demo-llm", 100, 16, 0.5, "OK", "2025-01-31T10:00:00")
    rec("acme", "demo-llm", 200, 0, 0.25, "UNAVAILABLE", "2025-01-31T11:00:00")
    rec("acme", "big-llm", 1000, 64, 2.0, "OK", "2025-01-31T11:30:00", reported=True)
    rec("globex", "demo-llm", 50, 8, 0.125, "OK", "2025-01-31T11:59:59", reported=None)
    rec("globex", "demo-llm", 9, 9, 9.0, "OK", "2025-01-31T12:00:00")  # outside: until is open


WINDOW = ["--since", "2025-01-31T00:00:00Z", "--until", "2025-01-31T12:00:00Z"]


def test_usage_main_prints_a_table(
    redis_server: EmbeddedRedis,
    stream: str,
    sync_redis: redis.Redis,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _seed(sync_redis, stream)
    code = usage_main(["--redis", redis_server.url, "--stream", stream, *WINDOW])
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines() == [
        f"usage 2025-01-31T00:00:00Z .. 2025-01-31T12:00:00Z (stream {stream})",
        "tenant  model     requests  ok  prompt_tokens  completion_tokens  estimated  gpu_seconds",
        "acme    big-llm          1   1           1000                 64          0        2.000",
        "acme    demo-llm         2   1            300                 16          2        0.750",
        "globex  demo-llm         1   1             50                  8          1        0.125",
        "total                    4   3           1350                 88          3        2.875",
    ]


def test_usage_main_prints_json(
    redis_server: EmbeddedRedis,
    stream: str,
    sync_redis: redis.Redis,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _seed(sync_redis, stream)
    code = usage_main(["--redis", redis_server.url, "--stream", stream, "--json", *WINDOW])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (doc["since"], doc["until"]) == ("2025-01-31T00:00:00Z", "2025-01-31T12:00:00Z")
    assert doc["totals"] == [
        {"tenant": "acme", "model": "big-llm", "requests": 1, "ok_requests": 1,
         "prompt_tokens": 1000, "completion_tokens": 64, "gpu_seconds": 2.0,
         "statuses": {"OK": 1}, "estimated": 0},
        {"tenant": "acme", "model": "demo-llm", "requests": 2, "ok_requests": 1,
         "prompt_tokens": 300, "completion_tokens": 16, "gpu_seconds": 0.75,
         "statuses": {"OK": 1, "UNAVAILABLE": 1}, "estimated": 2},
        {"tenant": "globex", "model": "demo-llm", "requests": 1, "ok_requests": 1,
         "prompt_tokens": 50, "completion_tokens": 8, "gpu_seconds": 0.125,
         "statuses": {"OK": 1}, "estimated": 1},
    ]  # fmt: skip


def test_usage_main_defaults_to_the_last_24_hours(
    redis_server: EmbeddedRedis,
    stream: str,
    sync_redis: redis.Redis,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _seed(sync_redis, stream)
    now = _ms("2025-02-01T10:30:00")  # 24 h back reaches 2025-01-31T10:30
    code = usage_main(["--redis", redis_server.url, "--stream", stream, "--json"], now_ms=now)
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert doc["since"] == "2025-01-31T10:30:00Z"
    assert [(t["tenant"], t["model"], t["requests"]) for t in doc["totals"]] == [
        ("acme", "big-llm", 1),
        ("acme", "demo-llm", 1),
        ("globex", "demo-llm", 2),
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--since", "last tuesday"], "bad time 'last tuesday'"),
        (["--since", "1h", "--until", "2h"], "is not before --until"),
        ([], "--redis"),
    ],
)
def test_usage_main_bad_arguments_exit_2(
    redis_server: EmbeddedRedis,
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = args if args == [] else ["--redis", redis_server.url, *args]
    assert usage_main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


def test_usage_main_unreachable_redis_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    assert usage_main(["--redis", url]) == 2
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert f"cannot read meridian:{{usage}} from {url}" in err


def replica_of(master: EmbeddedRedis) -> EmbeddedRedis:
    """A started Redis replicating ``master``, its initial sync done."""
    replica = EmbeddedRedis()
    replica.start()
    client = redis.Redis.from_url(replica.url)
    try:
        client.replicaof("127.0.0.1", master.port)
        deadline = time.monotonic() + 10
        while client.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "replica never synced"
            time.sleep(0.05)
    finally:
        client.close()
    return replica


async def test_with_replicas_ack_a_failover_keeps_every_written_record() -> None:
    """WAIT: a batch counts as written only once the replica has it; while the replica is
    gone batches are kept; after the master dies, the promoted replica has all of them."""
    master = EmbeddedRedis()
    master.start()
    replica = replica_of(master)
    recorder = UsageRecorder(master.url, replicas_ack=1, replicas_timeout_s=0.2, batch_size=10)
    records = [make_record(i) for i in range(60)]
    try:
        for rec in records[:30]:
            recorder.record(rec)
        await recorder.flush()
        replica.stop()
        for rec in records[30:40]:
            recorder.record(rec)
        with pytest.raises(redis.RedisError, match="on 0 of the 1 replicas"):
            await recorder.flush()  # written on the master, not acknowledged: kept
        assert (recorder.written, recorder.pending) == (30, 10)
        replica.close()
        replica = replica_of(master)
        for rec in records[40:]:
            recorder.record(rec)
        await recorder.flush()  # the kept batch is skipped on the master, then acknowledged
        assert (recorder.written, recorder.pending) == (60, 0)
        master.kill()
        promoted = redis.Redis.from_url(replica.url)
        try:
            promoted.replicaof("NO", "ONE")
            entries = promoted.xrange(USAGE_STREAM)
        finally:
            promoted.close()
        ids = [UsageRecord.from_fields(f).request_id for _, f in entries]
        assert ids == [r.request_id for r in records]
    finally:
        await recorder.stop(timeout_s=0.5)
        replica.close()
        master.close()
