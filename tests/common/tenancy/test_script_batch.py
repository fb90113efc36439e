"""common.tenancy.script_batch: scripts asked for in one loop turn share one round trip.

A ``ScriptBatch`` on a real async client to a Redis of the test's own (its
client list and script cache are the test's alone).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from common.basics.redis_embed import EmbeddedRedis
from common.tenancy.script_batch import Script, ScriptBatch

ECHO = Script("return {tonumber(ARGV[1]), redis.call('INCR', KEYS[1])}")
BROKEN = Script("return redis.call('NO-SUCH-COMMAND')")


@pytest.fixture
async def batch(own_redis: EmbeddedRedis) -> AsyncIterator[ScriptBatch]:
    client = Redis.from_url(own_redis.url)
    runner = ScriptBatch(client)
    try:
        yield runner
    finally:
        await runner.drain()
        await client.aclose()


def clients_connected(server: EmbeddedRedis) -> int:
    """Connections but the one asking."""
    client = redis.Redis.from_url(server.url)
    try:
        return len(client.client_list(_type="normal")) - 1
    finally:
        client.close()


async def test_calls_of_one_turn_go_as_one_batch_on_one_connection(
    batch: ScriptBatch, own_redis: EmbeddedRedis
) -> None:
    replies = await asyncio.gather(*(batch.run(ECHO, ["n"], [str(i)]) for i in range(20)))
    assert [r[0] for r in replies] == list(range(20))  # each caller gets its own reply
    assert sorted(r[1] for r in replies) == list(range(1, 21))  # every script ran once
    assert (batch.batches, batch.calls) == (1, 20)
    assert clients_connected(own_redis) == 1


async def test_calls_of_later_turns_go_in_later_batches(batch: ScriptBatch) -> None:
    for i in range(3):
        assert (await batch.run(ECHO, ["m"], [str(i)]))[0] == i
    assert (batch.batches, batch.calls) == (3, 3)


async def test_a_script_redis_forgot_is_sent_again_as_text(
    batch: ScriptBatch, own_redis: EmbeddedRedis
) -> None:
    await batch.run(ECHO, ["k"], ["0"])
    flusher = redis.Redis.from_url(own_redis.url)
    flusher.script_flush()
    flusher.close()
    replies = await asyncio.gather(*(batch.run(ECHO, ["k"], [str(i)]) for i in range(5)))
    assert [r[0] for r in replies] == list(range(5))
    assert await batch.run(ECHO, ["k"], ["7"]) == [7, 7]  # loaded again: by SHA from now on


async def test_a_scripts_error_is_its_callers_alone(batch: ScriptBatch) -> None:
    good = [batch.run(ECHO, ["e"], [str(i)]) for i in range(3)]
    results = await asyncio.gather(batch.run(BROKEN, [], []), *good, return_exceptions=True)
    assert isinstance(results[0], ResponseError)
    assert [r[0] for r in results[1:]] == [0, 1, 2]  # type: ignore[index]


async def test_a_caller_that_stops_waiting_leaves_the_others_their_replies(
    batch: ScriptBatch,
) -> None:
    quitter = asyncio.ensure_future(batch.run(ECHO, ["q"], ["1"]))
    stayer = asyncio.ensure_future(batch.run(ECHO, ["q"], ["2"]))
    await asyncio.sleep(0)  # both queued in one turn
    quitter.cancel()
    assert (await stayer)[0] == 2
    with pytest.raises(asyncio.CancelledError):
        await quitter
    await batch.drain()
    assert batch.calls == 2  # its script still ran: what a lost reply always allowed


async def test_a_dead_connection_fails_every_call_of_its_batch(
    batch: ScriptBatch, own_redis: EmbeddedRedis
) -> None:
    await batch.run(ECHO, ["d"], ["0"])
    own_redis.stop()
    results = await asyncio.gather(
        *(batch.run(ECHO, ["d"], [str(i)]) for i in range(4)), return_exceptions=True
    )
    assert all(isinstance(r, (redis.exceptions.ConnectionError, OSError)) for r in results)


async def test_calls_asked_for_while_a_batch_is_out_go_after_it_in_the_next(
    batch: ScriptBatch,
) -> None:
    first = asyncio.ensure_future(batch.run(ECHO, ["o"], ["1"]))
    for _ in range(2):  # its batch flushed, then sent: on its way
        await asyncio.sleep(0)
    later = [asyncio.ensure_future(batch.run(ECHO, ["o"], [str(i)])) for i in range(2, 6)]
    replies = [await first] + [await call for call in later]
    assert [r[1] for r in replies] == [1, 2, 3, 4, 5]  # run in Redis in the order asked
    assert (batch.batches, batch.calls) == (2, 5)
