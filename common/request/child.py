"""One child of a tier (a region, a zone or a GPU) and what the tier knows of it:
direct health evidence, the load it put there, capacity summaries and hints.

Pickers read ``Child`` state; only ``common.request.children`` (the ``ChildSet``)
and the proxy core write it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from common.basics.geo import GeoPoint
from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.gen.meridian.v1 import capacity_pb2

Capacity = capacity_pb2.ModelCapacity
Serving = tuple[bool, Capacity | None]  # may it serve a model, and the report that says so


@dataclass(eq=False)
class Child:
    """One child endpoint (a region, a zone or a GPU) and what this tier knows of it."""

    name: str
    # Where this tier dials it (a tier's ``address``: maybe a name for several replicas).
    endpoint: Endpoint
    models: frozenset[str]
    location: GeoPoint | None = None
    speed: float = 1.0
    # Direct evidence: the last probe or forward succeeded.
    healthy: bool = True
    # Set by the Admin API: no new requests, in-flight ones finish, health still watched.
    drained: bool = False
    # When direct evidence last turned healthy (-inf: healthy from the start).
    healthy_since: float = float("-inf")
    last_error: str = ""
    # Load this tier put on the child and has not seen finish; work in the unit of
    # backlogs and capacities (PickRequest.work, a local tier's crediting its cache).
    outstanding_requests: int = 0
    outstanding_work: float = 0.0
    # Both when the newest capacity report arrived: what was sent since then is not
    # in the report yet, and what came back since is no longer busy.
    outstanding_at_report: int = 0
    outstanding_work_at_report: float = 0.0
    # Newest capacity summary (replicas combined) and when it arrived (this tier's
    # monotonic clock); the newest summary of each publishing replica.
    summary: capacity_pb2.CapacitySummary | None = None
    summary_received_at: float = 0.0
    replicas: dict[str, tuple[capacity_pb2.CapacitySummary, float]] = field(
        default_factory=dict, repr=False
    )
    # A compact capacity hint from the child's last response, fresher than summaries.
    hint: capacity_pb2.ModelCapacity | None = None
    hint_at: float = float("-inf")
    stub: pb_grpc.GRPCInferenceServiceStub | None = field(default=None, repr=False)
    # The channel under ``stub`` (the Admin API calls the child's tier over it too).
    channel: grpc.aio.Channel | None = field(default=None, repr=False)
    # How to dial this child when it differs from its set's (a GPU that serves TLS).
    credentials: grpc.ChannelCredentials | None = field(default=None, repr=False)
    # False once its ModelStreamInfer proved not Triton's (common.request.stream_request).
    streams: bool = True

    def fresh_summary(self, now: float, ttl_s: float) -> capacity_pb2.CapacitySummary | None:
        """The summary if younger than ``ttl_s``; a stale one reads as unknown (None)."""
        if self.summary is None or now - self.summary_received_at > ttl_s:
            return None
        return self.summary

    def model_capacity(self, model: str, now: float, ttl_s: float) -> Capacity | None:
        """The newest fresh report for ``model`` (summary entry or hint); None if unknown."""
        if self.hint is not None and self.hint.model == model and now - self.hint_at <= ttl_s:
            if self.hint_at >= self.summary_received_at:
                return self.hint
        summary = self.fresh_summary(now, ttl_s)
        if summary is None:
            return None
        for entry in summary.models:
            if entry.model == model:
                return entry
        return None

    def may_serve(self, model: str, now: float, ttl_s: float) -> bool:
        return self.serving_capacity(model, now, ttl_s)[0]

    def serving_capacity(self, model: str, now: float, ttl_s: float) -> Serving:
        """``may_serve`` (healthy by direct evidence, not drained, serves ``model``, no fresh
        summary says it has no healthy GPU: stale or unknown proves nothing), and the report."""
        if not self.healthy or self.drained or model not in self.models:
            return False, None
        entry = self.model_capacity(model, now, ttl_s)
        return entry is None or entry.healthy_gpus > 0 or entry.unknown_children > 0, entry
