"""Bad input, unit level: size limits, request shapes, metadata formats, and the config keys.

The Hypothesis strategies at the bottom (``infer_requests``, ``wire_metadata``)
are shared with ``tests/e2e/test_bad_input.py``, which throws the same kind of
requests at a running edge.
"""

from __future__ import annotations

import copy
import struct
from typing import Any

import grpc
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli.launcher import DEMO_FLEET
from common.basics.errors import RouteError
from common.basics.vocabulary import PRIORITY_NAMES
from common.config.access import Limits
from common.config.node import ConfigError, Endpoint
from common.config.topology import topology_from_mapping
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.prefix import PREFIX_BLOCKS
from common.request.routing import (
    ATTEMPT,
    CLIENT_GEO,
    CLIENT_REGION,
    INTERNAL_KEYS,
    LOAD,
    ORIGIN,
    PRIORITY,
    ROUTE,
    SESSION,
    TENANT,
    parse_hints,
)
from common.request.server import V2Server
from common.request.v2 import DEFAULT_LIMITS, encode_bytes_tensor, generate_request, parse_generate

REAL_MODEL = "demo-llm"
KIB = 1024


def invalid(request: pb.ModelInferRequest, limits: Limits = DEFAULT_LIMITS) -> str:
    """The INVALID_ARGUMENT message ``parse_generate`` gives ``request``."""
    with pytest.raises(RouteError) as err:
        parse_generate(request, limits)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
    return err.value.message


def invalid_hints(metadata: list[tuple[str, Any]], *, trust_internal: bool = False) -> str:
    with pytest.raises(RouteError) as err:
        parse_hints(metadata, trust_internal=trust_internal)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
    return err.value.message


def with_extra_inputs(request: pb.ModelInferRequest, count: int) -> pb.ModelInferRequest:
    for i in range(count):
        request.inputs.add(name=f"extra_{i}", datatype="FP32", shape=[1])
        request.raw_input_contents.append(struct.pack("<f", 0.5))
    return request


def typed_prompt(shape: list[int]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=REAL_MODEL)
    tensor = request.inputs.add(name="text_input", datatype="BYTES", shape=shape)
    tensor.contents.bytes_contents.append(b"hello")
    return request


# --------------------------------------------------------------------------- config


def demo_raw() -> dict[str, Any]:
    raw: dict[str, Any] = copy.deepcopy(yaml.safe_load(DEMO_FLEET.read_text()))
    raw["auth"] = {"enabled": False, "tenants": []}
    return raw


def config_error(limits: Any) -> str:
    raw = demo_raw()
    raw["limits"] = limits
    with pytest.raises(ConfigError) as err:
        topology_from_mapping(raw)
    return str(err.value)


def test_limits_default_when_absent() -> None:
    limits = topology_from_mapping(demo_raw()).limits
    assert limits == Limits(
        max_message_bytes=4 * KIB * KIB,
        max_prompt_bytes=256 * KIB,
        max_inputs=16,
        max_metadata_bytes=16 * KIB,
    )


def test_limits_read_from_topology() -> None:
    raw = demo_raw()
    raw["limits"] = {"max_message_bytes": 1_000_000, "max_inputs": 4}
    limits = topology_from_mapping(raw).limits
    assert (limits.max_message_bytes, limits.max_inputs) == (1_000_000, 4)
    assert limits.max_prompt_bytes == 256 * KIB  # unset keys keep their defaults


def test_limits_unknown_key_names_its_path() -> None:
    assert config_error({"max_prompt_kb": 3}).startswith("limits.max_prompt_kb: unknown key")


def test_limits_not_a_mapping() -> None:
    assert config_error(4096).startswith("limits: expected a mapping")


def test_limits_non_integer_names_its_path() -> None:
    message = config_error({"max_message_bytes": "4MiB"})
    assert message.startswith("limits.max_message_bytes: expected int")


def test_limits_boolean_is_not_an_integer() -> None:
    assert config_error({"max_inputs": True}).startswith("limits.max_inputs: expected int")


def test_limits_zero_names_its_path() -> None:
    assert config_error({"max_inputs": 0}).startswith("limits.max_inputs: must be between 1")


