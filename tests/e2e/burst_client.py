"""Send bursts with stock tritonclient.grpc (sync or aio) to a V2 endpoint; print one
JSON line: per burst, how many calls ended with each status.

    python tests/e2e/burst_client.py ADDRESS sync|aio

Each burst is sent at once on a fresh client (its own new connection, closed after),
so its calls are opened before the client has read the server's HTTP/2 SETTINGS:
``unary200`` and ``unary1000`` unary ModelInfer calls, and (aio) ``streams200``
ModelStreamInfer streams of one request each. A stream counts as ``OK`` when it ends
with exactly one final response and no error. Every call has a 30 s deadline.

Runs in its own process: tritonclient's generated `inference` protobuf module cannot
share a process with Meridian's (duplicate descriptor symbols).
"""

import asyncio
import json
import sys
import threading
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

MODEL = "demo-llm"
DEADLINE_S = 30.0
PARAMETERS = {"max_tokens": 2}


def text_input(module: Any, prompt: str) -> Any:
    tensor = module.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    return tensor


def status_of(error: BaseException | None) -> str:
    if error is None:
        return "OK"
    if isinstance(error, InferenceServerException):
        return f"{error.status()}: {(error.message() or '')[:100]}"
    if isinstance(error, grpc.RpcError):  # the aio stream passes grpc's error on as it is
        return f"{error.code()}: {(error.details() or '')[:100]}"
    return f"{type(error).__name__}: {str(error)[:100]}"


def sync_unary(address: str, calls: int) -> dict[str, int]:
    """``calls`` async_infer calls at once on one sync client (one channel)."""
    counts: Counter[str] = Counter()
    done = threading.Semaphore(0)
    lock = threading.Lock()

    def ended(result: Any, error: BaseException | None) -> None:
        with lock:
            counts[status_of(error)] += 1
        done.release()

    client = grpcclient.InferenceServerClient(url=address)
    try:
        for i in range(calls):
            client.async_infer(
                MODEL,
                [text_input(grpcclient, f"burst {i}")],
                ended,
                parameters=PARAMETERS,
                client_timeout=DEADLINE_S,
            )
        for _ in range(calls):
            if not done.acquire(timeout=DEADLINE_S + 5):
                break
    finally:
        client.close()
    with lock:
        return dict(counts)


async def aio_unary(address: str, calls: int) -> dict[str, int]:
    """``calls`` infer calls gathered at once on one aio client."""
    client = aioclient.InferenceServerClient(url=address)
    try:
        outcomes = await asyncio.gather(
            *(
                client.infer(
                    MODEL,
                    [text_input(aioclient, f"burst {i}")],
                    parameters=PARAMETERS,
                    client_timeout=DEADLINE_S,
                )
                for i in range(calls)
            ),
            return_exceptions=True,
        )
    finally:
        await client.close()
    return dict(Counter(status_of(o if isinstance(o, BaseException) else None) for o in outcomes))


async def aio_streams(address: str, streams: int) -> dict[str, int]:
    """``streams`` stream_infer streams at once on one aio client, one request each."""
    client = aioclient.InferenceServerClient(url=address)

    async def one(i: int) -> str:
        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {
                "model_name": MODEL,
                "inputs": [text_input(aioclient, f"stream {i}")],
                "request_id": str(i),
                "parameters": PARAMETERS,
            }

        finals = 0
        async for result, error in client.stream_infer(requests(), stream_timeout=DEADLINE_S):
            if error is not None:
                return status_of(error)
            final = result.get_response().parameters.get("triton_final_response")
            finals += bool(final is None or final.bool_param)
        return "OK" if finals == 1 else f"{finals} final responses"

    try:
        outcomes = await asyncio.gather(*(one(i) for i in range(streams)), return_exceptions=True)
    finally:
        await client.close()
    return dict(Counter(o if isinstance(o, str) else status_of(o) for o in outcomes))


async def aio_bursts(address: str) -> dict[str, dict[str, int]]:
    return {
        "unary200": await aio_unary(address, 200),
        "unary1000": await aio_unary(address, 1000),
        "streams200": await aio_streams(address, 200),
    }


def main() -> None:
    address, mode = sys.argv[1], sys.argv[2]
    if mode == "sync":
        out = {"unary200": sync_unary(address, 200), "unary1000": sync_unary(address, 1000)}
    else:
        out = asyncio.run(aio_bursts(address))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
