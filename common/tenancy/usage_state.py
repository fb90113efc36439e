"""Whether the usage stream still holds every record written to it: trimmed, reset, or whole.

``UsageRecorder`` keeps ``<stream>:meta`` beside the stream (see
``common.tenancy.usage``); this reads it with XINFO STREAM and says, for a
time window, what a reader of the totals must know: entries trimmed by
``MAXLEN ~`` from before the oldest entry kept, a reset a recorder detected
(Redis lost its data), or a stream that begins after the window does.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

from redis.exceptions import ResponseError

from common.basics.redis_url import async_redis
from common.tenancy.usage_record import USAGE_STREAM, field_text, meta_key


@dataclasses.dataclass(frozen=True)
class StreamState:
    """What XINFO STREAM and the recorders' metadata say; times are Redis's, in epoch ms.

    ``added``: entries ever added (XINFO's ``entries-added`` on Redis >= 7, else
    the recorders' count; None when neither is known). ``has_meta``: False when
    no recorder of this version wrote to the stream since Redis last lost it.
    """

    stream: str
    length: int
    added: int | None
    first_entry_ms: int | None
    created_ms: int | None
    resets: int
    last_reset_ms: int | None
    has_meta: bool

    @property
    def trimmed(self) -> int:
        return max(0, self.added - self.length) if self.added is not None else 0

    def warnings(self, since_ms: int | None) -> list[str]:
        """What makes totals from ``since_ms`` on short, or cannot be told; [] when whole."""

        def inside(ms: int | None) -> bool:  # a moment after the window starts
            return ms is not None and (since_ms is None or since_ms < ms)

        out = []
        if self.resets and inside(self.last_reset_ms):
            out.append(
                f"the usage stream was reset at {iso(self.last_reset_ms)} ({self.resets} "
                "time(s) in all): Redis lost its data (restarted without persistence, flushed, "
                "or failed over to an empty replica); records written before then are gone"
            )
        elif inside(self.created_ms):
            out.append(
                f"the usage stream begins at {iso(self.created_ms)}, after the window starts: "
                "if Meridian served requests before then, Redis lost their records"
            )
        if self.trimmed and inside(self.first_entry_ms):
            out.append(
                f"{self.trimmed} of {self.added} usage records were trimmed from the stream "
                f"(MAXLEN); the oldest kept was written at {iso(self.first_entry_ms)}: totals "
                "before it are short"
            )
        if not self.has_meta and self.length:
            out.append(
                "the usage stream has no metadata (written by another writer): whether it "
                "was trimmed or reset cannot be told"
            )
        return out

    def as_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "trimmed": self.trimmed}


def iso(ms: int | None) -> str:
    if ms is None:
        return "?"
    moment = datetime.fromtimestamp(ms / 1000, UTC)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


async def stream_state(redis_url: str, stream: str = USAGE_STREAM) -> StreamState:
    """Read the stream's XINFO and metadata; raises ``RedisError``/``OSError``."""
    client = async_redis(redis_url, socket_timeout=5.0, socket_connect_timeout=2.0)
    try:
        raw = await client.hgetall(meta_key(stream))
        meta = {field_text(k): field_text(v) for k, v in raw.items()}
        try:
            info: dict[str, Any] = await client.xinfo_stream(stream)
        except ResponseError:  # no such key
            info = {"length": 0}
    finally:
        await client.aclose()
    first = info.get("first-entry")
    first_id = first[0].decode() if first else None
    added = info.get("entries-added", meta.get("added"))
    return StreamState(
        stream=stream,
        length=int(info["length"]),
        added=_int(added),
        first_entry_ms=int(first_id.split("-", 1)[0]) if first_id else None,
        created_ms=_int(meta.get("created_ms")),
        resets=int(meta.get("resets", 0)),
        last_reset_ms=_int(meta.get("last_reset_ms")),
        has_meta=bool(meta),
    )
