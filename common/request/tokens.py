"""What the GPU server says a request really cost, read from the answers it sends back.

Until the answer arrives a request's tokens are estimates: its prompt in
whitespace words (``GenerateRequest.prompt_tokens``) and its ``max_tokens``.
A GPU server that counts for real says so in its V2 responses, in one of three
forms, looked for in this order in each response:

* response parameters ``prompt_tokens`` and ``completion_tokens`` (int64, uint64
  or a decimal string): Meridian's own names, OpenAI's words. Each response
  carries the request's totals *so far*, so on a stream the last response read
  holds the whole count (a stream cut short still has what it got). The
  emulated GPU (``sim.worker``) sends these, on every response.
* a response parameter ``usage``: OpenAI's usage object as a JSON string
  (``{"prompt_tokens": 4, "completion_tokens": 10, ...}``), totals so far.
* output tensors ``num_input_tokens`` and ``num_output_tokens`` (Triton's vLLM
  backend with ``return_num_input_tokens`` / ``return_num_output_tokens``):
  ``num_output_tokens`` counts the tokens of *this* response, so a stream's
  are summed; ``num_input_tokens`` is the prompt's.

Tiers pass responses up unchanged, so every tier reads the same counts from the
answer it forwards. A value that is not a count (negative, not an integer, over
``MAX_COUNT``) is ignored: a broken server leaves the estimate, never a bill of
its own invention.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from common.gen.inference import grpc_service_pb2 as pb
from common.request.call import CallRecord

PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
USAGE = "usage"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
# Far above any context window: a larger count is a broken server, not a request.
MAX_COUNT = 1 << 31
_MAX_USAGE_CHARS = 4096
_UINT_FORMATS = {"UINT32": "<I", "INT32": "<i", "UINT64": "<Q", "INT64": "<q"}


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 <= value <= MAX_COUNT else None


# A response's ``parameters`` map (read once per response: each access builds a wrapper).
Parameters = Mapping[str, pb.InferParameter]


def _param_count(parameters: Parameters, name: str) -> int | None:
    param = parameters.get(name)
    if param is None:
        return None
    kind = param.WhichOneof("parameter_choice")
    if kind in ("int64_param", "uint64_param"):
        return _count(int(getattr(param, kind)))
    if kind == "string_param":
        text = param.string_param.strip()
        return _count(int(text)) if text.isascii() and text.isdigit() and len(text) < 12 else None
    return None


def _usage(parameters: Parameters) -> tuple[int | None, int | None]:
    param = parameters.get(USAGE)
    if param is None or param.WhichOneof("parameter_choice") != "string_param":
        return None, None
    if len(param.string_param) > _MAX_USAGE_CHARS:
        return None, None
    try:
        usage = json.loads(param.string_param)
    except ValueError:
        return None, None
    if not isinstance(usage, dict):
        return None, None
    return _count(usage.get(PROMPT_TOKENS)), _count(usage.get(COMPLETION_TOKENS))


def _output_count(response: pb.ModelInferResponse, name: str) -> int | None:
    """A one-element integer output tensor ``name`` (raw or typed contents)."""
    for i, output in enumerate(response.outputs):
        if output.name != name:
            continue
        fmt = _UINT_FORMATS.get(output.datatype)
        if fmt is None:
            return None
        if len(response.raw_output_contents) > i:
            raw = response.raw_output_contents[i]
            if len(raw) != struct.calcsize(fmt):
                return None
            return _count(int(struct.unpack(fmt, raw)[0]))
        c = output.contents
        values = [*c.uint_contents, *c.int_contents, *c.uint64_contents, *c.int64_contents]
        return _count(int(values[0])) if len(values) == 1 else None
    return None


@dataclass(slots=True)
class TokenCount:
    """The counts one request's answers reported so far (None: not reported)."""

    prompt: int | None = None
    completion: int | None = None

    @property
    def reported(self) -> bool:
        """Both counts came from the server."""
        return self.prompt is not None and self.completion is not None

    def add(self, response: pb.ModelInferResponse) -> None:
        """Take in one response of the request (the only one, or the next of a stream)."""
        parameters = response.parameters  # one wrapper for the three look-ups
        prompt = _param_count(parameters, PROMPT_TOKENS)
        completion = _param_count(parameters, COMPLETION_TOKENS)
        if prompt is None and completion is None:
            prompt, completion = _usage(parameters)
        if prompt is None and completion is None:
            prompt = _output_count(response, NUM_INPUT_TOKENS)
            delta = _output_count(response, NUM_OUTPUT_TOKENS)
            if delta is not None:  # this response's tokens: a stream's add up
                completion = min(MAX_COUNT, (self.completion or 0) + delta)
        if prompt is not None:
            self.prompt = prompt
        if completion is not None:
            self.completion = completion

    def fill(self, call: CallRecord, completion_estimate: int) -> None:
        """Put the counts into ``call``: each reported one replaces its estimate (the
        prompt's is already there); ``tokens_reported`` once both were reported."""
        if self.prompt is not None:
            call.prompt_tokens = self.prompt
        call.completion_tokens = (
            self.completion if self.completion is not None else completion_estimate
        )
        call.tokens_reported = self.reported


def put_counts(response: pb.ModelInferResponse, prompt: int, completion: int) -> None:
    """Set Meridian's count parameters on a response (totals so far)."""
    response.parameters[PROMPT_TOKENS].int64_param = prompt
    response.parameters[COMPLETION_TOKENS].int64_param = completion
