"""What each GPU reports about its own load, with the age of every sample.

Two sources feed one ``LoadBook``: the ``BackendMonitor`` (``local_lb.load``)
scrapes each GPU's Prometheus endpoint on an interval (vLLM, SGLang or Triton
metric names), and the proxy records the ``x-meridian-load`` trailer the GPU puts on
every response. The book keeps the newest sample per GPU; a sample older than
the caller's ``max_age_s`` reads as unknown (``None``), never as an idle GPU.
Parsing is in small pure functions; nothing here does I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

Load = tuple[float, float, float | None]

LOAD_TRAILER = "x-meridian-load"

_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
# vLLM first, then SGLang; Triton's queued-for-execution count means the same thing.
_WAITING = (
    "vllm:num_requests_waiting",
    "sglang:num_queue_reqs",
    "nv_inference_pending_request_count",
)
# The current vLLM name first, then the one it replaced, then SGLang's (the fraction
# of its KV token pool in use).
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_KNOWN = frozenset(_RUNNING + _WAITING + _KV)

# One sample line of the text exposition format: name, optional labels (quoted
# values may hold commas, spaces, braces and escaped quotes), value, optional
# timestamp. Every repetition ends in a distinct character, so matching is linear.
_LABEL = r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*=\s*"(?:[^"\\]|\\.)*"'
_SAMPLE = re.compile(
    rf"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    rf"(?:\{{(?:{_LABEL}\s*,)*(?:{_LABEL})?\s*\}})?"
    r"[ \t]+(?P<value>\S+)(?:[ \t]+-?\d+)?"
)


@dataclass(frozen=True)
class LoadSample:
    """One GPU's load as it reported it, and when this process received it."""

    running: float
    waiting: float
    kv_cache_usage: float | None  # 0..1 of the KV cache; None when the server does not say
    taken_at: float  # this process's monotonic clock
    source: str  # "metrics" or "trailer"

    def age(self, now: float) -> float:
        return now - self.taken_at


def parse_prometheus_load(text: str) -> Load | None:
    """``(running, waiting, kv_cache_usage)`` from a Prometheus text exposition.

    Counts are summed over all label sets (one series per model). KV usage is
    a fraction of the one cache the models share (the emulated GPU repeats the
    same GPU-wide figure on every model's series), so it takes the largest
    series, never a sum. SGLang's names are read where vLLM's are absent, and
    Triton's pending count as waiting where neither's waiting gauge is present
    (Triton has no running gauge, so running is 0).
    Comments, unknown metrics, malformed lines and non-finite or negative
    values are skipped, and so is a value that would make a sum overflow.
    ``None`` when no known metric is present.
    """
    sums: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith(("vllm:", "sglang:", "nv_inference_pending_request_count")):
            continue  # comments, HELP/TYPE and other metrics, without a regex
        match = _SAMPLE.fullmatch(line)
        if match is None or match["name"] not in _KNOWN:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        if not math.isfinite(value) or value < 0:
            continue
        name = match["name"]
        if name in _KV:
            sums[name] = max(sums.get(name, 0.0), value)
        elif math.isfinite(total := sums.get(name, 0.0) + value):  # 1e308 twice is no load
            sums[name] = total
    if not sums:
        return None
    running = next((sums[n] for n in _RUNNING if n in sums), 0.0)
    waiting = next((sums[n] for n in _WAITING if n in sums), 0.0)
    kv = next((sums[n] for n in _KV if n in sums), None)
    return running, waiting, kv


def parse_load_trailer(value: str) -> tuple[float, float, float] | None:
    """``(running, waiting, kv)`` from ``running=3,waiting=1,kv=0.250``; ``None`` if malformed.

    All three keys are required, once each, with finite non-negative values;
    unknown keys are ignored so the GPU side can add fields.
    """
    parts = value.split(",")
    if len(parts) == 3:  # the GPU's own form, on every response: read without a dict
        r, w, k = parts
        if r[:8] == "running=" and w[:8] == "waiting=" and k[:3] == "kv=":
            try:
                load = float(r[8:]), float(w[8:]), float(k[3:])
            except ValueError:
                return None
            if all(math.isfinite(x) and x >= 0 for x in load):
                return load
            return None
    fields: dict[str, float] = {}
    for part in parts:
        key, sep, text = part.strip().partition("=")
        if not sep or not key:
            return None
        try:
            number = float(text)
        except ValueError:
            return None
        if key in fields or not math.isfinite(number) or number < 0:
            return None
        fields[key] = number
    try:
        return fields["running"], fields["waiting"], fields["kv"]
    except KeyError:
        return None


class LoadBook:
    """The newest load sample of each GPU, from whichever source reported last.

    Reads take the caller's ``now`` and ``max_age_s``: a sample older than
    that is unknown (``None``), never read as an idle GPU with zero load.
    """

    def __init__(self) -> None:
        self._samples: dict[str, LoadSample] = {}

    def update(self, name: str, sample: LoadSample) -> None:
        """Keep ``sample`` unless the book already holds a newer one for ``name``."""
        current = self._samples.get(name)
        if current is None or sample.taken_at >= current.taken_at:
            self._samples[name] = sample

    @property
    def newest(self) -> Mapping[str, LoadSample]:
        """Each GPU's newest sample whatever its age, for a reader that goes over every
        GPU and applies ``get``'s age rule itself (the zone summary)."""
        return self._samples

    def get(self, name: str, now: float, max_age_s: float) -> LoadSample | None:
        """The newest sample if at most ``max_age_s`` old, else ``None`` (unknown)."""
        sample = self._samples.get(name)
        if sample is None or now - sample.taken_at > max_age_s:  # its age, inline (hot)
            return None
        return sample

    def forget(self, name: str) -> None:
        """Drop a GPU that left the zone."""
        self._samples.pop(name, None)

    def conservative_waiting(
        self, name: str, now: float, max_age_s: float, fallback: float
    ) -> float:
        """The GPU's reported queue length if fresh, else ``fallback``.

        A missing or stale sample is never read as an empty queue: the caller
        passes something pessimistic (its own in-flight count, or a penalty).
        """
        sample = self.get(name, now, max_age_s)
        return fallback if sample is None else sample.waiting

    def record_trailer(
        self, name: str, trailers: Iterable[tuple[str, str | bytes]] | None, now: float
    ) -> LoadSample | None:
        """Record the ``x-meridian-load`` trailer of a response from ``name``, if well-formed."""
        for key, value in trailers or ():
            if key.lower() != LOAD_TRAILER:
                continue
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
            parsed = parse_load_trailer(text)
            if parsed is None:
                return None
            sample = LoadSample(*parsed, taken_at=now, source="trailer")
            self.update(name, sample)
            return sample
        return None