def test_limits_above_what_grpc_can_hold() -> None:
    message = config_error({"max_message_bytes": 2**31})
    assert message.startswith("limits.max_message_bytes: must be between 1 and 2147483647")


def test_limits_metadata_below_grpc_own_headers() -> None:
    message = config_error({"max_metadata_bytes": 1024})
    assert message.startswith("limits.max_metadata_bytes: must be between 8192")


def test_stream_limits_default_when_absent() -> None:
    limits = topology_from_mapping(demo_raw()).limits
    assert (
        limits.max_stream_requests_in_flight,
        limits.stream_write_timeout_s,
        limits.stream_idle_timeout_s,
        limits.max_streams_per_connection,
        limits.max_queued_calls_per_connection,
        limits.max_open_streams_per_tenant,
    ) == (8, 10.0, 300.0, 2**31 - 1, 1024, 128)  # no stock client meets the connection's


def test_stream_limits_read_from_topology() -> None:
    raw = demo_raw()
    raw["limits"] = {
        "max_stream_requests_in_flight": 2,
        "stream_write_timeout_s": 1.5,
        "stream_idle_timeout_s": 30,
        "max_streams_per_connection": 10,
        "max_queued_calls_per_connection": 20,
        "max_open_streams_per_tenant": 3,
    }
    limits = topology_from_mapping(raw).limits
    assert (
        limits.max_stream_requests_in_flight,
        limits.stream_write_timeout_s,
        limits.stream_idle_timeout_s,
        limits.max_streams_per_connection,
        limits.max_queued_calls_per_connection,
        limits.max_open_streams_per_tenant,
    ) == (2, 1.5, 30.0, 10, 20, 3)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("max_stream_requests_in_flight", 0, "must be between 1 and"),
        ("max_streams_per_connection", -1, "must be between 1 and"),
        ("max_streams_per_connection", 2**31, "must be between 1 and 2147483647"),
        ("max_queued_calls_per_connection", 0, "must be between 1 and"),
        ("max_open_streams_per_tenant", 2.5, "expected int"),
        ("stream_write_timeout_s", 0, "must be > 0 and at most 86400 s"),
        ("stream_idle_timeout_s", float("nan"), "expected float, got nan"),
        ("stream_idle_timeout_s", 1e9, "must be > 0 and at most 86400 s"),
        ("stream_write_timeout_s", "10s", "expected float"),
        ("stream_write_timeout_s", True, "expected float"),
    ],
)
def test_stream_limits_bad_values_name_their_key(key: str, value: Any, expected: str) -> None:
    message = config_error({key: value})
    assert message.startswith(f"limits.{key}: {expected}"), message


def test_limits_prompt_limit_must_fit_in_a_message() -> None:
    message = config_error({"max_message_bytes": 100_000, "max_prompt_bytes": 100_000})
    assert message.startswith("limits.max_prompt_bytes: 100000 can never be reached")
    assert "limits.max_message_bytes" in message


# --------------------------------------------------------------------------- prompt and inputs


def test_default_prompt_limit_is_256_kib() -> None:
    assert parse_generate(generate_request(REAL_MODEL, "a" * (256 * KIB))).prompt
    message = invalid(generate_request(REAL_MODEL, "a" * (256 * KIB + 1)))
    assert "'text_input'" in message and "262144" in message


def test_prompt_at_limit_accepted() -> None:
    gen = parse_generate(generate_request(REAL_MODEL, "x" * 100), Limits(max_prompt_bytes=100))
    assert len(gen.prompt) == 100


def test_prompt_over_limit_names_text_input_and_limit() -> None:
    message = invalid(generate_request(REAL_MODEL, "x" * 101), Limits(max_prompt_bytes=100))
    assert message == (
        "input 'text_input' is 101 bytes; the limit is 100 bytes (limits.max_prompt_bytes)"
    )


def test_prompt_limit_counts_utf8_bytes_not_characters() -> None:
    # 40 characters, 80 bytes of UTF-8.
    message = invalid(generate_request(REAL_MODEL, "é" * 40), Limits(max_prompt_bytes=79))
    assert "80 bytes" in message


def test_prompt_limit_applies_to_typed_contents() -> None:
    request = typed_prompt([1])
    request.inputs[0].contents.bytes_contents[0] = b"y" * 11
    assert "limits.max_prompt_bytes" in invalid(request, Limits(max_prompt_bytes=10))


