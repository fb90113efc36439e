"""Ending a call with an error status, quietly when its deadline has already passed.

Past the caller's deadline gRPC's core ends the call with DEADLINE_EXCEEDED on
its own. A handler that then sends its own status (``context.abort``) races
the core: when the core wins, the send fails inside grpc.aio, which logs
"ExecuteBatchError raised in core by servicer method" with a traceback — one
per late call, under load a flood. ``abort_call`` does not send once the
deadline is spent: it records DEADLINE_EXCEEDED on the context (what the
call's observers report) and ends the handler as a cancelled one, which
grpc.aio takes silently; the caller gets the core's DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import NoReturn

import grpc


async def abort_call(
    context: grpc.aio.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    trailers: Sequence[tuple[str, str]] = (),
) -> NoReturn:
    """``context.abort(code, message, trailers)``; never returns (see the module docstring)."""
    left = context.time_remaining()
    if left is not None and left <= 0:
        _end_quietly(context, message)
    try:
        await context.abort(code, message, trailing_metadata=tuple(trailers))
    except grpc.aio.InternalError:  # the core ended the call while the status was on its way
        _end_quietly(context, message)
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def _end_quietly(context: grpc.aio.ServicerContext, message: str) -> NoReturn:
    spent = context.time_remaining() == 0
    context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED if spent else grpc.StatusCode.CANCELLED)
    context.set_details(message)
    raise asyncio.CancelledError from None
