from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChunkHeader(_message.Message):
    __slots__ = ("transfer_id", "seq", "layer_start", "layer_end", "num_layers", "dtype", "shape", "checksum", "trace_context", "pair_id", "kv_head_start")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    seq: int
    layer_start: int
    layer_end: int
    num_layers: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    checksum: int
    trace_context: _containers.ScalarMap[str, str]
    pair_id: str
    kv_head_start: int
    def __init__(self, transfer_id: _Optional[str] = ..., seq: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_layers: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., checksum: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., pair_id: _Optional[str] = ..., kv_head_start: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    payload: bytes
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PushChunksResponse(_message.Message):
    __slots__ = ("chunks", "bytes")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    bytes: int
    def __init__(self, chunks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("transfer_id", "first_token_id", "first_logprob", "num_prompt_tokens", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    first_token_id: int
    first_logprob: float
    num_prompt_tokens: int
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, transfer_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[float] = ..., num_prompt_tokens: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("was_open",)
    WAS_OPEN_FIELD_NUMBER: _ClassVar[int]
    was_open: bool
    def __init__(self, was_open: _Optional[bool] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("backend",)
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    backend: str
    def __init__(self, backend: _Optional[str] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("pair_id", "rank", "timeout_s")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    rank: int
    timeout_s: float
    def __init__(self, pair_id: _Optional[str] = ..., rank: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PrepareChunkResponse(_message.Message):
    __slots__ = ("tag",)
    TAG_FIELD_NUMBER: _ClassVar[int]
    tag: int
    def __init__(self, tag: _Optional[int] = ...) -> None: ...

class RendezvousRequest(_message.Message):
    __slots__ = ("pair_id", "op", "key", "value", "amount", "keys", "timeout_s")
    class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OP_UNSPECIFIED: _ClassVar[RendezvousRequest.Op]
        SET: _ClassVar[RendezvousRequest.Op]
        GET: _ClassVar[RendezvousRequest.Op]
        ADD: _ClassVar[RendezvousRequest.Op]
        WAIT: _ClassVar[RendezvousRequest.Op]
        CHECK: _ClassVar[RendezvousRequest.Op]
    OP_UNSPECIFIED: RendezvousRequest.Op
    SET: RendezvousRequest.Op
    GET: RendezvousRequest.Op
    ADD: RendezvousRequest.Op
    WAIT: RendezvousRequest.Op
    CHECK: RendezvousRequest.Op
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    op: RendezvousRequest.Op
    key: str
    value: bytes
    amount: int
    keys: _containers.RepeatedScalarFieldContainer[str]
    timeout_s: float
    def __init__(self, pair_id: _Optional[str] = ..., op: _Optional[_Union[RendezvousRequest.Op, str]] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., amount: _Optional[int] = ..., keys: _Optional[_Iterable[str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class RendezvousResponse(_message.Message):
    __slots__ = ("value", "count", "present")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    count: int
    present: bool
    def __init__(self, value: _Optional[bytes] = ..., count: _Optional[int] = ..., present: _Optional[bool] = ...) -> None: ...

class PullKVRequest(_message.Message):
    __slots__ = ("header", "agent_metadata", "address", "memory", "device_id", "src_block_ids", "src_num_blocks", "src_num_heads", "src_head_start")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SRC_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SRC_NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    SRC_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    agent_metadata: bytes
    address: int
    memory: str
    device_id: int
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    src_num_blocks: int
    src_num_heads: int
    src_head_start: int
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., agent_metadata: _Optional[bytes] = ..., address: _Optional[int] = ..., memory: _Optional[str] = ..., device_id: _Optional[int] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., src_num_blocks: _Optional[int] = ..., src_num_heads: _Optional[int] = ..., src_head_start: _Optional[int] = ...) -> None: ...

class PullKVResponse(_message.Message):
    __slots__ = ("bytes", "checksum", "descriptors")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    checksum: int
    descriptors: int
    def __init__(self, bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., descriptors: _Optional[int] = ...) -> None: ...