def test_inputs_at_limit_accepted() -> None:
    request = with_extra_inputs(generate_request(REAL_MODEL, "hi"), 15)
    assert parse_generate(request).prompt == "hi"


def test_too_many_inputs_names_the_limit() -> None:
    request = with_extra_inputs(generate_request(REAL_MODEL, "hi"), 16)
    assert invalid(request) == (
        "the request has 17 inputs; at most 16 are accepted (limits.max_inputs)"
    )


def test_unknown_extra_inputs_are_fine() -> None:
    request = generate_request(REAL_MODEL, "hi")
    odd = request.inputs.add(name="image", datatype="FP32", shape=[3, -7])
    request.raw_input_contents.append(b"\x00")  # not interpreted: the model's business
    assert odd.name == "image" and parse_generate(request).prompt == "hi"


def test_duplicate_input_name_rejected() -> None:
    request = generate_request(REAL_MODEL, "one")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(encode_bytes_tensor([b"two"]))
    assert invalid(request) == "input 'text_input' appears more than once"


def test_model_name_too_long() -> None:
    message = invalid(generate_request("m" * 257, "hi"))
    assert message == "model_name is 257 characters long; at most 256 are accepted"


def test_model_version_too_long() -> None:
    request = generate_request(REAL_MODEL, "hi")
    request.model_version = "9" * 300
    assert invalid(request).startswith("model_version is 300 characters long")


# --------------------------------------------------------------------------- shapes


def test_shape_larger_than_contents() -> None:
    message = invalid(typed_prompt([2]))
    assert message == (
        "input 'text_input' has shape [2] but holds 1 element(s); "
        "the shape must match the contents (e.g. [1])"
    )


def test_shape_with_zero_dimension() -> None:
    assert "has shape [0] but holds 1" in invalid(typed_prompt([0]))


def test_shape_of_two_dimensions_with_two_elements() -> None:
    assert "has shape [1, 2]" in invalid(typed_prompt([1, 2]))


def test_negative_dimension() -> None:
    assert invalid(typed_prompt([-1])) == (
        "input 'text_input' has a negative dimension in shape [-1]"
    )


def test_huge_shape_rejected_without_overflow() -> None:
    assert "but holds 1 element" in invalid(typed_prompt([2**63 - 1, 2**63 - 1]))


def test_equivalent_shapes_accepted() -> None:
    for shape in ([1], [1, 1], []):  # [] is a scalar: one element
        assert parse_generate(typed_prompt(shape)).prompt == "hello"


def test_max_tokens_input_shape_must_match() -> None:
    request = typed_prompt([1])
    limit = request.inputs.add(name="max_tokens", datatype="INT32", shape=[4])
    limit.contents.int_contents.append(5)
    assert "input 'max_tokens' has shape [4] but holds 1" in invalid(request)


# --------------------------------------------------------------------------- max_tokens


@pytest.mark.parametrize(
    ("datatype", "raw"),
    [
        ("INT8", struct.pack("<b", 7)),
        ("UINT16", struct.pack("<H", 7)),
        ("INT32", struct.pack("<i", 7)),
        ("UINT64", struct.pack("<Q", 7)),
    ],
)
def test_raw_max_tokens_of_each_width(datatype: str, raw: bytes) -> None:
    request = generate_request(REAL_MODEL, "hi")
    del request.parameters["max_tokens"]
    request.inputs.add(name="max_tokens", datatype=datatype, shape=[1])
    request.raw_input_contents.append(raw)
    assert parse_generate(request).max_tokens == 7


def test_raw_max_tokens_of_wrong_length() -> None:
    request = generate_request(REAL_MODEL, "hi")
    request.inputs.add(name="max_tokens", datatype="INT64", shape=[1])
    request.raw_input_contents.append(b"\x01\x02\x03")
    assert invalid(request) == (
        "input 'max_tokens' must hold exactly one INT64 element (8 raw bytes), got 3 bytes"
    )


def test_max_tokens_in_two_typed_fields_is_two_elements() -> None:
    request = typed_prompt([1])
    limit = request.inputs.add(name="max_tokens", datatype="INT64", shape=[1])
    limit.contents.int_contents.append(3)
    limit.contents.int64_contents.append(4)
    assert invalid(request) == "input 'max_tokens' must hold exactly one element"


