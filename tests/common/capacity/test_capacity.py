import pytest
import redis

from common.basics.redis_embed import EmbeddedRedis
from common.capacity.streams import CapacityPublisher, CapacityReader, zone_stream
from common.capacity.summary import (
    aggregate,
    combine_replicas,
    decode_hint,
    encode_hint,
    expected_wait_s,
    significant_change,
)
from common.gen.meridian.v1 import capacity_pb2
from tests.until import until

M = "demo-llm"


def zone(name: str, **fields: float) -> capacity_pb2.CapacitySummary:
    return capacity_pb2.CapacitySummary(
        source_id=name,
        sequence=1,
        region="r",
        zone=name,
        models=[capacity_pb2.ModelCapacity(model=M, **fields)],  # type: ignore[arg-type]
    )


def test_aggregate_sums_counts() -> None:
    a = zone(
        "a",
        healthy_gpus=3,
        total_gpus=4,
        total_slots=30,
        free_slots=10,
        queued_requests=2,
        token_throughput_capacity=6000,
    )
    b = zone(
        "b",
        healthy_gpus=1,
        total_gpus=4,
        total_slots=10,
        free_slots=10,
        token_throughput_capacity=1200,
    )
    (entry,) = aggregate([a, b], source_id="r", sequence=5, region="r").models
    assert (entry.healthy_gpus, entry.total_gpus, entry.total_slots, entry.free_slots) == (
        4,
        8,
        40,
        20,
    )
    assert entry.queued_requests == 2
    assert entry.token_throughput_capacity == pytest.approx(7200)


def test_aggregate_utilisation_comes_from_sums_not_average_of_averages() -> None:
    # 20 of 30 busy and 0 of 10 busy: 50% overall, not the mean of 67% and 0%.
    a = zone("a", total_slots=30, free_slots=10, utilisation=2 / 3)
    b = zone("b", total_slots=10, free_slots=10, utilisation=0.0)
    (entry,) = aggregate([a, b], source_id="r", sequence=1, region="r").models
    assert entry.utilisation == pytest.approx(0.5)


def test_aggregate_wait_and_kv_weighted_by_slots() -> None:
    a = zone("a", total_slots=30, free_slots=0, estimated_wait_s=2.0, kv_cache_usage=0.9)
    b = zone("b", total_slots=10, free_slots=10, estimated_wait_s=0.0, kv_cache_usage=0.1)
    (entry,) = aggregate([a, b], source_id="r", sequence=1, region="r").models
    assert entry.estimated_wait_s == pytest.approx(1.5)
    assert entry.kv_cache_usage == pytest.approx(0.7)


def test_aggregate_keeps_models_apart() -> None:
    a = zone("a", healthy_gpus=2, total_slots=4)
    b = capacity_pb2.CapacitySummary(
        models=[capacity_pb2.ModelCapacity(model="other", healthy_gpus=1)]
    )
    summary = aggregate([a, b], source_id="r", sequence=1, region="r", zone="")
    assert {e.model: e.healthy_gpus for e in summary.models} == {M: 2, "other": 1}


def test_aggregate_of_nothing_is_empty() -> None:
    assert list(aggregate([], source_id="r", sequence=1, region="r").models) == []


async def test_publish_and_read_back_with_xrange(redis_server: EmbeddedRedis) -> None:
    stream = zone_stream("test-region", "pub-read")
    received: list[tuple[str, capacity_pb2.CapacitySummary]] = []
    publisher = CapacityPublisher(
        redis_server.url,
        stream,
        lambda seq: zone("z", healthy_gpus=seq),
        cadence_s=0.05,
        maxlen=50,
    )
    reader = CapacityReader(
        redis_server.url, {stream: "z"}, lambda n, s: received.append((n, s)), block_ms=100
    )
    publisher.start()
    reader.start()
    try:
        await until(lambda: len(received) >= 3)
    finally:
        await publisher.stop()
        await reader.stop()
    assert all(name == "z" for name, _ in received)
    counts = [s.models[0].healthy_gpus for _, s in received]
    assert counts == sorted(counts)  # in publish order
    client = redis.Redis.from_url(redis_server.url)
    entries = client.xrange(stream)
    client.close()
    parsed = capacity_pb2.CapacitySummary.FromString(entries[-1][1][b"summary"])
    assert parsed.models[0].model == M


