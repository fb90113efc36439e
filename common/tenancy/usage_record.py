"""One usage record and the Redis keys of the usage stream (see ``common.tenancy.usage``)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from typing import Any

# ``{usage}`` is a Redis Cluster hash tag: the stream, its meta hash and its batch
# markers are written by one Lua script, so they must share a slot.
USAGE_STREAM = "meridian:{usage}"
OK_STATUS = "OK"


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclasses.dataclass(frozen=True)
class UsageRecord:
    """What one finished request cost; ``status`` is a gRPC status name (``OK``, ``UNAVAILABLE``).

    ``request_id`` is unique per request (uuid4 hex): the key ``summarise`` de-duplicates on.
    ``tokens_reported``: the token counts are the GPU server's own; False, they are
    the edge's estimates (prompt words; ``max_tokens``, or the token responses of a
    stream) because the server reported none (records older than the field read False).
    """

    tenant: str
    model: str
    region: str
    zone: str
    gpu: str
    prompt_tokens: int
    completion_tokens: int
    gpu_seconds: float
    status: str
    trace_id: str
    request_id: str
    finished_at_ms: int
    tokens_reported: bool = False

    def to_fields(self) -> dict[str, str]:
        """Flat string fields for XADD; ``repr`` keeps ``gpu_seconds`` exact."""
        return {
            f.name: repr(v) if isinstance(v := getattr(self, f.name), float) else str(v)
            for f in dataclasses.fields(self)
        }

    @classmethod
    def from_fields(cls, fields: Mapping[Any, Any]) -> UsageRecord:
        """Inverse of ``to_fields``; accepts bytes or str, ignores unknown fields (newer
        writers may add some) and takes a field with a default as that default when it
        is missing (older writers lacked it). ``ValueError`` naming the field when one
        is missing or bad."""
        text = {field_text(k): field_text(v) for k, v in fields.items()}
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in text:
                if f.default is not dataclasses.MISSING:
                    continue
                raise ValueError(f"usage record has no field {f.name!r}")
            try:
                values[f.name] = _parse(f.type, text[f.name])
            except ValueError:
                raise ValueError(
                    f"usage record field {f.name!r}: bad value {text[f.name]!r}"
                ) from None
        return cls(**values)


def _parse(kind: object, raw: str) -> Any:
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    if kind == "bool":
        if raw not in ("True", "False"):
            raise ValueError(raw)
        return raw == "True"
    return raw


def field_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _tagged(stream: str) -> str:
    """``stream`` as the prefix of keys in its hash slot: as it is when it carries a
    hash tag (``meridian:{usage}``), else the whole name as the tag (``{name}``)."""
    opened = stream.find("{")
    if opened != -1 and stream.find("}", opened + 1) > opened + 1:
        return stream
    return f"{{{stream}}}"


def meta_key(stream: str) -> str:
    """The hash beside ``stream`` that says what was ever added to it, and when it began."""
    return f"{_tagged(stream)}:meta"


def batch_key(stream: str, batch_id: str) -> str:
    """The marker of one written batch (its records are in ``stream`` exactly once)."""
    return f"{_tagged(stream)}:batch:{batch_id}"
