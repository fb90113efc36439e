"""Fuzzing the V2 request parser (``common.request.v2.parse_generate``) in process.

Beyond ``test_limits``'s property (only RouteError), these check what an error says
and what a success means, on generated requests and on the wire bytes of valid
requests mutated byte by byte (what protobuf decodes is what reaches a tier).
Deterministic (``derandomize``) and bounded; no example database is written.
"""

from __future__ import annotations

import re
import struct
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from common.basics.errors import RouteError
from common.config.access import Limits
from common.gen.inference import grpc_service_pb2 as pb
from common.request.v2 import (
    MAX_TOKENS_LIMIT,
    GenerateRequest,
    decode_bytes_tensor,
    encode_bytes_tensor,
    generate_request,
    parse_generate,
)
from tests.common.request.test_limits import infer_requests

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SMALL = Limits(max_prompt_bytes=64, max_inputs=2)
# What an error may name as the thing to fix: a field of the request, a named input
# or parameter, or the limit it broke.
FIELDS = re.compile(
    r"model_name|model_version|raw_input_contents|inputs|input ['\"]|parameter '|'max_tokens'"
    r"|text_input|limits\.max_"
)


def check(request: pb.ModelInferRequest, limits: Limits) -> GenerateRequest | None:
    """parse_generate's contract: a GenerateRequest that re-encodes to itself, or
    INVALID_ARGUMENT naming what to fix."""
    try:
        parsed = parse_generate(request, limits)
    except RouteError as err:
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, err
        assert FIELDS.search(err.message), f"names nothing to fix: {err.message!r}"
        if err.message.startswith("input "):  # it names one of the request's inputs
            shown = {f"'{t.name}'" for t in request.inputs} | {
                repr(t.name[:64]) for t in request.inputs
            }
            assert any(name in err.message for name in shown), err.message
        return None
    assert 1 <= parsed.max_tokens <= MAX_TOKENS_LIMIT
    assert len(parsed.prompt.encode()) <= limits.max_prompt_bytes
    assert parsed.model == request.model_name and parsed.model
    again = generate_request(parsed.model, parsed.prompt, parsed.max_tokens)
    again.model_version = parsed.version
    assert parse_generate(again, limits) == parsed
    return parsed


@FUZZ
@given(infer=infer_requests())
def test_generated_requests_parse_or_name_what_to_fix(infer: pb.ModelInferRequest) -> None:
    decoded = pb.ModelInferRequest.FromString(infer.SerializeToString())
    for limits in (Limits(), SMALL):
        check(decoded, limits)


def _good_wire(prompt: str, max_tokens: int) -> bytes:
    return generate_request("demo-llm", prompt, max_tokens).SerializeToString()


# Byte-level mutations of a valid request: flip, cut, insert or overwrite bytes.
MUTATION = st.tuples(
    st.sampled_from(["flip", "cut", "insert", "set"]), st.integers(0, 200), st.binary(max_size=4)
)


def mutate(wire: bytes, edits: list[tuple[str, int, bytes]]) -> bytes:
    data = bytearray(wire)
    for kind, at, blob in edits:
        i = at % (len(data) + 1)
        if kind == "flip" and i < len(data):
            data[i] ^= blob[0] if blob else 0xFF
        elif kind == "cut":
            del data[i : i + 1 + len(blob)]
        elif kind == "insert":
            data[i:i] = blob
        elif i < len(data):
            data[i : i + len(blob)] = blob
    return bytes(data)


@FUZZ
@given(
    prompt=st.text(max_size=12),
    max_tokens=st.integers(1, 300),
    edits=st.lists(MUTATION, min_size=1, max_size=4),
)
@example(prompt="hi", max_tokens=3, edits=[("set", 25, b"\x02\x01")])
@example(prompt="", max_tokens=1, edits=[("insert", 0, b"\x22\x00")])
def test_mutated_wire_bytes_parse_or_name_what_to_fix(
    prompt: str, max_tokens: int, edits: list[tuple[str, int, bytes]]
) -> None:
    wire = mutate(_good_wire(prompt, max_tokens), edits)
    try:
        request = pb.ModelInferRequest.FromString(wire)
    except DecodeError:
        return  # gRPC refuses what protobuf cannot decode before a tier sees it
    check(request, Limits())


