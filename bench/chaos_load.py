"""The traffic the faults fall on, every call recorded as a ``Shot``.

*Good traffic*: tenant ``demo``, a closed loop of ``concurrency`` callers on one channel to
the global tier, each call a unary ModelInfer or (``stream_share`` of them) a one-request
ModelStreamInfer answered token by token, from one of five cities (``x-meridian-client-geo``).
*The limited tenant*: ``free-tier`` probes its quota the whole run — a few callers sending
small unary requests back to back — so that what it was served in any window can be set
against what its limits allow (``chaos_report``). A caller pauses 50 ms after a failure or a
refusal, as a client would, rather than spinning on an error.

Every call carries a W3C ``traceparent`` with a fresh trace id and the not-sampled flag (the
tiers trace none of it, yet the edge's server span takes the id), and the edge writes that id
into the call's usage record: the key that matches records to calls (``chaos_usage``).
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.routing import CLIENT_GEO, ROUTE, trailer
from common.request.v2 import FINAL_RESPONSE, STREAM, generate_request

MODEL = "demo-llm"
CITIES: dict[str, tuple[float, float]] = {
    "new-york": (40.71, -74.01),
    "dublin": (53.35, -6.26),
    "frankfurt": (50.11, 8.68),
    "singapore": (1.35, 103.82),
    "sao-paulo": (-23.55, -46.63),
}
# free-tier may be served in us-east and eu-west only (its allowed_regions).
LIMITED_CITIES = ("new-york", "dublin")
WORDS = "the quick brown fox jumps over a lazy dog while routers pick gpus".split()
PAUSE_AFTER_ERROR_S = 0.05


@dataclass(slots=True)
class Shot:
    """One call as its caller saw it (times are ``time.monotonic()``)."""

    tenant: str
    kind: str  # unary | stream (one request) | multi (a stream of many requests)
    trace_id: str
    start: float
    end: float = 0.0
    code: str = "UNKNOWN"  # OK, the call's gRPC status, or the status an in-stream error names
    detail: str = ""
    requests: int = 1
    served: int = 0  # requests answered in full (their final response arrived)
    refused: int = 0  # requests answered RESOURCE_EXHAUSTED (a limit or load shedding)
    cost: int = 0  # prompt + max_tokens of the requests served: what tokens_per_min counts
    tokens: int = 0  # completion tokens served (the emulated GPU makes exactly max_tokens)
    # (sent, answered) per request served: how many were in flight at once.
    spans: list[tuple[float, float]] = field(default_factory=list)
    route: str = ""

    @property
    def ok(self) -> bool:
        return self.code == "OK"

    @property
    def latency_s(self) -> float:
        return self.end - self.start


def traceparent() -> tuple[str, str]:
    """(trace id, W3C traceparent) for one call; flag 00: the tiers do not record it."""
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-00"


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def metadata_for(key: str, city: str, parent: str) -> tuple[tuple[str, str], ...]:
    lat, lon = CITIES[city]
    return (
        ("authorization", f"Bearer {key}"),
        (CLIENT_GEO, f"{lat},{lon}"),
        ("traceparent", parent),
    )


async def unary(
    stub: pb_grpc.GRPCInferenceServiceStub,
    shot: Shot,
    request: pb.ModelInferRequest,
    metadata: Sequence[tuple[str, str]],
    timeout_s: float,
) -> None:
    """One ModelInfer into ``shot``."""
    max_tokens = request.parameters["max_tokens"].int64_param
    try:
        call = stub.ModelInfer(request, metadata=metadata, timeout=timeout_s)
        await call
        shot.route = trailer(await call.trailing_metadata(), ROUTE) or ""
        shot.code, shot.served, shot.tokens = "OK", 1, max_tokens
        shot.cost = prompt_tokens(request) + max_tokens
        shot.spans.append((shot.start, time.monotonic()))
    except grpc.aio.AioRpcError as exc:
        shot.code, shot.detail = exc.code().name, exc.details() or ""
        shot.refused = int(exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)
    finally:
        shot.end = time.monotonic()


def prompt_tokens(request: pb.ModelInferRequest) -> int:
    """The prompt's whitespace words: the router's and the emulator's token count."""
    raw = request.raw_input_contents[0]
    return len(raw[4:].decode("utf-8", "replace").split())


