"""Queue keys and lanes: what waits in the central queue."""

from __future__ import annotations

import asyncio

from local_lb.queue_entries import Lane, QueuedRequest, queue_key, split_key


def test_a_key_names_the_version_only_when_one_is_asked_for() -> None:
    assert queue_key("m") == "m" and queue_key("m", "2") == "m@2"
    assert split_key("m@2") == ("m", "2") and split_key("m") == ("m", "")


async def entry(seq: int) -> QueuedRequest:
    future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    request = QueuedRequest("m", "t", "standard", 1.0, None, 0.0, future)
    request.seq = seq
    return request


async def test_settled_entries_leave_a_lane_lazily_at_either_end() -> None:
    lane = Lane()
    entries = [await entry(i) for i in range(3)]
    lane.entries.extend(entries)
    entries[0].settled = entries[2].settled = True
    assert lane.first() is entries[1] and lane.last() is entries[1]
    assert len(lane.entries) == 1


async def test_a_lane_compacts_once_dead_entries_outnumber_live_ones() -> None:
    lane = Lane()
    entries = [await entry(i) for i in range(40)]
    lane.entries.extend(entries)
    for e in entries[1:30]:  # the head stays live, so lazy removal cannot help
        e.settled = True
        lane.note_dead()
    assert len(lane.entries) < 40 and lane.first() is entries[0]
