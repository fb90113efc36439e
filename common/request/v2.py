"""KServe V2 generate-convention helpers shared by every tier and the emulated GPU.

An LLM request carries a BYTES input ``text_input`` and ``max_tokens`` as a
request parameter (or an INT32/INT64 input); the reply carries a BYTES output
``text_output``. BYTES tensors in ``raw_*_contents`` are a sequence of
4-byte little-endian lengths each followed by that many bytes (Triton's
serialisation), which stock clients read back with numpy.

``parse_generate`` is the one gate every request passes at every tier: for any
message protobuf can decode it returns a ``GenerateRequest`` or raises
``RouteError`` (INVALID_ARGUMENT), never anything else, so no request can turn
into UNKNOWN or INTERNAL. Inputs other than ``text_input`` and ``max_tokens``
are not interpreted (the model behind may use them) but count towards
``Limits.max_inputs``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from common.basics.errors import RouteError
from common.config.access import Limits
from common.gen.inference import grpc_service_pb2 as pb

TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"
MAX_TOKENS = "max_tokens"
STREAM = "stream"
FINAL_RESPONSE = "triton_final_response"
DEFAULT_MAX_TOKENS = 16
MAX_TOKENS_LIMIT = 8192

# Integer datatypes and their raw little-endian ``struct`` format.
_INT_FORMATS = {
    "INT8": "<b",
    "INT16": "<h",
    "INT32": "<i",
    "INT64": "<q",
    "UINT8": "<B",
    "UINT16": "<H",
    "UINT32": "<I",
    "UINT64": "<Q",
}
# Longest model name or version accepted (they are echoed in error messages, which
# travel in a trailer that gRPC bounds by size).
MAX_NAME_CHARS = 256
# Longest integer written as a string parameter (int() refuses > 4300 digits).
_MAX_INT_DIGITS = 20
DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class GenerateRequest:
    """What the router needs to know about a generate-style request."""

    model: str
    version: str
    prompt: str
    max_tokens: int

    @property
    def prompt_tokens(self) -> int:
        """Token count estimate: whitespace words (the emulated GPU counts the same way).
        It stands until the GPU server reports its own count (``common.request.tokens``)."""
        return len(self.prompt.split())


def encode_bytes_tensor(items: list[bytes]) -> bytes:
    """Serialise BYTES elements the way Triton puts them in raw contents."""
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def decode_bytes_tensor(raw: bytes) -> list[bytes]:
    """Inverse of ``encode_bytes_tensor``; ``ValueError`` on a truncated buffer."""
    if len(raw) >= 4 and struct.unpack_from("<I", raw)[0] == len(raw) - 4:
        return [raw[4:]]  # one element filling the buffer: a prompt, a generated text
    items, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise ValueError("truncated BYTES element length")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise ValueError("BYTES element runs past the end of the buffer")
        items.append(raw[offset : offset + length])
        offset += length
    return items


def param_int(param: pb.InferParameter, where: str) -> int:
    """An integer request parameter (int64, uint64 or a decimal string); RouteError
    (INVALID_ARGUMENT) naming ``where`` otherwise."""
    kind = param.WhichOneof("parameter_choice")
    if kind in ("int64_param", "uint64_param"):
        return int(getattr(param, kind))
    if kind == "string_param":
        text = param.string_param.strip()
        digits = text.removeprefix("-")
        if digits.isascii() and digits.isdigit() and len(digits) <= _MAX_INT_DIGITS:
            return int(text)
        raise RouteError.invalid(f"{where} must be an integer, got string {text[:32]!r}")
    raise RouteError.invalid(f"{where} must be an integer, got {kind or 'nothing'}")


def parse_generate(
    request: pb.ModelInferRequest, limits: Limits = DEFAULT_LIMITS
) -> GenerateRequest:
    """Validate a generate-style request; raise ``RouteError`` (INVALID_ARGUMENT) if ill-formed.

    Checks, in order: the model name and version, the number of inputs (``limits.max_inputs``),
    duplicate input names, raw contents matching inputs one to one, then the
    ``text_input`` prompt (BYTES, one element, shape matching, at most
    ``limits.max_prompt_bytes``, UTF-8) and ``max_tokens`` (1..MAX_TOKENS_LIMIT).

    Every request passes here at every tier, so each protobuf field is read once: a
    repeated field's wrapper costs about as much as parsing the whole small message.
    """
    model, version = request.model_name, request.model_version
    _check_names(model, version)
    inputs = request.inputs
    if len(inputs) > limits.max_inputs:
        raise RouteError.invalid(
            f"the request has {len(inputs)} inputs; at most {limits.max_inputs} "
            "are accepted (limits.max_inputs)"
        )
    tensors = list(inputs)
    names = [tensor.name for tensor in tensors]
    if len(set(names)) != len(names):
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise RouteError.invalid(f"input {name[:64]!r} appears more than once")
            seen.add(name)
    # Indexed, not copied: inputs the router does not read may be large.
    raw = request.raw_input_contents
    use_raw = len(raw) > 0
    if use_raw and len(raw) != len(tensors):
        raise RouteError.invalid(
            f"raw_input_contents has {len(raw)} entries but the "
            f"request has {len(tensors)} inputs; they must match one to one"
        )
    prompt: str | None = None
    max_tokens: int | None = None
    for i, name in enumerate(names):
        if name == TEXT_INPUT:
            prompt = _text_input(tensors[i], raw[i] if use_raw else None, limits)
        elif name == MAX_TOKENS:
            max_tokens = _max_tokens_input(tensors[i], raw[i] if use_raw else None)
    if prompt is None:
        raise RouteError.invalid(
            f"missing BYTES input '{TEXT_INPUT}' (the prompt); generate requests need it"
        )
    parameters = request.parameters
    if MAX_TOKENS in parameters:
        max_tokens = param_int(parameters[MAX_TOKENS], f"parameter '{MAX_TOKENS}'")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise RouteError.invalid(
            f"'{MAX_TOKENS}' must be between 1 and {MAX_TOKENS_LIMIT}, got {max_tokens}"
        )
    return GenerateRequest(model, version, prompt, max_tokens)


Tensor = pb.ModelInferRequest.InferInputTensor


def _check_names(model: str, version: str) -> None:
    if not model:
        raise RouteError.invalid("model_name is empty; name the model to run")
    for what, value in (("model_name", model), ("model_version", version)):
        if len(value) > MAX_NAME_CHARS:
            raise RouteError.invalid(
                f"{what} is {len(value)} characters long; at most {MAX_NAME_CHARS} are accepted"
            )


def _check_shape(tensor: Tensor, elements: int) -> None:
    """INVALID_ARGUMENT unless the declared shape holds exactly ``elements`` elements."""
    dims = tensor.shape
    if len(dims) == 1 and dims[0] == elements:  # what every generate request declares
        return
    declared = 1
    for dim in dims:
        if dim < 0:
            raise RouteError.invalid(
                f"input '{tensor.name}' has a negative dimension in shape {list(dims)[:8]}"
            )
        declared *= dim
        if declared > elements:
            break
    if declared != elements:
        shape = list(dims)[:8]  # as much as a message needs to show
        raise RouteError.invalid(
            f"input '{tensor.name}' has shape {shape} but holds {elements} element(s); "
            f"the shape must match the contents (e.g. [{elements}])"
        )


def _text_input(tensor: Tensor, raw: bytes | None, limits: Limits) -> str:
    """The prompt from ``tensor`` (its raw contents ``raw``, None: typed contents)."""
    datatype = tensor.datatype
    if datatype != "BYTES":
        raise RouteError.invalid(
            f"input '{TEXT_INPUT}' must have datatype BYTES, got {datatype[:32]!r}"
        )
    try:
        items = (
            decode_bytes_tensor(raw) if raw is not None else list(tensor.contents.bytes_contents)
        )
    except ValueError as exc:
        raise RouteError.invalid(f"input '{TEXT_INPUT}': {exc}") from None
    if len(items) != 1:
        raise RouteError.invalid(
            f"input '{TEXT_INPUT}' must hold exactly one element, got {len(items)}"
        )
    _check_shape(tensor, 1)
    prompt = items[0]
    if len(prompt) > limits.max_prompt_bytes:
        raise RouteError.invalid(
            f"input '{TEXT_INPUT}' is {len(prompt)} bytes; the limit is "
            f"{limits.max_prompt_bytes} bytes (limits.max_prompt_bytes)"
        )
    try:
        return prompt.decode("utf-8")
    except UnicodeDecodeError:
        raise RouteError.invalid(f"input '{TEXT_INPUT}' is not valid UTF-8") from None


def _max_tokens_input(tensor: Tensor, raw: bytes | None) -> int:
    """``max_tokens`` from ``tensor`` (its raw contents ``raw``, None: typed contents)."""
    datatype = tensor.datatype
    fmt = _INT_FORMATS.get(datatype)
    if fmt is None:
        raise RouteError.invalid(
            f"input '{MAX_TOKENS}' must be an integer tensor, got {datatype[:32]!r}"
        )
    if raw is not None:
        if len(raw) != struct.calcsize(fmt):
            raise RouteError.invalid(
                f"input '{MAX_TOKENS}' must hold exactly one {datatype} element "
                f"({struct.calcsize(fmt)} raw bytes), got {len(raw)} bytes"
            )
        values = [int(struct.unpack(fmt, raw)[0])]
    else:
        contents = tensor.contents
        values = [
            *contents.int_contents,
            *contents.int64_contents,
            *contents.uint_contents,
            *contents.uint64_contents,
        ]
    if len(values) != 1:
        raise RouteError.invalid(f"input '{MAX_TOKENS}' must hold exactly one element")
    _check_shape(tensor, 1)
    return int(values[0])


def wants_stream(request: pb.ModelInferRequest) -> bool:
    """On ModelStreamInfer: one response per token unless the request sets ``stream`` false."""
    param = request.parameters.get(STREAM)
    if param is None or param.WhichOneof("parameter_choice") != "bool_param":
        return True
    return bool(param.bool_param)


def text_response(
    request: pb.ModelInferRequest, text: str, *, final: bool | None = None
) -> pb.ModelInferResponse:
    """A V2 response carrying ``text`` as the BYTES output ``text_output``.

    ``final`` sets Triton's ``triton_final_response`` parameter on streamed
    responses; unary responses leave it out.
    """
    response = pb.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    output = response.outputs.add()
    output.name = TEXT_OUTPUT
    output.datatype = "BYTES"
    output.shape.append(1)
    response.raw_output_contents.append(encode_bytes_tensor([text.encode("utf-8")]))
    if final is not None:
        response.parameters[FINAL_RESPONSE].bool_param = final
    return response


def response_text(response: pb.ModelInferResponse) -> str:
    """Read ``text_output`` back from a response (raw or typed contents)."""
    for i, output in enumerate(response.outputs):
        if output.name == TEXT_OUTPUT:
            if len(response.raw_output_contents) > i:
                items = decode_bytes_tensor(response.raw_output_contents[i])
            else:
                items = list(output.contents.bytes_contents)
            return b"".join(items).decode("utf-8")
    return ""


def generate_request(
    model: str,
    prompt: str,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    *,
    request_id: str = "",
    stream: bool = False,
) -> pb.ModelInferRequest:
    """Build a generate-style request (used by loadgen, tests and benchmarks)."""
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    tensor = request.inputs.add()
    tensor.name = TEXT_INPUT
    tensor.datatype = "BYTES"
    tensor.shape.append(1)
    request.raw_input_contents.append(encode_bytes_tensor([prompt.encode("utf-8")]))
    request.parameters[MAX_TOKENS].int64_param = max_tokens
    if stream:
        request.parameters[STREAM].bool_param = True
    return request
