from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelCapacity(_message.Message):
    __slots__ = ("model", "healthy_gpus", "total_gpus", "total_slots", "free_slots", "queued_requests", "estimated_wait_s", "token_throughput_capacity", "utilisation", "kv_cache_usage", "unknown_children", "busy_slots", "tier_queued_requests")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_GPUS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_GPUS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    TOKEN_THROUGHPUT_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    UTILISATION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_CHILDREN_FIELD_NUMBER: _ClassVar[int]
    BUSY_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TIER_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    healthy_gpus: int
    total_gpus: int
    total_slots: int
    free_slots: int
    queued_requests: int
    estimated_wait_s: float
    token_throughput_capacity: float
    utilisation: float
    kv_cache_usage: float
    unknown_children: int
    busy_slots: int
    tier_queued_requests: int
    def __init__(self, model: _Optional[str] = ..., healthy_gpus: _Optional[int] = ..., total_gpus: _Optional[int] = ..., total_slots: _Optional[int] = ..., free_slots: _Optional[int] = ..., queued_requests: _Optional[int] = ..., estimated_wait_s: _Optional[float] = ..., token_throughput_capacity: _Optional[float] = ..., utilisation: _Optional[float] = ..., kv_cache_usage: _Optional[float] = ..., unknown_children: _Optional[int] = ..., busy_slots: _Optional[int] = ..., tier_queued_requests: _Optional[int] = ...) -> None: ...

class CapacitySummary(_message.Message):
    __slots__ = ("source_id", "sequence", "timestamp_ms", "region", "zone", "publisher_healthy", "models")
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    source_id: str
    sequence: int
    timestamp_ms: int
    region: str
    zone: str
    publisher_healthy: bool
    models: _containers.RepeatedCompositeFieldContainer[ModelCapacity]
    def __init__(self, source_id: _Optional[str] = ..., sequence: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., region: _Optional[str] = ..., zone: _Optional[str] = ..., publisher_healthy: _Optional[bool] = ..., models: _Optional[_Iterable[_Union[ModelCapacity, _Mapping]]] = ...) -> None: ...
