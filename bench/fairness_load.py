"""The fairness bench's load: Poisson open-loop streams and the closed-loop calibration.

Every request carries a prompt no other request shares, so the engines' prefix cache
never shortens one stream's work; each finished request becomes a ``Sample`` timed from
its scheduled (Poisson) send time, so a late sender does not hide queueing.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from bench.fairness_zone import MODEL
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.routing import PRIORITY, TENANT
from common.request.v2 import generate_request

PROMPT_WORDS = 16
WORDS = (
    "route queue tenant share token batch slot model zone region deadline weight fair "
    "flood steady prompt cache decode prefill counter virtual latency capacity"
).split()


@dataclass(frozen=True)
class Sample:
    stream: str
    intended: float
    sent: float
    done: float
    code: str

    @property
    def latency_s(self) -> float:
        return self.done - self.intended


def prompt(rng: random.Random, stream: str, index: int) -> str:
    """A prompt no other request shares (no prefix-cache effects)."""
    words = [rng.choice(WORDS) for _ in range(PROMPT_WORDS - 2)]
    return " ".join([stream, str(index), *words])


async def _one(
    stub: pb_grpc.GRPCInferenceServiceStub,
    request: Any,
    metadata: tuple[tuple[str, str], ...],
    timeout: float,
    stream: str,
    intended: float,
    out: list[Sample],
) -> None:
    loop = asyncio.get_running_loop()
    sent = loop.time()
    try:
        await stub.ModelInfer(request, metadata=metadata, timeout=timeout)
        code = "OK"
    except grpc.aio.AioRpcError as exc:
        code = exc.code().name
    out.append(Sample(stream, intended, sent, loop.time(), code))


async def open_loop(
    stubs: Sequence[pb_grpc.GRPCInferenceServiceStub],
    *,
    stream: str,
    tenant_id: str,
    rate: float,
    count: int,
    t0: float,
    seed: int,
    timeout: float,
    max_tokens: int,
    out: list[Sample],
    stop: asyncio.Event | None = None,
) -> None:
    """``count`` Poisson arrivals at ``rate``/s from ``t0`` (fewer if ``stop`` is set);
    returns when every request sent has finished (each is bounded by ``timeout``)."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    metadata = ((TENANT, tenant_id), (PRIORITY, "standard"))
    tasks: set[asyncio.Task[None]] = set()
    at = t0
    for i in range(count):
        at += rng.expovariate(rate)
        request = generate_request(MODEL, prompt(rng, stream, i), max_tokens)
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if stop is not None and stop.is_set():
            break
        stub = stubs[i % len(stubs)]
        task = asyncio.create_task(_one(stub, request, metadata, timeout, stream, at, out))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)


async def calibrate(
    stub: pb_grpc.GRPCInferenceServiceStub,
    clients: int,
    warm_s: float,
    measure_s: float,
    max_tokens: int,
) -> float:
    """Requests/s the zone finishes with every slot busy (closed loop, clients > slots)."""
    loop = asyncio.get_running_loop()
    rng = random.Random(0)
    t0 = loop.time()
    begin, end = t0 + warm_s, t0 + warm_s + measure_s
    finished: list[float] = []
    metadata = ((TENANT, "calibration"), (PRIORITY, "standard"))

    async def client(index: int) -> None:
        n = 0
        while loop.time() < end:
            request = generate_request(MODEL, prompt(rng, f"c{index}", n), max_tokens)
            n += 1
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.ModelInfer(request, metadata=metadata, timeout=30)
                finished.append(loop.time())

    await asyncio.gather(*(client(i) for i in range(clients)))
    return sum(1 for t in finished if begin <= t < end) / measure_s