async def stream(
    stub: pb_grpc.GRPCInferenceServiceStub,
    shot: Shot,
    requests: Sequence[pb.ModelInferRequest],
    metadata: Sequence[tuple[str, str]],
    timeout_s: float,
) -> None:
    """One ModelStreamInfer carrying ``requests`` (each with its own ``id``) into ``shot``:
    all are sent at once, then the stream is half-closed and read to its end."""

    async def send() -> AsyncIterator[pb.ModelInferRequest]:
        for request in requests:
            yield request

    sizes = {r.id: (prompt_tokens(r), r.parameters["max_tokens"].int64_param) for r in requests}
    errors: list[str] = []
    try:
        call = stub.ModelStreamInfer(send(), metadata=metadata, timeout=timeout_s)
        async for response in call:
            now = time.monotonic()
            if response.error_message:
                code, _, detail = response.error_message.partition(":")
                shot.refused += code == "RESOURCE_EXHAUSTED"
                errors.append(code)
                shot.detail = shot.detail or detail.strip()
                continue
            rid = response.infer_response.id
            if response.infer_response.parameters[FINAL_RESPONSE].bool_param:
                words, max_tokens = sizes.get(rid, (0, 0))
                shot.served += 1
                shot.tokens += max_tokens
                shot.cost += words + max_tokens
                # In flight from the moment it was sent (all at once, at the start).
                shot.spans.append((shot.start, now))
        shot.route = trailer(await call.trailing_metadata(), ROUTE) or ""
        shot.code = "OK" if shot.served == shot.requests else (errors or ["INCOMPLETE"])[0]
    except grpc.aio.AioRpcError as exc:
        shot.code, shot.detail = exc.code().name, exc.details() or ""
    finally:
        shot.end = time.monotonic()


@dataclass
class Load:
    """Where calls go and what came back; ``running`` goes False at the end or when
    ``max_shots`` calls were made (every loop is bounded in count and in time)."""

    target: str
    keys: dict[str, str]
    max_shots: int
    timeout_s: float
    shots: list[Shot] = field(default_factory=list)
    stopping: bool = False

    @property
    def running(self) -> bool:
        return not self.stopping and len(self.shots) < self.max_shots

    def new_shot(self, tenant: str, kind: str, requests: int = 1) -> tuple[Shot, str]:
        trace_id, parent = traceparent()
        shot = Shot(tenant, kind, trace_id, time.monotonic(), requests=requests)
        self.shots.append(shot)
        return shot, parent


async def good_caller(
    load: Load, stub: pb_grpc.GRPCInferenceServiceStub, rng: random.Random, stream_share: float
) -> None:
    """Tenant demo: one call after another, unary or a token stream, from a random city."""
    while load.running:
        city = rng.choice(list(CITIES))
        streamed = rng.random() < stream_share
        shot, parent = load.new_shot("demo", "stream" if streamed else "unary")
        metadata = metadata_for(load.keys["demo"], city, parent)
        request = generate_request(MODEL, prompt(rng, rng.randint(8, 48)), 16, stream=streamed)
        if streamed:
            request.id = f"{shot.trace_id[:12]}-0"
            await stream(stub, shot, [request], metadata, load.timeout_s)
        else:
            await unary(stub, shot, request, metadata, load.timeout_s)
        if not shot.ok:
            await asyncio.sleep(PAUSE_AFTER_ERROR_S)


async def limited_caller(
    load: Load, stub: pb_grpc.GRPCInferenceServiceStub, rng: random.Random, tenant: str
) -> None:
    """The limited tenant's quota probe: small unary requests back to back."""
    while load.running:
        shot, parent = load.new_shot(tenant, "unary")
        metadata = metadata_for(load.keys[tenant], rng.choice(LIMITED_CITIES), parent)
        request = generate_request(MODEL, prompt(rng, 6), 8)
        await unary(stub, shot, request, metadata, load.timeout_s)
        if not shot.ok:
            await asyncio.sleep(PAUSE_AFTER_ERROR_S)


async def multi_caller(
    load: Load,
    stub: pb_grpc.GRPCInferenceServiceStub,
    rng: random.Random,
    tenant: str,
    until: float,
    *,
    per_stream: int,
    max_tokens: int,
) -> None:
    """The limited tenant's multi-request streams: ``per_stream`` whole-text requests
    (``stream: false``) of ``max_tokens`` each in one ModelStreamInfer, until ``until``."""
    while load.running and time.monotonic() < until:
        shot, parent = load.new_shot(tenant, "multi", per_stream)
        metadata = metadata_for(load.keys[tenant], rng.choice(LIMITED_CITIES), parent)
        requests = []
        for i in range(per_stream):
            request = generate_request(MODEL, prompt(rng, 4), max_tokens)
            request.parameters[STREAM].bool_param = False  # unset means token by token
            request.id = f"{shot.trace_id[:12]}-{i}"
            requests.append(request)
        await stream(stub, shot, requests, metadata, max(60.0, load.timeout_s))
        if not shot.served:
            await asyncio.sleep(PAUSE_AFTER_ERROR_S)