async def test_a_poke_while_a_summary_is_on_its_way_is_published_at_once(
    redis_server: EmbeddedRedis,
) -> None:
    """A zone that goes idle while its busy summary is being written says so at once,
    not a cadence later (the poke used to be cleared after the XADD, and lost)."""
    stream = zone_stream("test-region", "poked-during-publish")
    built: list[int] = []

    def build(seq: int) -> capacity_pb2.CapacitySummary:
        built.append(seq)
        if seq == 1:
            publisher.poke()  # lands while publication 1 is on its way
        return zone("z", healthy_gpus=seq)

    publisher = CapacityPublisher(redis_server.url, stream, build, cadence_s=60.0, maxlen=50)
    publisher.start()
    try:
        await until(lambda: len(built) >= 2, timeout_s=5.0, what="for the poked publication")
    finally:
        await publisher.stop()
    client = redis.Redis.from_url(redis_server.url)
    entries = client.xrange(stream)
    client.close()
    assert [
        capacity_pb2.CapacitySummary.FromString(e[b"summary"]).models[0].healthy_gpus
        for _, e in entries
    ] == [1, 2]


async def test_stream_is_bounded(redis_server: EmbeddedRedis) -> None:
    stream = zone_stream("test-region", "bounded")
    publisher = CapacityPublisher(
        redis_server.url, stream, lambda seq: zone("z"), cadence_s=1.0, maxlen=20
    )
    try:
        for _ in range(600):
            await publisher.publish_once()
    finally:
        await publisher.stop()
    client = redis.Redis.from_url(redis_server.url)
    length = client.xlen(stream)
    client.close()
    # MAXLEN ~ trims whole radix-tree nodes (100 entries), so the length is near, not at, 20.
    assert length <= 20 + 100


async def test_redis_restart_resumes_summaries() -> None:
    server = EmbeddedRedis()
    server.start()
    stream = zone_stream("test-region", "restart")
    received: list[int] = []
    publisher = CapacityPublisher(
        server.url, stream, lambda seq: zone("z", healthy_gpus=seq), cadence_s=0.05, maxlen=100
    )
    reader = CapacityReader(
        server.url,
        {stream: "z"},
        lambda n, s: received.append(s.models[0].healthy_gpus),
        block_ms=100,
    )
    publisher.start()
    reader.start()
    try:
        await until(lambda: len(received) >= 2)
        assert publisher.redis_up() and reader.redis_up()  # meridian_redis_up reads these
        server.stop()
        await until(lambda: not publisher.redis_up() and not reader.redis_up())
        before = len(received)
        server.start()
        await until(lambda: len(received) >= before + 3, timeout_s=10)
        assert received[-1] > received[before - 1]
        await until(lambda: publisher.redis_up() and reader.redis_up())
    finally:
        await publisher.stop()
        await reader.stop()
        server.close()


def test_aggregate_counts_unknown_children() -> None:
    a = zone("a", healthy_gpus=0, total_gpus=4)
    (entry,) = aggregate([a], unknown=[M], source_id="r", sequence=1, region="r").models
    assert (entry.healthy_gpus, entry.unknown_children) == (0, 1)


def test_hint_round_trip() -> None:
    entry = capacity_pb2.ModelCapacity(
        model=M,
        healthy_gpus=3,
        total_gpus=4,
        total_slots=64,
        free_slots=10,
        queued_requests=2,
        unknown_children=1,
        estimated_wait_s=0.25,
        token_throughput_capacity=8000.0,
    )
    back = decode_hint(encode_hint(entry), M)
    assert back is not None
    assert back.token_throughput_capacity == 8000.0
    assert (back.healthy_gpus, back.total_gpus, back.total_slots, back.free_slots) == (3, 4, 64, 10)
    assert (back.queued_requests, back.unknown_children) == (2, 1)
    assert back.estimated_wait_s == pytest.approx(0.25)
    assert back.utilisation == pytest.approx(54 / 64)


def test_a_hint_without_capacity_still_decodes() -> None:
    """An older peer's hint has no ``c``: decoded, with no capacity (0)."""
    back = decode_hint("h=1,t=1,s=8,f=8,q=0,u=0,w=0.100", M)
    assert back is not None and back.token_throughput_capacity == 0.0


