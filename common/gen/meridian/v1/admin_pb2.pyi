from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListTopologyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Node(_message.Message):
    __slots__ = ("name", "kind", "endpoint", "healthy", "drained", "weight", "outstanding_requests", "last_error", "healthy_gpus", "total_gpus", "total_slots", "free_slots", "queued_requests", "utilisation", "summary_fresh", "hardware", "rate", "ejected", "reported_running", "reported_waiting", "kv_cache_usage", "children", "error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_GPUS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_GPUS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    UTILISATION_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FRESH_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    EJECTED_FIELD_NUMBER: _ClassVar[int]
    REPORTED_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REPORTED_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    endpoint: str
    healthy: bool
    drained: bool
    weight: float
    outstanding_requests: int
    last_error: str
    healthy_gpus: int
    total_gpus: int
    total_slots: int
    free_slots: int
    queued_requests: int
    utilisation: float
    summary_fresh: bool
    hardware: str
    rate: float
    ejected: bool
    reported_running: float
    reported_waiting: float
    kv_cache_usage: float
    children: _containers.RepeatedCompositeFieldContainer[Node]
    error: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., endpoint: _Optional[str] = ..., healthy: _Optional[bool] = ..., drained: _Optional[bool] = ..., weight: _Optional[float] = ..., outstanding_requests: _Optional[int] = ..., last_error: _Optional[str] = ..., healthy_gpus: _Optional[int] = ..., total_gpus: _Optional[int] = ..., total_slots: _Optional[int] = ..., free_slots: _Optional[int] = ..., queued_requests: _Optional[int] = ..., utilisation: _Optional[float] = ..., summary_fresh: _Optional[bool] = ..., hardware: _Optional[str] = ..., rate: _Optional[float] = ..., ejected: _Optional[bool] = ..., reported_running: _Optional[float] = ..., reported_waiting: _Optional[float] = ..., kv_cache_usage: _Optional[float] = ..., children: _Optional[_Iterable[_Union[Node, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...

class ListTopologyResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("target",)
    TARGET_FIELD_NUMBER: _ClassVar[int]
    target: str
    def __init__(self, target: _Optional[str] = ...) -> None: ...

class SetWeightRequest(_message.Message):
    __slots__ = ("gpu", "weight")
    GPU_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    gpu: str
    weight: float
    def __init__(self, gpu: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class AdminActionResponse(_message.Message):
    __slots__ = ("target", "kind", "applied_by", "detail")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    APPLIED_BY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    target: str
    kind: str
    applied_by: str
    detail: str
    def __init__(self, target: _Optional[str] = ..., kind: _Optional[str] = ..., applied_by: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class ReloadTopologyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierReload(_message.Message):
    __slots__ = ("tier", "added", "removed", "changed", "not_applied", "error")
    TIER_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    NOT_APPLIED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    tier: str
    added: _containers.RepeatedScalarFieldContainer[str]
    removed: _containers.RepeatedScalarFieldContainer[str]
    changed: _containers.RepeatedScalarFieldContainer[str]
    not_applied: _containers.RepeatedScalarFieldContainer[str]
    error: str
    def __init__(self, tier: _Optional[str] = ..., added: _Optional[_Iterable[str]] = ..., removed: _Optional[_Iterable[str]] = ..., changed: _Optional[_Iterable[str]] = ..., not_applied: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ...) -> None: ...

class ReloadTopologyResponse(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierReload]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierReload, _Mapping]]] = ...) -> None: ...
