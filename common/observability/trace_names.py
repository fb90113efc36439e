"""The names on Meridian's spans: OTel semantic conventions first, ``meridian.*`` for the rest.

RPC attributes follow the RPC/gRPC conventions as the OTel gRPC instrumentations
emit them by default (semantic conventions up to 1.37, which the installed
``opentelemetry-semantic-conventions`` still carries): ``rpc.system`` ``grpc``,
``rpc.service`` the proto service, ``rpc.method`` the method alone and
``rpc.grpc.status_code`` the numeric status; span names are ``$service/$method``
(``inference.GRPCInferenceService/ModelInfer``) on server and client spans alike.
``rpc.response.status_code`` (the status's name, ``OK``) is the newer conventions'
status attribute, added because it clashes with none of the above.
``server.address`` / ``server.port`` are the address a server span's tier serves
and, on a client span, the child it dialled.

GenAI attributes are the ``gen_ai.*`` conventions' request model, ``max_tokens``
and usage counts. Everything Meridian decides has a ``meridian.`` name grouped
by what it describes: ``meridian.route.*`` (where the request ran),
``meridian.decision.*`` (a ``pick`` span: why that child), ``meridian.attempt.*``
(a forward attempt). No name is both an attribute and a namespace.
"""

from __future__ import annotations

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv._incubating.attributes import rpc_attributes as rpc
from opentelemetry.semconv.attributes import server_attributes as server
from opentelemetry.util.types import AttributeValue

from common.request.call import CallRecord

# The KServe V2 service every tier serves and calls (proto package ``inference``).
RPC_SERVICE_NAME = "inference.GRPCInferenceService"

RPC_SYSTEM = rpc.RPC_SYSTEM
RPC_SERVICE = rpc.RPC_SERVICE
RPC_METHOD = rpc.RPC_METHOD
STATUS = rpc.RPC_GRPC_STATUS_CODE
STATUS_NAME = rpc.RPC_RESPONSE_STATUS_CODE
SERVER_ADDRESS = server.SERVER_ADDRESS
SERVER_PORT = server.SERVER_PORT

MODEL = gen_ai.GEN_AI_REQUEST_MODEL
MAX_TOKENS = gen_ai.GEN_AI_REQUEST_MAX_TOKENS
INPUT_TOKENS = gen_ai.GEN_AI_USAGE_INPUT_TOKENS
OUTPUT_TOKENS = gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS

TIER = "meridian.tier"
TENANT = "meridian.tenant"
# True while the usage counts are Meridian's estimate (the GPU server reported none).
USAGE_ESTIMATED = "meridian.usage.estimated"
REGION = "meridian.route.region"
ZONE = "meridian.route.zone"
GPU = "meridian.route.gpu"
# The child a pick, queue or attempt span is about.
CHILD = "meridian.child"
REASON = "meridian.decision.reason"
CANDIDATES = "meridian.decision.candidates"
POLICY = "meridian.decision.policy"
ESTIMATED_S = "meridian.decision.estimated_s"
CACHED_BLOCKS = "meridian.decision.cached_blocks"
ATTEMPT = "meridian.attempt.index"
ACTUAL_S = "meridian.attempt.actual_s"


def span_name(method: str) -> str:
    """The conventional RPC span name: ``inference.GRPCInferenceService/ModelInfer``."""
    return f"{RPC_SERVICE_NAME}/{method}"


def rpc_attributes(method: str, host: str, port: int) -> dict[str, str | int]:
    """The RPC attributes of a call of ``method`` served at (or sent to) ``host:port``."""
    attributes: dict[str, str | int] = {
        RPC_SYSTEM: "grpc",
        RPC_SERVICE: RPC_SERVICE_NAME,
        RPC_METHOD: method,
    }
    if host:
        attributes[SERVER_ADDRESS] = host
    if port:
        attributes[SERVER_PORT] = port
    return attributes


def route_attributes(route: str) -> dict[str, str]:
    """``meridian.route.region/zone/gpu`` from an ``x-meridian-route`` (``region/zone/gpu``,
    read from the right: a local tier's route has no region)."""
    parts = route.split("/") if route else []
    names = (GPU, ZONE, REGION)
    return {name: part for name, part in zip(names, reversed(parts), strict=False)}


def usage_attributes(call: CallRecord) -> dict[str, AttributeValue]:
    """The GenAI request and usage attributes of a call, read as it ends."""
    attributes: dict[str, AttributeValue] = {}
    if call.model:
        attributes[MODEL] = call.model
    if call.max_tokens:
        attributes[MAX_TOKENS] = call.max_tokens
    if call.prompt_tokens or call.completion_tokens:
        attributes[INPUT_TOKENS] = call.prompt_tokens
        attributes[OUTPUT_TOKENS] = call.completion_tokens
        # Until the GPU server's own counts replace them, the counts are estimates.
        attributes[USAGE_ESTIMATED] = not call.tokens_reported
    return attributes
