"""cancel_and_wait: background tasks stop even when one swallows a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from common.basics.tasks import cancel_and_wait


async def test_a_task_that_swallows_one_cancellation_is_cancelled_again() -> None:
    swallowed = 0

    async def retry_loop() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:  # what a retry loop around grpc.aio may do
                if swallowed:
                    raise
                swallowed += 1

    task = asyncio.create_task(retry_loop())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait([task]), 2)
    assert task.cancelled() and swallowed == 1


async def test_a_task_that_will_not_stop_is_abandoned_after_the_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    swallowed = 0

    async def stubborn() -> None:  # swallows 10 cancellations (1 s of them), then ends
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed >= 10:
                    raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    try:
        await asyncio.wait_for(cancel_and_wait([task], timeout_s=0.3), 2)
        assert not task.done() and "did not stop" in caplog.text
    finally:  # it ends eventually; left behind, it would hang the loop's teardown
        await asyncio.wait_for(cancel_and_wait([task]), 5)
    assert task.cancelled()


async def test_finished_and_failed_tasks_are_collected_quietly() -> None:
    async def fail() -> None:
        raise RuntimeError("boom")

    failed = asyncio.create_task(fail())
    await asyncio.sleep(0)
    await cancel_and_wait([failed])
    assert isinstance(failed.exception(), RuntimeError)