def test_max_tokens_of_float_datatype() -> None:
    request = typed_prompt([1])
    request.inputs.add(name="max_tokens", datatype="FP32", shape=[1])
    assert invalid(request) == "input 'max_tokens' must be an integer tensor, got 'FP32'"


def test_huge_unsigned_max_tokens() -> None:
    request = generate_request(REAL_MODEL, "hi")
    request.parameters["max_tokens"].uint64_param = 2**64 - 1
    assert "between 1 and 8192" in invalid(request)


def test_string_max_tokens_accepted() -> None:
    request = generate_request(REAL_MODEL, "hi")
    request.parameters["max_tokens"].string_param = " 12 "
    assert parse_generate(request).max_tokens == 12


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("--5", id="two-minus-signs"),
        pytest.param("\u00b2", id="superscript-digit"),
        pytest.param("\u0663", id="arabic-indic-digit"),
        pytest.param("9" * 5000, id="more-digits-than-int-accepts"),
        pytest.param("", id="empty"),
    ],
)
def test_string_max_tokens_that_is_not_a_plain_integer(text: str) -> None:
    request = generate_request(REAL_MODEL, "hi")
    request.parameters["max_tokens"].string_param = text
    assert invalid(request).startswith("parameter 'max_tokens' must be an integer, got string")


# --------------------------------------------------------------------------- metadata


def test_control_character_in_a_client_key_names_it() -> None:
    message = invalid_hints([(SESSION, "conv\n1")])
    assert message == (
        f"metadata '{SESSION}' must be printable ASCII; it holds control or non-ASCII characters"
    )


def test_non_ascii_in_a_client_key_names_it() -> None:
    # What gRPC hands over for the raw byte 0xff (it decodes invalid UTF-8 as Latin-1).
    assert f"'{CLIENT_REGION}' must be printable ASCII" in invalid_hints(
        [(CLIENT_REGION, "eu-west\u00ff")]
    )


def test_control_character_in_internal_key_at_inner_tier() -> None:
    message = invalid_hints([(TENANT, "gold\x00")], trust_internal=True)
    assert f"'{TENANT}' must be printable ASCII" in message


def test_bad_trace_context_is_dropped_not_refused() -> None:
    hints = parse_hints(
        [("traceparent", "00-abc\r\n-01"), ("tracestate", "k=" + "v" * 300)],
        trust_internal=False,
    )
    assert hints.passed_down == ()


def test_unknown_meridian_key_at_the_edge_names_it() -> None:
    message = invalid_hints([("x-meridian-prority", "critical")])
    assert message.startswith("unknown metadata key 'x-meridian-prority'; Meridian reads ")
    assert PRIORITY in message and SESSION in message


def test_binary_variant_of_a_client_key_is_unknown() -> None:
    assert "'x-meridian-session-bin'" in invalid_hints([("x-meridian-session-bin", b"\x00")])


@pytest.mark.parametrize("key", [ROUTE, LOAD, "x-meridian-capacity"])
def test_response_trailer_sent_as_request_metadata_is_unknown(key: str) -> None:
    assert f"'{key}'" in invalid_hints([(key, "us-east/us-east-1a/gpu0")])


def test_unknown_meridian_key_ignored_by_inner_tiers() -> None:
    # A newer tier above may add a key during a rolling upgrade.
    hints = parse_hints([("x-meridian-future", "1"), (SESSION, "s")], trust_internal=True)
    assert hints.session == "s"


def test_other_keys_are_not_meridian_business() -> None:
    hints = parse_hints(
        [("user-agent", "x\x01"), ("x-meridianish", "1"), ("authorization", "Bearer \u00ff")],
        trust_internal=False,
    )
    assert hints.passed_down == ()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (TENANT, "gold"),
        (ORIGIN, "1.35,103.82"),
        (ATTEMPT, "7"),
        (PREFIX_BLOCKS, "not-hex"),  # malformed too: never parsed at the edge
    ],
)
def test_forged_internal_key_changes_nothing_at_the_edge(key: str, value: str) -> None:
    honest = [(CLIENT_GEO, "53.35,-6.26"), (SESSION, "conv-1")]
    # Everything routing, quotas and the tiers below read is as if it were never sent.
    forged = parse_hints([*honest, (key, value)], trust_internal=False)
    assert forged == parse_hints(honest, trust_internal=False)


