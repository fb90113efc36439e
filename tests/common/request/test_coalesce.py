"""The outbox's merge (``common.request.coalesce``) and ``limits.stream_coalesce_ms``."""

from __future__ import annotations

import asyncio

import pytest

from common.config.access import parse_limits
from common.config.node import ConfigError, ConfigNode
from common.gen.inference import grpc_service_pb2 as pb
from common.request.coalesce import MAX_HELD, Outbox
from common.request.tokens import put_counts
from common.request.v2 import generate_request, response_text, text_response

REQUEST = generate_request("m", "a b c", 8, request_id="r1", stream=True)


def token(text: str, n: int | None, final: bool = False) -> pb.ModelStreamInferResponse:
    response = text_response(REQUEST, text, final=final)
    if n is not None:
        put_counts(response, 3, n)
    return pb.ModelStreamInferResponse(infer_response=response)


def held(*responses: pb.ModelStreamInferResponse) -> tuple[Outbox, list[Outbox]]:
    readied: list[Outbox] = []
    box = Outbox(readied.append)
    hold(box, *responses)
    return box, readied


def hold(box: Outbox, *responses: pb.ModelStreamInferResponse) -> None:
    """As ``put`` holds them while the writer is busy, without waiting."""
    box.parts.extend(responses)
    box.weights.extend(1 if len(r.infer_response.outputs) else 0 for r in responses)


def test_responses_held_go_as_one_with_every_text_and_the_last_counts() -> None:
    box, _ = held(token(" a", 1), token(" b", 2), token(" c", 3, final=True))
    merged = box.take().infer_response
    assert response_text(merged) == " a b c" and merged.id == "r1"
    assert merged.parameters["completion_tokens"].int64_param == 3
    assert merged.parameters["triton_final_response"].bool_param
    assert box.parts == [] and box.responses == 3


def test_one_response_held_goes_unchanged() -> None:
    only = token(" a", 1)
    expected = pb.ModelStreamInferResponse()
    expected.CopyFrom(only)
    box, _ = held(only)
    assert box.take() == expected


def test_an_error_is_never_merged_and_keeps_its_place() -> None:
    error = pb.ModelStreamInferResponse(error_message="UNAVAILABLE: gone (request id 'r1')")
    box, _ = held(token(" a", 1), token(" b", 2), error, token(" c", 3))
    assert response_text(box.take().infer_response) == " a b"
    assert box.take() == error
    assert response_text(box.take().infer_response) == " c"


def test_without_counts_a_merge_says_how_many_tokens_it_stands_for() -> None:
    box, _ = held(token(" a", None), token(" b", None))
    merged = box.take().infer_response
    assert merged.parameters["completion_tokens"].int64_param == 2
    hold(box, token(" c", None))
    assert box.take().infer_response.parameters["completion_tokens"].int64_param == 3


async def test_the_first_response_put_readies_the_outbox_once() -> None:
    readied: list[Outbox] = []
    box = Outbox(readied.append)
    await box.put(token(" a", 1))
    await box.put(token(" b", 2))
    assert readied == [box] and len(box.parts) == 2


@pytest.mark.parametrize("value", [-1, 1000.5, float("nan"), "5", True])
def test_a_bad_stream_coalesce_ms_names_the_key(value: object) -> None:
    root = ConfigNode({"limits": {"stream_coalesce_ms": value}}, "")
    with pytest.raises(ConfigError, match=r"limits\.stream_coalesce_ms"):
        parse_limits(root)


def test_stream_coalesce_ms_defaults_to_zero_and_takes_a_window() -> None:
    assert parse_limits(ConfigNode({}, "")).stream_coalesce_ms == 0
    root = ConfigNode({"limits": {"stream_coalesce_ms": 20}}, "")
    assert parse_limits(root).stream_coalesce_ms == 20.0


async def test_past_max_held_the_text_held_merges_and_the_request_reads_on() -> None:
    """A writer that takes nothing (a caller that stopped reading): ``put`` never waits
    while the text held is within its bound, and what is held stays one merged text."""
    box = Outbox(lambda box: None)
    error = pb.ModelStreamInferResponse(error_message="UNAVAILABLE: x (request id 'r1')")
    for i in range(3 * MAX_HELD):
        await asyncio.wait_for(box.put(token(f" {i}", None)), 1.0)
        if i == 10:
            await box.put(error)
    assert len(box.parts) < MAX_HELD
    first = box.take()
    assert response_text(first.infer_response) == "".join(f" {i}" for i in range(11))
    assert first.infer_response.parameters["completion_tokens"].int64_param == 11
    assert box.take() == error
    rest = []
    while box.parts:
        rest.append(box.take())
    assert "".join(response_text(r.infer_response) for r in rest) == "".join(
        f" {i}" for i in range(11, 3 * MAX_HELD)
    )
    assert rest[-1].infer_response.parameters["completion_tokens"].int64_param == 3 * MAX_HELD


async def test_past_its_text_bound_a_request_waits_until_the_writer_takes() -> None:
    box = Outbox(lambda box: None, held_bytes=1000)
    for i in range(MAX_HELD - 1):
        await box.put(token(f" {i:03}", None))  # 5 bytes each: 1275, over the bound
    put = asyncio.ensure_future(box.put(token(" end", None)))
    await asyncio.sleep(0.01)
    assert not put.done()
    assert len(box.parts) == 1  # merged while it waits
    taken = box.take()
    box.taken()
    await asyncio.wait_for(put, 1.0)
    assert response_text(taken.infer_response).endswith(" end")
    assert taken.infer_response.parameters["completion_tokens"].int64_param == MAX_HELD
