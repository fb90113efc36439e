"""The seam between the OpenAI edge and the tiers: an OpenAI body as a V2 request."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from common.config.access import Limits
from common.request.openai_v2 import (
    OPENAI_BODY,
    OPENAI_ROUTE,
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    BadField,
    chat_prompt,
    openai_of,
    parse_openai,
    to_infer_request,
)
from common.request.v2 import DEFAULT_MAX_TOKENS, parse_generate, wants_stream


def bad(route: str, body: Any) -> BadField:
    with pytest.raises(BadField) as caught:
        parse_openai(route, body)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return caught.value


def test_the_chat_template_is_one_block_per_message_then_the_assistant() -> None:
    prompt = chat_prompt([("system", "be brief"), ("user", "hi")])
    assert prompt == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"


def test_a_completion_becomes_a_generate_request_with_the_body_forwarded() -> None:
    body = {"model": "demo-llm", "prompt": "tell me", "max_tokens": 5, "temperature": 0.2}
    request = parse_openai(ROUTE_COMPLETIONS, {**body, "stream": True})
    infer = to_infer_request(request, "r1")
    gen = parse_generate(infer, Limits())
    assert (gen.model, gen.prompt, gen.max_tokens) == ("demo-llm", "tell me", 5)
    assert wants_stream(infer) and infer.id == "r1"
    assert infer.parameters[OPENAI_ROUTE].string_param == "completions"
    forwarded = json.loads(infer.parameters[OPENAI_BODY].string_param)
    assert forwarded == body  # as it came, without stream


def test_chat_messages_are_rendered_and_kept_as_they_came() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "you"}],
        },
    ]
    request = parse_openai(ROUTE_CHAT, {"model": "m", "messages": messages})
    assert request.prompt == "<|system|>\nbe brief\n<|user|>\nhi you\n<|assistant|>\n"
    assert request.max_tokens == DEFAULT_MAX_TOKENS and not request.stream
    route, body = openai_of(to_infer_request(request)) or ("", {})
    assert route == "chat.completions" and body["messages"] == messages
    assert body["max_tokens"] == DEFAULT_MAX_TOKENS


def test_max_completion_tokens_wins_for_chat_and_include_usage_is_read() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 9,
        "max_completion_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = parse_openai(ROUTE_CHAT, body)
    assert (request.max_tokens, request.stream, request.include_usage) == (3, True, True)
    assert "stream_options" not in request.body and request.body["max_completion_tokens"] == 3


def test_a_plain_v2_request_carries_no_openai_body() -> None:
    from common.request.v2 import generate_request

    assert openai_of(generate_request("m", "p")) is None


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (ROUTE_COMPLETIONS, [], None),
        (ROUTE_COMPLETIONS, {"prompt": "x"}, "model"),
        (ROUTE_COMPLETIONS, {"model": 3, "prompt": "x"}, "model"),
        (ROUTE_COMPLETIONS, {"model": "m"}, "prompt"),
        (ROUTE_COMPLETIONS, {"model": "m", "prompt": ["a", "b"]}, "prompt"),
        (ROUTE_COMPLETIONS, {"model": "m", "prompt": [1, 2]}, "prompt"),
        (ROUTE_COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        (ROUTE_COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
        (ROUTE_COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        (ROUTE_COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 10**6}, "max_tokens"),
        (ROUTE_COMPLETIONS, {"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        (ROUTE_COMPLETIONS, {"model": "m", "prompt": "x", "n": 2}, "n"),
        (ROUTE_COMPLETIONS, {"model": "m", "prompt": "x", "stream_options": []}, "stream_options"),
        (
            ROUTE_COMPLETIONS,
            {"model": "m", "prompt": "x", "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
        ),
        (ROUTE_CHAT, {"model": "m"}, "messages"),
        (ROUTE_CHAT, {"model": "m", "messages": []}, "messages"),
        (ROUTE_CHAT, {"model": "m", "messages": "hi"}, "messages"),
        (ROUTE_CHAT, {"model": "m", "messages": ["hi"]}, "messages[0]"),
        (ROUTE_CHAT, {"model": "m", "messages": [{"content": "hi"}]}, "messages[0].role"),
        (
            ROUTE_CHAT,
            {"model": "m", "messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
        ),
        (
            ROUTE_CHAT,
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_each_bad_field_is_invalid_argument_naming_it(route: str, body: Any, param: str) -> None:
    assert bad(route, body).param == param
