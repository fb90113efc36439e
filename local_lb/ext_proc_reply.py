"""The endpoint-picker protocol's words: what the picker tells Envoy, and reads back.

From the Gateway API Inference Extension's endpoint-picker protocol:

* **the answer**: the request header ``x-gateway-destination-endpoint`` and the
  dynamic metadata ``envoy.lb`` / ``x-gateway-destination-endpoint``, both the
  same value: the chosen ``ip:port`` first, then the fallbacks, comma-separated
  (a data plane that retries walks the list in order). The header is set with
  OVERWRITE, so a caller cannot choose its own GPU by sending it;
* **the subset hint** (from the data plane): filter metadata
  ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``, a list of
  ``ip:port``; the picker then chooses only among those;
* **what served**: metadata ``envoy.lb`` / ``x-gateway-destination-endpoint-served``
  on the response messages (what Envoy's override_host policy writes with
  ``selected_host_key``), else a response header of that name (what a route's
  ``%UPSTREAM_REMOTE_ADDRESS%`` gives with an ORIGINAL_DST cluster); the header
  is removed before the response goes on to the caller;
* **refusals** as an ``ImmediateResponse``: 503 when no GPU can serve, 429 (with
  ``retry-after``) when the zone sheds, and the status of the error otherwise;
  a gRPC caller gets the gRPC code itself (``grpc_status``), an HTTP caller the
  OpenAI edge's error (``common.request.openai_json``: status, body, Retry-After).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import grpc
from google.protobuf import struct_pb2

from common.basics.errors import RETRY_AFTER_MS, RouteError
from common.gen.envoy.config.core.v3 import base_pb2
from common.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from common.gen.envoy.type.v3 import http_status_pb2
from common.request.openai_json import HTTP_STATUS, OpenAIError, grpc_error
from common.request.routing import trailer

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"

_CODE_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def _overwrite(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def destination(endpoints: Sequence[str], *, body_phase: bool) -> ep.ProcessingResponse:
    """The answer: header and ``envoy.lb`` metadata naming ``endpoints`` (best first),
    as the reply to the request body (or to body-less request headers)."""
    value = ",".join(endpoints)
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: value}})
    common = ep.CommonResponse(
        header_mutation=ep.HeaderMutation(set_headers=[_overwrite(DESTINATION, value)])
    )
    if body_phase:
        return ep.ProcessingResponse(
            request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata
        )
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata
    )


def go_on(kind: str) -> ep.ProcessingResponse:
    """Continue unchanged after the message of ``kind`` (the response header named
    ``SERVED`` is taken out: it was for the picker)."""
    if kind == "response_headers":
        mutation = ep.HeaderMutation(remove_headers=[SERVED])
        return ep.ProcessingResponse(
            response_headers=ep.HeadersResponse(
                response=ep.CommonResponse(header_mutation=mutation)
            )
        )
    if kind in ("request_headers", "response_headers"):
        return ep.ProcessingResponse(**{kind: ep.HeadersResponse()})
    if kind in ("request_body", "response_body"):
        return ep.ProcessingResponse(**{kind: ep.BodyResponse()})
    return ep.ProcessingResponse(**{kind: ep.TrailersResponse()})


def refusal(err: RouteError, *, grpc_call: bool) -> ep.ProcessingResponse:
    """``err`` as Envoy's immediate response to the caller."""
    if grpc_call:
        status = HTTP_STATUS.get(err.code, 500)
        headers = [_overwrite(k, v) for k, v in err.trailers]
        body = err.message.encode()
    else:
        error = openai_error(err)
        status = error.status
        headers = [_overwrite(k, v) for k, v in error.headers]
        headers.append(_overwrite("content-type", "application/json"))
        body = json.dumps(error.body()).encode()
    response = ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=http_status_pb2.StatusCode.Name(status)),
        headers=ep.HeaderMutation(set_headers=headers),
        body=body,
        details=f"meridian_{err.code.name.lower()}",
    )
    if grpc_call:
        response.grpc_status.status = err.code.value[0]
    return ep.ProcessingResponse(immediate_response=response)


def openai_error(err: RouteError) -> OpenAIError:
    """The OpenAI edge's error for ``err`` (status, ``Retry-After``, body); a
    RESOURCE_EXHAUSTED without a retry hint is a body too large: 413."""
    retry = trailer(err.trailers, RETRY_AFTER_MS)
    if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and retry is None:
        return OpenAIError(413, err.message, "request_too_large")
    return grpc_error(err.code, err.message, err.trailers, getattr(err, "param", None))


def _namespace(request: ep.ProcessingRequest, name: str) -> struct_pb2.Struct | None:
    filters = request.metadata_context.filter_metadata
    return filters[name] if name in filters else None


def subset_hint(request: ep.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the data plane allows, or None when it sent no hint."""
    hint = _namespace(request, SUBSET_NAMESPACE)
    if hint is None or SUBSET not in hint.fields:
        return None
    value = hint.fields[SUBSET]
    if value.WhichOneof("kind") == "list_value":
        return frozenset(v.string_value for v in value.list_value.values if v.string_value)
    if value.WhichOneof("kind") == "string_value":  # tolerated: a comma-separated string
        return frozenset(e.strip() for e in value.string_value.split(",") if e.strip())
    return frozenset()


def served_endpoint(
    request: ep.ProcessingRequest, headers: Iterable[tuple[str, str]]
) -> str | None:
    """The endpoint that served (or last failed) the request, as the data plane says."""
    lb = _namespace(request, LB_NAMESPACE)
    if lb is not None and SERVED in lb.fields and lb.fields[SERVED].string_value:
        return lb.fields[SERVED].string_value
    for key, value in headers:
        if key == SERVED and value and value != "-":
            return value
    return None


def status_of(
    headers: Iterable[tuple[str, str]], *, grpc_call: bool
) -> tuple[grpc.StatusCode, str] | None:
    """The call's status in response headers or trailers: ``grpc-status`` when there
    is one, else (HTTP) the ``:status``; None when these headers say nothing yet."""
    values = dict(headers)
    if "grpc-status" in values:
        number = int(values["grpc-status"]) if values["grpc-status"].isdigit() else 2
        return _CODE_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN), values.get("grpc-message", "")
    status = values.get(":status")
    if status is None or (grpc_call and status == "200"):
        return None  # a gRPC status comes in the trailers
    return _http_code(status), f"HTTP {status}"


def _http_code(status: str) -> grpc.StatusCode:
    if status.startswith("2"):
        return grpc.StatusCode.OK
    for code, http in HTTP_STATUS.items():
        if str(http) == status:
            return code
    if status in ("502", "500"):
        return grpc.StatusCode.UNAVAILABLE if status == "502" else grpc.StatusCode.INTERNAL
    return grpc.StatusCode.UNKNOWN