# --------------------------------------------------------------------------- gRPC server limits


class _Echo(pb_grpc.GRPCInferenceServiceServicer):
    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> Any:
        return pb.ModelInferResponse(model_name=request.model_name)


SMALL = Limits(
    max_message_bytes=64 * KIB, max_prompt_bytes=KIB, max_inputs=4, max_metadata_bytes=8 * KIB
)


async def _call(server: V2Server, request: pb.ModelInferRequest, metadata: Any = ()) -> Any:
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        try:
            return await stub.ModelInfer(request, metadata=metadata, timeout=5)
        except grpc.aio.AioRpcError as err:
            return err


async def _serving(limits: Limits | None) -> V2Server:
    server = V2Server(_Echo(), Endpoint("127.0.0.1", 0), limits=limits)
    await server.start()
    return server


async def test_server_refuses_a_message_over_the_limit() -> None:
    server = await _serving(SMALL)
    try:
        fits = await _call(server, pb.ModelInferRequest(model_name="m" * (60 * KIB)))
        assert isinstance(fits, pb.ModelInferResponse)
        err = await _call(server, pb.ModelInferRequest(model_name="m" * (64 * KIB)))
        assert isinstance(err, grpc.aio.AioRpcError)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Received message larger than max" in (err.details() or "")
        assert "65536" in (err.details() or "")
    finally:
        await server.stop(0)


async def test_server_metadata_limit_is_exact_not_probabilistic() -> None:
    # gRPC alone refuses a random share of requests between its soft and hard
    # limits; both are set to max_metadata_bytes, so the answer is always the same.
    server = await _serving(SMALL)
    try:
        for _ in range(5):
            ok = await _call(server, pb.ModelInferRequest(model_name="m"), [("x-pad", "a" * 7000)])
            assert isinstance(ok, pb.ModelInferResponse)
            err = await _call(server, pb.ModelInferRequest(model_name="m"), [("x-pad", "a" * 8300)])
            assert isinstance(err, grpc.aio.AioRpcError)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "metadata size exceeds hard limit" in (err.details() or "")
    finally:
        await server.stop(0)


async def test_server_defaults_to_default_limits() -> None:
    server = await _serving(None)
    try:
        assert server.limits == Limits()
        big = pb.ModelInferRequest(model_name="m" * (4 * KIB * KIB + 1))
        err = await _call(server, big)
        assert isinstance(err, grpc.aio.AioRpcError)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await server.stop(0)


# --------------------------------------------------------------------------- generated input

DATATYPES = (
    "BYTES",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "FP16",
    "FP32",
    "FP64",
    "BOOL",
    "BF16",
)
PRINTABLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=24)
INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
# Mostly short valid lengths, so generated requests that do run finish fast.
MAX_TOKENS = st.one_of(st.integers(1, 6), st.sampled_from([0, -1, 8193, 2**63 - 1, -(2**63)]))
# One in twenty is over the 256 KiB prompt limit.
PROMPTS = st.integers(0, 19).flatmap(
    lambda i: st.just("word " * 60_000) if i == 0 else st.text(max_size=30)
)
DIMS = st.one_of(st.integers(-2, 3), st.sampled_from([2**31, 2**62, 2**63 - 1, -(2**63)]))
RAW = st.one_of(
    st.binary(max_size=24),
    st.lists(st.binary(max_size=12), max_size=3).map(encode_bytes_tensor),
    PROMPTS.map(lambda p: encode_bytes_tensor([p.encode()])),
    st.integers(-(2**31), 2**31 - 1).map(lambda v: struct.pack("<i", v)),
    INT64.map(lambda v: struct.pack("<q", v)),
)
INPUT_NAMES = st.one_of(
    st.sampled_from(["image", "image", "text_input", "max_tokens", "stream"]), st.text(max_size=10)
)
PARAM_NAMES = st.one_of(
    st.just("max_tokens"),
    st.sampled_from(["stream", "priority", "triton_final_response"]),
    st.text(max_size=10),
)
PARAM_VALUES = st.one_of(
    st.tuples(st.just("bool_param"), st.booleans()),
    st.tuples(st.just("int64_param"), st.one_of(MAX_TOKENS, INT64)),
    st.tuples(st.just("uint64_param"), UINT64),
    st.tuples(
        st.just("string_param"),
        st.one_of(
            st.sampled_from(["--5", "\u00b2", "9" * 30, "9" * 5000, " 3 ", "-0"]),
            st.text(max_size=12),
        ),
    ),
    st.tuples(st.just("double_param"), st.floats()),
)


