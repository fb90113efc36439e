"""Fuzzing the two edges through real servers on loopback: a chain (global with its
OpenAI HTTP edge → regional → local → an emulated GPU, tenants on, the session's
Redis) takes generated OpenAI bodies and V2 requests from a stock HTTP client and a
gRPC client.

The oracle is the parser run in this process: a request it refuses is answered with
exactly 400 / INVALID_ARGUMENT and reaches no GPU, one it accepts is served (200 /
OK); and every call leaves exactly one usage record, with its status, found by the
trace id the call carried (nothing lost, nothing counted twice). Hypothesis runs in
a worker thread (it drives blocking clients) while the servers run on the test's
loop; it is deterministic and bounded.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from common.basics.errors import RouteError
from common.basics.redis_embed import EmbeddedRedis
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.openai_http import _json
from common.request.openai_v2 import ROUTE_CHAT, ROUTE_COMPLETIONS, parse_openai
from common.request.v2 import generate_request, parse_generate
from tests.common.request.test_fuzz_v2 import MUTATION, mutate
from tests.e2e.openai_chain import MODEL, Chain, openai_chain

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=20,
    suppress_health_check=list(HealthCheck),
)
PLAIN = st.characters(exclude_categories=["Cs"])  # what UTF-8 (a V2 prompt) can carry
PATHS = {ROUTE_COMPLETIONS: "/completions", ROUTE_CHAT: "/chat/completions"}
STATUS_NAME = {200: "OK", 400: "INVALID_ARGUMENT", 404: "NOT_FOUND"}


def traceparent() -> tuple[str, str]:
    trace = uuid.uuid4().hex
    return trace, f"00-{trace}-{'1' * 16}-01"


def one_record(chain: Chain, trace: str, status: str) -> None:
    """Exactly one usage record of the gold tenant carries ``trace``, with ``status``
    (the edge writes its records every 0.1 s; the stream is read until it is there)."""
    for _ in range(100):
        found = [r for r in chain.usage("gold") if r.trace_id == trace]
        if found:
            break
        time.sleep(0.05)
    assert [r.status for r in found] == [status], (trace, found)


# ------------------------------------------------------------------------------ OpenAI

TEXT = st.one_of(st.text(max_size=8), st.sampled_from(["\ud800", "hi there", "\x00"]))
SMALL_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(), TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=2), st.dictionaries(TEXT, inner, max_size=2)),
    max_leaves=4,
)
# One field of a good body made wrong, half of the time.
FIELD_CHANGES = st.one_of(
    st.tuples(st.just("model"), st.sampled_from(["gpt-17", "", "\udc00", None])),
    st.tuples(st.just("prompt"), st.one_of(TEXT, st.lists(TEXT, max_size=2), SMALL_JSON)),
    st.tuples(
        st.just("messages"),
        st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "robot"]), "content": TEXT}
                ),
                min_size=1,
                max_size=2,
            ),
            SMALL_JSON,
        ),
    ),
    st.tuples(st.sampled_from(["max_tokens", "n", "stream_options", "stream"]), SMALL_JSON),
)


@st.composite
def openai_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    route = draw(st.sampled_from(sorted(PATHS)))
    body: dict[str, Any] = {"model": MODEL, "max_tokens": draw(st.integers(1, 3))}
    if route == ROUTE_CHAT:
        body["messages"] = [{"role": "user", "content": draw(st.text(max_size=12))}]
    else:
        body["prompt"] = draw(st.text(max_size=12))
    if draw(st.booleans()):
        key, value = draw(FIELD_CHANGES)
        body[key] = value
    if draw(st.integers(0, 9)) == 0:
        return route, draw(st.binary(max_size=12))
    return route, json.dumps(body).encode()


def expected_status(route: str, raw: bytes) -> int:
    """What the edge must answer, by the parser run here."""
    try:
        request = parse_openai(route, _json(raw))
    except RouteError:
        return 400
    return 200 if request.model == MODEL else 404


def post(chain: Chain, route: str, raw: bytes, trace: str) -> tuple[int, dict[str, Any]]:
    headers = {**chain.auth("gold"), "Content-Type": "application/json", "traceparent": trace}
    request = urllib.request.Request(chain.base_url + PATHS[route], raw, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())


def throw_openai(chain: Chain) -> None:
    @FUZZ
    @given(case=openai_bodies())
    @example(case=(ROUTE_COMPLETIONS, b'{"model": "m", "prompt": "\\ud800"}'))  # was a 500
    @example(case=(ROUTE_CHAT, b"[" * 100_000))  # was a 500
    @example(case=(ROUTE_COMPLETIONS, b'{"model": "m", "prompt": "x", "max_tokens": 1e999}'))
    def throw(case: tuple[str, bytes]) -> None:
        route, raw = case
        want = expected_status(route, raw)
        served = chain.served()
        trace, header = traceparent()
        status, body = post(chain, route, raw, header)
        assert status == want, (status, body)
        assert ("error" in body) == (status != 200), body
        assert chain.served() == served + (status == 200)
        one_record(chain, trace, STATUS_NAME[status])

    throw()


async def test_generated_openai_bodies_get_their_exact_status_and_one_usage_record(
    redis_server: EmbeddedRedis,
) -> None:
    async with openai_chain(redis_server.url) as chain:
        await asyncio.to_thread(throw_openai, chain)


# ---------------------------------------------------------------------------------- V2


@st.composite
def v2_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    """A good generate request for the chain's model, half of the time with one part
    made wrong: the prompt's datatype, shape or bytes, max_tokens, or the wire bytes."""
    infer = generate_request(MODEL, draw(st.text(PLAIN, max_size=12)), draw(st.integers(1, 3)))
    change = draw(st.sampled_from(["none", "datatype", "shape", "raw", "max", "wire"]))
    tensor = infer.inputs[0]
    if change == "datatype":
        tensor.datatype = draw(st.sampled_from(["UINT8", "BYTE", "bytes", ""]))
    elif change == "shape":
        del tensor.shape[:]
        tensor.shape.extend(draw(st.lists(st.integers(-2, 2**40), max_size=3)))
    elif change == "raw":
        infer.raw_input_contents[0] = draw(st.binary(max_size=10))
    elif change == "max":
        kind, value = draw(
            st.sampled_from(
                [
                    ("int64_param", 0),
                    ("int64_param", 8193),
                    ("string_param", "2"),
                    ("bool_param", True),
                ]
            )
        )
        setattr(infer.parameters["max_tokens"], kind, value)
    elif change == "wire":
        wire = mutate(infer.SerializeToString(), draw(st.lists(MUTATION, min_size=1, max_size=2)))
        try:
            return pb.ModelInferRequest.FromString(wire)
        except DecodeError:
            return infer  # gRPC's own refusal, before any Meridian code: send the good one
    return infer