def _raw_request(raws: list[bytes], shape: list[int], datatype: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="demo-llm")
    request.inputs.add(name="text_input", datatype=datatype, shape=shape)
    request.raw_input_contents.extend(raws)
    return request


# The worst cases met while fuzzing, kept as a seed corpus.
@FUZZ
@given(raw=st.binary(max_size=40), shape=st.lists(st.integers(-3, 2**40), max_size=3))
@example(raw=b"\xff\xff\xff\xff", shape=[1])  # a length of 4 GiB in 4 bytes
@example(raw=b"\x00\x00\x00\x00", shape=[1])  # one empty element
@example(raw=b"\x01\x00\x00\x00\xff", shape=[1])  # one byte, not UTF-8
@example(raw=b"\x01\x00\x00\x00a\x01\x00\x00\x00b", shape=[2])  # two prompts
@example(raw=encode_bytes_tensor([b"x"]), shape=[2**40, 0])  # a zero in a huge shape
@example(raw=encode_bytes_tensor([b"x"]), shape=[-1, -1])  # two negatives: product 1
@example(raw=encode_bytes_tensor([b"\xed\xa0\x80"]), shape=[1])  # a UTF-8 surrogate
@example(raw=b"\x03\x00\x00", shape=[1])  # a truncated length
def test_raw_prompts_parse_or_name_text_input(raw: bytes, shape: list[int]) -> None:
    for datatype in ("BYTES", "UINT8"):
        parsed = check(_raw_request([raw], shape, datatype), Limits())
        if parsed is not None:
            assert datatype == "BYTES" and [parsed.prompt.encode()] == decode_bytes_tensor(raw)


@FUZZ
@given(items=st.lists(st.binary(max_size=8), max_size=4))
def test_bytes_tensors_round_trip(items: list[bytes]) -> None:
    encoded = encode_bytes_tensor(items)
    decoded = decode_bytes_tensor(encoded)
    # One element filling the buffer reads back as that element alone.
    assert b"".join(decoded) == b"".join(items)
    assert encode_bytes_tensor(decoded) == encoded or len(decoded) == 1


@FUZZ
@given(
    kind=st.sampled_from(["int64_param", "uint64_param", "string_param", "double_param"]),
    value=st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=25), st.floats()),
)
@example(kind="string_param", value="\u0663")  # an Arabic-Indic digit: int() would read 3
@example(kind="string_param", value="9" * 5000)  # over int()'s digit limit
@example(kind="string_param", value=" -0 ")
def test_max_tokens_parameter_parses_or_names_it(kind: str, value: Any) -> None:
    request = generate_request("demo-llm", "hello", 2)
    param = request.parameters["max_tokens"]
    try:
        setattr(param, kind, value)
    except (TypeError, ValueError):
        return  # protobuf refuses the type or range: no client can send it
    parsed = check(request, Limits())
    if parsed is not None:
        assert kind != "double_param" and parsed.max_tokens == int(value)


@FUZZ
@given(
    datatype=st.sampled_from(["INT8", "INT32", "UINT64", "FP32", "BYTES"]),
    raw=st.binary(max_size=9),
)
@example(datatype="INT64", raw=struct.pack("<q", -(2**63)))
@example(datatype="UINT64", raw=struct.pack("<Q", 2**64 - 1))
def test_max_tokens_input_parses_or_names_it(datatype: str, raw: bytes) -> None:
    request = generate_request("demo-llm", "hello", 2)
    del request.parameters["max_tokens"]
    request.inputs.add(name="max_tokens", datatype=datatype, shape=[1])
    request.raw_input_contents.append(raw)
    check(request, Limits())