def _fill_typed(draw: Any, tensor: pb.ModelInferRequest.InferInputTensor) -> None:
    kind = draw(st.sampled_from(["bytes", "int", "int64", "uint", "uint64", "fp32", "bool", ""]))
    contents = tensor.contents
    if kind == "bytes":
        prompts = st.one_of(st.binary(max_size=16), PROMPTS.map(str.encode))
        contents.bytes_contents.extend(draw(st.lists(prompts, max_size=3)))
    elif kind == "int":
        contents.int_contents.extend(draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3)))
    elif kind == "int64":
        contents.int64_contents.extend(draw(st.lists(INT64, max_size=3)))
    elif kind == "uint":
        contents.uint_contents.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=3)))
    elif kind == "uint64":
        contents.uint64_contents.extend(draw(st.lists(UINT64, max_size=3)))
    elif kind == "fp32":
        contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=3)))
    elif kind == "bool":
        contents.bool_contents.extend(draw(st.lists(st.booleans(), max_size=3)))


def _one_in(draw: Any, n: int) -> bool:
    return draw(st.integers(0, n - 1)) == 0


@st.composite
def infer_requests(draw: Any) -> pb.ModelInferRequest:
    """V2 ModelInferRequests, well-formed generate requests and every kind of broken one.

    About a third are valid for the real model, so the tier also has work to do.
    """
    if _one_in(draw, 3):
        request = generate_request(REAL_MODEL, draw(st.text(max_size=30)), draw(st.integers(1, 6)))
        request.id = draw(PRINTABLE)
        if draw(st.booleans()):
            request.parameters["stream"].bool_param = draw(st.booleans())
        if draw(st.booleans()):  # an input the model may use; not the router's business
            request.inputs.add(name="image", datatype="UINT8", shape=[2])
            request.raw_input_contents.append(b"\x00\x01")
        return request
    pick = draw(st.integers(0, 9))
    model = (REAL_MODEL, REAL_MODEL, REAL_MODEL, REAL_MODEL, REAL_MODEL, REAL_MODEL, "", "gpt-17")
    name = model[pick] if pick < len(model) else draw(PRINTABLE.filter(bool))
    if not _one_in(draw, 4):
        request = generate_request(name, draw(PROMPTS), draw(MAX_TOKENS))
    else:
        request = pb.ModelInferRequest(model_name=name)
    if _one_in(draw, 3):
        request.model_version = draw(st.one_of(st.sampled_from(["1", "2"]), PRINTABLE))
    request.id = draw(PRINTABLE)
    use_raw = len(request.raw_input_contents) > 0 or draw(st.booleans())
    for _ in range(draw(st.sampled_from([0] * 8 + [1, 1, 1, 2, 2, 3, 17]))):
        tensor = request.inputs.add(
            name=draw(INPUT_NAMES),
            datatype=draw(st.one_of(st.sampled_from(DATATYPES), PRINTABLE)),
            shape=draw(st.lists(DIMS, max_size=3)),
        )
        if use_raw:
            request.raw_input_contents.append(draw(RAW))
        else:
            _fill_typed(draw, tensor)
    if request.raw_input_contents and _one_in(draw, 10):
        request.raw_input_contents.append(draw(RAW))  # one raw entry too many
    for key, (kind, value) in draw(st.dictionaries(PARAM_NAMES, PARAM_VALUES, max_size=3)).items():
        setattr(request.parameters[key], kind, value)
    return request


