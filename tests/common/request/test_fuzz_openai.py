"""Fuzzing the OpenAI edge's body parser in process: the bytes of a POST body
(``openai_http._json``), the JSON (``openai_v2.parse_openai``) and what the edge makes
of a parsed body (the V2 request the tiers parse again, the body an OpenAI GPU gets).

Properties: only ``BadField`` (INVALID_ARGUMENT) comes out, its ``param`` is the
field its message names; an accepted body becomes a V2 request every tier accepts,
carrying the same prompt and ``max_tokens``. Deterministic and bounded.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from common.request.openai_http import _json
from common.request.openai_v2 import (
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    BadField,
    OpenAIRequest,
    openai_of,
    parse_openai,
    to_infer_request,
)
from common.request.v2 import parse_generate

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
ROUTES = st.sampled_from([ROUTE_COMPLETIONS, ROUTE_CHAT])
# Text as JSON can carry it: any code point, lone surrogates included ("\ud800").
TEXT = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(codec=None, categories=None), max_size=6),
    st.sampled_from(["\ud800", "a\udfff", "user", "text", "demo-llm"]),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, 8192, 8193, -1]),
    st.floats(),
    TEXT,
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=8,
)
KEYS = st.sampled_from(
    [
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "stream",
        "stream_options",
        "temperature",
    ]
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), TEXT)},
    optional={
        "content": st.one_of(
            TEXT,
            st.none(),
            st.lists(
                st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), JSON),
                max_size=3,
            ),
            JSON,
        )
    },
)
# Mostly the shape of a real body, each field sometimes something else.
BODIES = st.one_of(
    JSON,
    st.fixed_dictionaries(
        {"model": st.one_of(st.just("demo-llm"), TEXT)},
        optional={
            "prompt": st.one_of(TEXT, st.lists(TEXT, max_size=2), JSON),
            "messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), JSON),
            "max_tokens": SCALARS,
            "max_completion_tokens": SCALARS,
            "n": SCALARS,
            "stream": st.one_of(st.booleans(), SCALARS),
            "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": SCALARS}), JSON),
        },
    ).flatmap(lambda body: st.dictionaries(KEYS, JSON, max_size=2).map(lambda x: {**body, **x})),
)


def accepted(route: str, body: Any) -> OpenAIRequest | None:
    """parse_openai's contract, and what the edge does next with an accepted body."""
    try:
        request = parse_openai(route, body)
    except BadField as err:
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT
        if err.param is None:
            assert any(w in err.message for w in ("body", "route")), err.message
        else:
            assert f"'{err.param}'" in err.message, (err.param, err.message)
        return None
    infer = to_infer_request(request, "cmpl-1")
    infer = type(infer).FromString(infer.SerializeToString())  # as the tiers receive it
    parsed = parse_generate(infer)
    assert (parsed.model, parsed.prompt, parsed.max_tokens) == (
        request.model,
        request.prompt,
        request.max_tokens,
    )
    carried = openai_of(infer)
    assert carried is not None and carried[0] == route
    assert "stream" not in carried[1] and carried[1]["max_tokens"] == request.max_tokens
    return request


# The worst cases met while fuzzing, kept as a seed corpus.
@FUZZ
@given(route=ROUTES, body=BODIES)
@example(route=ROUTE_COMPLETIONS, body={"model": "m", "prompt": "\ud800"})  # found: 500
@example(route=ROUTE_COMPLETIONS, body={"model": "\udc00", "prompt": "x"})  # found: 500
@example(route=ROUTE_CHAT, body={"model": "m", "messages": [{"role": "user", "content": "\ud800"}]})
@example(
    route=ROUTE_CHAT,
    body={
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}],
    },
)
@example(route=ROUTE_CHAT, body={"model": "m", "messages": [{"role": "tool"}]})  # no content
@example(route=ROUTE_COMPLETIONS, body={"model": "m", "prompt": "x", "n": True})
@example(route=ROUTE_COMPLETIONS, body={"model": "m", "prompt": "x", "n": 1.0})
@example(route=ROUTE_COMPLETIONS, body={"model": "m", "prompt": "x", "max_tokens": False})
@example(route=ROUTE_COMPLETIONS, body={"model": "m", "prompt": "x", "max_tokens": float("nan")})
@example(route=ROUTE_CHAT, body={"model": "m", "messages": [{}], "max_completion_tokens": 0})
@example(route=ROUTE_COMPLETIONS, body={"model": "m", "prompt": [["x"]]})
@example(route=ROUTE_COMPLETIONS, body={"model": "m", "prompt": "x", "stream_options": []})
def test_bodies_parse_or_name_the_field(route: str, body: Any) -> None:
    accepted(route, body)


@FUZZ
@given(raw=st.one_of(st.binary(max_size=40), JSON.map(lambda v: json.dumps(v).encode())))
@example(raw=b"[" * 100_000)  # found: RecursionError, a 500
@example(raw=b'{"a":' * 50_000)
@example(raw=b"\xff\xfe{}")
@example(raw=b'{"model": "m", "prompt": "\\ud800"}')
@example(raw=b'{"model": "m", "prompt": 1' + b"0" * 5000 + b"}")  # over int()'s digits
@example(raw=b'{"model": "m", "prompt": "x", "max_tokens": NaN}')
def test_body_bytes_parse_or_say_what_is_wrong(raw: bytes) -> None:
    for route in (ROUTE_COMPLETIONS, ROUTE_CHAT):
        try:
            body = _json(raw)
        except BadField as err:
            assert err.param is None and "not valid JSON" in err.message, err.message
            continue
        accepted(route, body)
