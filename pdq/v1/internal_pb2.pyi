from pdq.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AttemptFailure(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTEMPT_FAILURE_UNSPECIFIED: _ClassVar[AttemptFailure]
    ATTEMPT_FAILURE_REQUEST: _ClassVar[AttemptFailure]
    ATTEMPT_FAILURE_HANDOFF: _ClassVar[AttemptFailure]
    ATTEMPT_FAILURE_LOST: _ClassVar[AttemptFailure]
ATTEMPT_FAILURE_UNSPECIFIED: AttemptFailure
ATTEMPT_FAILURE_REQUEST: AttemptFailure
ATTEMPT_FAILURE_HANDOFF: AttemptFailure
ATTEMPT_FAILURE_LOST: AttemptFailure

class RequestSpec(_message.Message):
    __slots__ = ("request_id", "tenant", "tier", "prompt_token_ids", "sampling", "arrival_ms", "deadline_ms", "traceparent", "stream_interval", "content_hash", "client_request_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_MS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    tier: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    arrival_ms: int
    deadline_ms: int
    traceparent: str
    stream_interval: int
    content_hash: str
    client_request_id: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., tier: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., arrival_ms: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., traceparent: _Optional[str] = ..., stream_interval: _Optional[int] = ..., content_hash: _Optional[str] = ..., client_request_id: _Optional[str] = ...) -> None: ...

class SubmitManyRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[SubmitRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[SubmitRequest, _Mapping]]] = ...) -> None: ...

class SubmitManyResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[SubmitOutcome]
    def __init__(self, items: _Optional[_Iterable[_Union[SubmitOutcome, _Mapping]]] = ...) -> None: ...

class SubmitOutcome(_message.Message):
    __slots__ = ("response", "code", "message", "trailing")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRAILING_FIELD_NUMBER: _ClassVar[int]
    response: SubmitResponse
    code: int
    message: str
    trailing: _containers.RepeatedCompositeFieldContainer[MetadataEntry]
    def __init__(self, response: _Optional[_Union[SubmitResponse, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., trailing: _Optional[_Iterable[_Union[MetadataEntry, _Mapping]]] = ...) -> None: ...

class MetadataEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("spec", "idempotency_key")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    spec: RequestSpec
    idempotency_key: str
    def __init__(self, spec: _Optional[_Union[RequestSpec, _Mapping]] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("request_id", "created")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    created: bool
    def __init__(self, request_id: _Optional[str] = ..., created: _Optional[bool] = ...) -> None: ...

class InternalCancelRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class InternalCancelResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: str
    def __init__(self, state: _Optional[str] = ...) -> None: ...

class PrefillItem(_message.Message):
    __slots__ = ("spec", "epoch", "decode_address", "priority", "decode_kv_address", "decode_cached_tokens")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DECODE_KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    spec: RequestSpec
    epoch: int
    decode_address: str
    priority: int
    decode_kv_address: str
    decode_cached_tokens: int
    def __init__(self, spec: _Optional[_Union[RequestSpec, _Mapping]] = ..., epoch: _Optional[int] = ..., decode_address: _Optional[str] = ..., priority: _Optional[int] = ..., decode_kv_address: _Optional[str] = ..., decode_cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillBatch(_message.Message):
    __slots__ = ("batch_id", "items", "more_coming")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    MORE_COMING_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    items: _containers.RepeatedCompositeFieldContainer[PrefillItem]
    more_coming: bool
    def __init__(self, batch_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[PrefillItem, _Mapping]]] = ..., more_coming: _Optional[bool] = ...) -> None: ...

class PrefillItemResult(_message.Message):
    __slots__ = ("request_id", "ok", "error", "failure")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ok: bool
    error: str
    failure: AttemptFailure
    def __init__(self, request_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., failure: _Optional[_Union[AttemptFailure, str]] = ...) -> None: ...

class PrefillBatchResult(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PrefillItemResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PrefillItemResult, _Mapping]]] = ...) -> None: ...

class PreemptRequest(_message.Message):
    __slots__ = ("tiers", "reason")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, tiers: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class PreemptResponse(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "epoch", "tokens", "keep_free", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FREE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: int
    tokens: int
    keep_free: int
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[int] = ..., tokens: _Optional[int] = ..., keep_free: _Optional[int] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("granted", "free_slots", "kv_address")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    free_slots: int
    kv_address: str
    def __init__(self, granted: _Optional[bool] = ..., free_slots: _Optional[int] = ..., kv_address: _Optional[str] = ...) -> None: ...

class ReserveManyRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ReserveRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[ReserveRequest, _Mapping]]] = ...) -> None: ...

class ReserveManyResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ReserveResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[ReserveResponse, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "epoch")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: int
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("spec", "epoch", "num_tokens", "generated_token_ids", "num_layers", "num_kv_heads", "head_dim", "dtype", "layout_version", "skip_tokens")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SKIP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    spec: RequestSpec
    epoch: int
    num_tokens: int
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layout_version: int
    skip_tokens: int
    def __init__(self, spec: _Optional[_Union[RequestSpec, _Mapping]] = ..., epoch: _Optional[int] = ..., num_tokens: _Optional[int] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., layout_version: _Optional[int] = ..., skip_tokens: _Optional[int] = ...) -> None: ...

class KVData(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVTrailer(_message.Message):
    __slots__ = ("xxh3_64", "total_bytes")
    XXH3_64_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    xxh3_64: int
    total_bytes: int
    def __init__(self, xxh3_64: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "data", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    data: KVData
    trailer: KVTrailer
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., data: _Optional[_Union[KVData, _Mapping]] = ..., trailer: _Optional[_Union[KVTrailer, _Mapping]] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...