# Header names a gRPC client may send and that are the application's, not HTTP/2's.
_KEY_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789-_."
_TRANSPORT_KEYS = {
    "te",
    "host",
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "content-type",
    "content-length",
    "user-agent",
}
PLAIN_KEYS = st.text(_KEY_CHARS, min_size=1, max_size=12).filter(
    lambda k: not k.startswith("grpc-") and not k.endswith("-bin") and k not in _TRANSPORT_KEYS
)
# Entries the edge accepts: good hints, forged internal keys (dropped), other keys.
GOOD_ENTRIES = st.one_of(
    st.tuples(st.just(CLIENT_GEO), st.sampled_from(["53.35,-6.26", "1.35,103.82", "-90,180"])),
    st.tuples(st.just(CLIENT_REGION), st.just("us-east")),
    st.tuples(st.just(PRIORITY), st.sampled_from(PRIORITY_NAMES)),
    st.tuples(st.just(SESSION), PRINTABLE),
    st.tuples(st.sampled_from(sorted(INTERNAL_KEYS)), st.one_of(PRINTABLE, st.just("00" * 8))),
    st.tuples(st.sampled_from(["traceparent", "tracestate", "authorization"]), PRINTABLE),
    st.tuples(PLAIN_KEYS, PRINTABLE),
    st.tuples(PLAIN_KEYS.map(lambda k: k + "-bin"), st.binary(max_size=16)),
)
# Entries it refuses: malformed hints, typos of ours, response trailers, binary
# hints, values over MAX_VALUE_LEN or over the whole metadata limit.
BAD_ENTRIES = st.one_of(
    st.tuples(
        st.just(CLIENT_GEO),
        st.one_of(st.sampled_from(["91,0", "nan,0", "1e999,0", ",", "dublin"]), PRINTABLE),
    ),
    st.tuples(st.just(CLIENT_REGION), st.sampled_from(["mars-north", ""])),
    st.tuples(st.just(PRIORITY), st.sampled_from(["urgent", "CRITICAL", ""])),
    st.tuples(
        st.one_of(
            st.sampled_from([ROUTE, LOAD, "x-meridian-capacity"]),
            PLAIN_KEYS.map(lambda k: "x-meridian-" + k),
        ),
        PRINTABLE,
    ),
    st.tuples(st.just("x-meridian-session-bin"), st.binary(max_size=16)),
    st.tuples(st.sampled_from([SESSION, "x-pad"]), st.integers(200, 20_000).map(lambda n: "a" * n)),
)


@st.composite
def wire_metadata(draw: Any) -> list[tuple[str, str | bytes]]:
    """Metadata a gRPC client can put on the wire: a few entries the edge accepts and,
    half of the time, one it must refuse."""
    entries: list[tuple[str, str | bytes]] = draw(st.lists(GOOD_ENTRIES, max_size=4))
    if draw(st.booleans()):
        entries.insert(draw(st.integers(0, len(entries))), draw(BAD_ENTRIES))
    return entries


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(infer=infer_requests())
def test_parse_generate_raises_nothing_but_route_error(infer: pb.ModelInferRequest) -> None:
    # Every message protobuf can decode: whatever reaches a tier does.
    decoded = pb.ModelInferRequest.FromString(infer.SerializeToString())
    for limits in (Limits(), SMALL):
        try:
            gen = parse_generate(decoded, limits)
        except RouteError as err:
            assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.message
        else:
            assert len(gen.prompt.encode()) <= limits.max_prompt_bytes
            assert 1 <= gen.max_tokens <= 8192


# Beyond what gRPC clients send: what gRPC's server hands over from a raw HTTP/2 peer.
ANY_METADATA = st.lists(
    st.tuples(
        st.one_of(st.sampled_from([*INTERNAL_KEYS, SESSION, CLIENT_GEO, PRIORITY]), PLAIN_KEYS),
        st.one_of(st.text(max_size=40), st.binary(max_size=10)),
    ),
    max_size=5,
)


@settings(max_examples=300, deadline=None)
@given(metadata=st.one_of(wire_metadata(), ANY_METADATA), trust_internal=st.booleans())
def test_parse_hints_raises_nothing_but_route_error(
    metadata: list[tuple[str, Any]], trust_internal: bool
) -> None:
    try:
        hints = parse_hints(metadata, trust_internal=trust_internal)
    except RouteError as err:
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.message
        return
    # Whatever goes down to the next tier is something gRPC will send.
    for key, value in hints.downstream_metadata(None, 0, hints.prefix_blocks):
        assert all(" " <= c <= "~" for c in value), (key, value)