def throw_v2(chain: Chain) -> None:
    auth = (("authorization", f"Bearer {chain.keys['gold']}"),)
    with grpc.insecure_channel(chain.v2_address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        @FUZZ
        @given(infer=v2_requests())
        @example(infer=generate_request(MODEL, "hi", 2))
        def throw(infer: pb.ModelInferRequest) -> None:
            try:
                parse_generate(infer)
                want = grpc.StatusCode.OK
            except RouteError:
                want = grpc.StatusCode.INVALID_ARGUMENT
            if want == grpc.StatusCode.OK and infer.model_name != MODEL:
                return  # an unknown model: not this parser's answer
            served = chain.served()
            trace, header = traceparent()
            metadata = (*auth, ("traceparent", header))
            try:
                stub.ModelInfer(infer, metadata=metadata, timeout=10)
                code = grpc.StatusCode.OK
            except grpc.RpcError as err:
                code = err.code()
                assert err.details(), code
            assert code == want, (code, infer)
            assert chain.served() == served + (code == grpc.StatusCode.OK)
            one_record(chain, trace, code.name)

        throw()


async def test_generated_v2_requests_get_their_exact_status_and_one_usage_record(
    redis_server: EmbeddedRedis,
) -> None:
    async with openai_chain(redis_server.url) as chain:
        await asyncio.to_thread(throw_v2, chain)
