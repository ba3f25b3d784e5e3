from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OperatorCancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class OperatorCancelResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: str
    def __init__(self, state: _Optional[str] = ...) -> None: ...

class CancelTenantRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class CancelTenantResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: int
    def __init__(self, cancelled: _Optional[int] = ...) -> None: ...

class SetDeadlineRequest(_message.Message):
    __slots__ = ("request_id", "timeout_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    timeout_ms: int
    def __init__(self, request_id: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class GetRequestRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class RequestInfo(_message.Message):
    __slots__ = ("request_id", "tenant", "tier", "state", "prompt_tokens", "max_tokens", "output_tokens", "created_ms", "deadline_ms", "dispatched_ms", "first_token_ms", "finished_ms", "prefill_worker", "decode_worker", "attempts", "finish_reason", "error", "client_request_id", "lost_attempts")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CREATED_MS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOST_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    tier: str
    state: str
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    created_ms: int
    deadline_ms: int
    dispatched_ms: int
    first_token_ms: int
    finished_ms: int
    prefill_worker: str
    decode_worker: str
    attempts: int
    finish_reason: str
    error: str
    client_request_id: str
    lost_attempts: int
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., tier: _Optional[str] = ..., state: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., created_ms: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., dispatched_ms: _Optional[int] = ..., first_token_ms: _Optional[int] = ..., finished_ms: _Optional[int] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., attempts: _Optional[int] = ..., finish_reason: _Optional[str] = ..., error: _Optional[str] = ..., client_request_id: _Optional[str] = ..., lost_attempts: _Optional[int] = ...) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ("tenant", "state", "tier", "page_size", "page_token")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    state: str
    tier: str
    page_size: int
    page_token: str
    def __init__(self, tenant: _Optional[str] = ..., state: _Optional[str] = ..., tier: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("requests", "next_page_token")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestInfo]
    next_page_token: str
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "free_slots", "capacity", "running", "draining", "heartbeat_ms", "quarantined_until_ms", "quarantine_reason", "kv_free_tokens", "kv_total_tokens", "kv_block_size", "reserved")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_UNTIL_MS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    address: str
    free_slots: int
    capacity: int
    running: int
    draining: bool
    heartbeat_ms: int
    quarantined_until_ms: int
    quarantine_reason: str
    kv_free_tokens: int
    kv_total_tokens: int
    kv_block_size: int
    reserved: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., free_slots: _Optional[int] = ..., capacity: _Optional[int] = ..., running: _Optional[int] = ..., draining: _Optional[bool] = ..., heartbeat_ms: _Optional[int] = ..., quarantined_until_ms: _Optional[int] = ..., quarantine_reason: _Optional[str] = ..., kv_free_tokens: _Optional[int] = ..., kv_total_tokens: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., reserved: _Optional[int] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class PauseQueueRequest(_message.Message):
    __slots__ = ("tier", "tenant")
    TIER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tier: str
    tenant: str
    def __init__(self, tier: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class PauseQueueResponse(_message.Message):
    __slots__ = ("paused_tiers", "paused_tenants")
    PAUSED_TIERS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_TENANTS_FIELD_NUMBER: _ClassVar[int]
    paused_tiers: _containers.RepeatedScalarFieldContainer[str]
    paused_tenants: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, paused_tiers: _Optional[_Iterable[str]] = ..., paused_tenants: _Optional[_Iterable[str]] = ...) -> None: ...

class TenantPolicy(_message.Message):
    __slots__ = ("tenant", "weight", "tier", "max_queued", "max_queued_tokens")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: float
    tier: str
    max_queued: int
    max_queued_tokens: int
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[float] = ..., tier: _Optional[str] = ..., max_queued: _Optional[int] = ..., max_queued_tokens: _Optional[int] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantPolicy]
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantPolicy, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class QueueDepth(_message.Message):
    __slots__ = ("tier", "tenant", "requests", "tokens")
    TIER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    tenant: str
    requests: int
    tokens: int
    def __init__(self, tier: _Optional[str] = ..., tenant: _Optional[str] = ..., requests: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("queues", "running", "kv_slots_used", "kv_slots_total", "paused_tiers", "paused_tenants", "kv_tokens_used", "kv_tokens_total")
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAUSED_TIERS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_TENANTS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    queues: _containers.RepeatedCompositeFieldContainer[QueueDepth]
    running: int
    kv_slots_used: int
    kv_slots_total: int
    paused_tiers: _containers.RepeatedScalarFieldContainer[str]
    paused_tenants: _containers.RepeatedScalarFieldContainer[str]
    kv_tokens_used: int
    kv_tokens_total: int
    def __init__(self, queues: _Optional[_Iterable[_Union[QueueDepth, _Mapping]]] = ..., running: _Optional[int] = ..., kv_slots_used: _Optional[int] = ..., kv_slots_total: _Optional[int] = ..., paused_tiers: _Optional[_Iterable[str]] = ..., paused_tenants: _Optional[_Iterable[str]] = ..., kv_tokens_used: _Optional[int] = ..., kv_tokens_total: _Optional[int] = ...) -> None: ...
