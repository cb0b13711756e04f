from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Path(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PATH_AUTO: _ClassVar[Path]
    PATH_HANDOFF: _ClassVar[Path]
    PATH_COLOCATED: _ClassVar[Path]
PATH_AUTO: Path
PATH_HANDOFF: Path
PATH_COLOCATED: Path

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Stage1Sampling(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "min_tokens", "min_p", "positional", "logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    POSITIONAL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    min_p: float
    positional: bool
    logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., min_p: _Optional[float] = ..., positional: _Optional[bool] = ..., logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class BeamSearch(_message.Message):
    __slots__ = ("beam_width", "max_tokens", "length_penalty", "catalog")
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    CATALOG_FIELD_NUMBER: _ClassVar[int]
    beam_width: int
    max_tokens: int
    length_penalty: float
    catalog: str
    def __init__(self, beam_width: _Optional[int] = ..., max_tokens: _Optional[int] = ..., length_penalty: _Optional[float] = ..., catalog: _Optional[str] = ...) -> None: ...

class Beam(_message.Message):
    __slots__ = ("token_ids", "text", "cum_logprob", "finish_reason")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CUM_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    cum_logprob: float
    finish_reason: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., cum_logprob: _Optional[float] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ("protocol_version", "model_fingerprint", "engine_id", "request_id", "num_parent_tokens", "num_computed_tokens", "token_digest", "block_size", "num_blocks", "kv_bytes_per_block", "exported_at", "lease_expires_at", "remote_host", "remote_port", "remote_block_ids", "tp_size", "dcp_size", "pp_size", "remote_blocks_expiry_time", "target_engine_id", "signature", "adapter", "adapter_digest", "cache_salt", "num_pool_blocks")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PARENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    EXPORTED_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HOST_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PORT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DCP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_EXPIRY_TIME_FIELD_NUMBER: _ClassVar[int]
    TARGET_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    NUM_POOL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model_fingerprint: str
    engine_id: str
    request_id: str
    num_parent_tokens: int
    num_computed_tokens: int
    token_digest: str
    block_size: int
    num_blocks: int
    kv_bytes_per_block: int
    exported_at: float
    lease_expires_at: float
    remote_host: str
    remote_port: int
    remote_block_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    tp_size: int
    dcp_size: int
    pp_size: int
    remote_blocks_expiry_time: float
    target_engine_id: str
    signature: str
    adapter: str
    adapter_digest: str
    cache_salt: str
    num_pool_blocks: int
    def __init__(self, protocol_version: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., num_parent_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., token_digest: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., kv_bytes_per_block: _Optional[int] = ..., exported_at: _Optional[float] = ..., lease_expires_at: _Optional[float] = ..., remote_host: _Optional[str] = ..., remote_port: _Optional[int] = ..., remote_block_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., tp_size: _Optional[int] = ..., dcp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., remote_blocks_expiry_time: _Optional[float] = ..., target_engine_id: _Optional[str] = ..., signature: _Optional[str] = ..., adapter: _Optional[str] = ..., adapter_digest: _Optional[str] = ..., cache_salt: _Optional[str] = ..., num_pool_blocks: _Optional[int] = ...) -> None: ...
