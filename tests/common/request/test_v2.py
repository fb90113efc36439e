import struct

import grpc
import pytest

from common.basics.errors import RouteError
from common.gen.inference import grpc_service_pb2 as pb
from common.request.v2 import (
    decode_bytes_tensor,
    encode_bytes_tensor,
    generate_request,
    parse_generate,
    response_text,
    text_response,
)


def test_bytes_tensor_round_trip() -> None:
    items = [b"", b"hello", "h\u00e9llo".encode()]
    assert decode_bytes_tensor(encode_bytes_tensor(items)) == items


@pytest.mark.parametrize("raw", [b"\x05\x00", b"\x05\x00\x00\x00abc"])
def test_truncated_bytes_tensor_rejected(raw: bytes) -> None:
    with pytest.raises(ValueError):
        decode_bytes_tensor(raw)


def test_parse_raw_request() -> None:
    gen = parse_generate(generate_request("demo-llm", "one two three", 7))
    assert (gen.model, gen.prompt, gen.max_tokens, gen.prompt_tokens) == (
        "demo-llm",
        "one two three",
        7,
        3,
    )


def test_parse_typed_contents_and_max_tokens_input() -> None:
    request = pb.ModelInferRequest(model_name="m")
    text = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    text.contents.bytes_contents.append(b"hi there")
    limit = request.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    limit.contents.int_contents.append(5)
    gen = parse_generate(request)
    assert (gen.prompt, gen.max_tokens) == ("hi there", 5)


def test_parse_raw_max_tokens_input() -> None:
    request = generate_request("m", "x")
    del request.parameters["max_tokens"]
    request.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    request.raw_input_contents.append(struct.pack("<i", 9))
    assert parse_generate(request).max_tokens == 9


def test_default_max_tokens() -> None:
    request = generate_request("m", "x")
    del request.parameters["max_tokens"]
    assert parse_generate(request).max_tokens == 16


def _invalid(request: pb.ModelInferRequest) -> str:
    with pytest.raises(RouteError) as err:
        parse_generate(request)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return err.value.message


def test_missing_text_input() -> None:
    request = pb.ModelInferRequest(model_name="m")
    assert "missing BYTES input 'text_input'" in _invalid(request)


def test_ill_typed_text_input() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="text_input", datatype="INT32", shape=[1]).contents.int_contents.append(
        1
    )
    assert "must have datatype BYTES" in _invalid(request)


def test_two_prompts_rejected() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(
        name="text_input", datatype="BYTES", shape=[2]
    ).contents.bytes_contents.extend([b"a", b"b"])
    assert "exactly one element" in _invalid(request)


def test_raw_contents_count_mismatch() -> None:
    request = generate_request("m", "x")
    request.raw_input_contents.append(b"extra")
    assert "must match one to one" in _invalid(request)


@pytest.mark.parametrize("value", [0, -3, 10**6])
def test_max_tokens_out_of_range(value: int) -> None:
    request = generate_request("m", "x")
    request.parameters["max_tokens"].int64_param = value
    assert "'max_tokens' must be between" in _invalid(request)


def test_max_tokens_wrong_type() -> None:
    request = generate_request("m", "x")
    request.parameters["max_tokens"].bool_param = True
    assert "must be an integer" in _invalid(request)


def test_invalid_utf8_prompt() -> None:
    request = generate_request("m", "x")
    request.raw_input_contents[0] = encode_bytes_tensor([b"\xff\xfe"])
    assert "not valid UTF-8" in _invalid(request)


def test_empty_model_name() -> None:
    assert "model_name is empty" in _invalid(generate_request("", "x"))


def test_text_response_round_trip_and_final_flag() -> None:
    request = generate_request("m", "x", request_id="r1")
    unary = text_response(request, "hello world")
    assert response_text(unary) == "hello world"
    assert unary.id == "r1"
    assert "triton_final_response" not in unary.parameters
    last = text_response(request, "end", final=True)
    assert last.parameters["triton_final_response"].bool_param is True