def test_expected_wait_grows_with_what_was_sent_even_from_idle() -> None:
    """The work sent since the report adds itself over the child's capacity, so a child
    reported idle (wait 0) stops looking idle after the first sends."""
    idle = capacity_pb2.ModelCapacity(
        model=M, total_slots=64, free_slots=64, token_throughput_capacity=10_000.0
    )
    assert expected_wait_s(idle, 0, 0.0) == 0.0
    assert expected_wait_s(idle, 40, 20_000.0) == pytest.approx(2.0)
    busy = capacity_pb2.ModelCapacity(
        model=M,
        total_slots=64,
        free_slots=32,
        estimated_wait_s=1.0,
        token_throughput_capacity=10_000.0,
    )
    assert expected_wait_s(busy, 20, 10_000.0) == pytest.approx(2.0)
    # Never below this parent's own work in flight there, however new the report:
    # what was sent while it was being made is in neither it nor the count since.
    assert expected_wait_s(idle, 0, 0.0, in_flight_work=30_000.0) == pytest.approx(3.0)
    assert expected_wait_s(busy, 20, 10_000.0, in_flight_work=5_000.0) == pytest.approx(2.0)
    # This parent's requests that came back since the report are no longer its load,
    # down to nothing but never below it.
    assert expected_wait_s(busy, -10, -5_000.0) == pytest.approx(0.5)
    assert expected_wait_s(busy, -30, -15_000.0) == 0.0
    # No capacity in the report (an older peer's hint): in proportion to busy slots.
    busy.token_throughput_capacity = 0.0
    assert expected_wait_s(busy, 32, 0.0) == pytest.approx(2.0)
    assert expected_wait_s(busy, -16, 0.0) == pytest.approx(0.5)
    assert expected_wait_s(busy, -40, 0.0) == 0.0


def test_expected_wait_counts_the_work_sent_not_the_askers() -> None:
    """Two requests of very different sizes asking about one child see the same wait:
    it grows by what was sent, whoever asks (grown by the asker's own size, long
    requests saw busy regions as far busier and went to the farthest quiet one)."""
    entry = capacity_pb2.ModelCapacity(
        model=M,
        total_slots=64,
        free_slots=40,
        estimated_wait_s=0.2,
        token_throughput_capacity=10_000.0,
    )
    ten_small = 10 * 100.0
    assert expected_wait_s(entry, 10, ten_small) == pytest.approx(0.3)
    ten_large = 10 * 2_000.0
    assert expected_wait_s(entry, 10, ten_large) == pytest.approx(2.2)


@pytest.mark.parametrize("value", [None, "", "h=1", "h=x,t=1,s=1,f=1,q=1,u=1,w=0", "garbage"])
def test_malformed_hint_is_ignored(value: str | None) -> None:
    assert decode_hint(value, M) is None


def replica(
    source: str, busy: int, tier_queued: int, gpu_waiting: int
) -> capacity_pb2.CapacitySummary:
    entry = capacity_pb2.ModelCapacity(
        model=M,
        healthy_gpus=4,
        total_gpus=4,
        total_slots=64,
        busy_slots=busy,
        free_slots=64 - busy,
        tier_queued_requests=tier_queued,
        queued_requests=tier_queued + gpu_waiting,
        token_throughput_capacity=8000,
    )
    return capacity_pb2.CapacitySummary(source_id=source, sequence=1, zone="r-1a", models=[entry])


def test_replicas_of_one_tier_are_combined_without_double_counting() -> None:
    """A zone's replicas (local tiers, ``--workers``) each count their own requests."""
    (entry,) = combine_replicas([replica("a", 10, 2, 5), replica("b", 20, 3, 4)]).models
    # The same 4 GPUs and 64 slots, seen by both replicas: counted once.
    assert (entry.healthy_gpus, entry.total_gpus, entry.total_slots) == (4, 4, 64)
    assert entry.token_throughput_capacity == 8000
    # Each replica's own work adds up; what the GPUs report waiting is counted once.
    assert (entry.busy_slots, entry.free_slots) == (30, 34)
    assert entry.queued_requests == 5 + 5
    assert entry.utilisation == pytest.approx(30 / 64)


def test_replicas_of_a_regional_tier_are_the_newest_not_a_sum() -> None:
    """Two regional replicas aggregate the same zones' summaries: the busy slots in
    each are every request there, so the newest stands for the region."""
    older, newer = replica("a", 10, 2, 5), replica("b", 12, 2, 5)
    for summary, at in ((older, 1000), (newer, 2000)):
        summary.zone, summary.timestamp_ms = "", at
    (entry,) = combine_replicas([older, newer]).models
    assert (entry.busy_slots, entry.free_slots, entry.queued_requests) == (12, 52, 7)


def test_significant_change() -> None:
    a = zone("a", healthy_gpus=4, utilisation=0.3)
    assert not significant_change(a, zone("a", healthy_gpus=4, utilisation=0.45))
    assert significant_change(a, zone("a", healthy_gpus=3, utilisation=0.3))
    assert significant_change(a, zone("a", healthy_gpus=4, utilisation=0.85))
