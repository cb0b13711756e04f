from kvhandoff.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Stage1Request(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "export", "target_engine_id", "hold", "hold_s", "handoff", "fault", "adapter", "pin", "blend")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EXPORT_FIELD_NUMBER: _ClassVar[int]
    TARGET_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    BLEND_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.Stage1Sampling
    export: bool
    target_engine_id: str
    hold: bool
    hold_s: float
    handoff: _common_pb2.Handoff
    fault: str
    adapter: str
    pin: bool
    blend: Blend
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.Stage1Sampling, _Mapping]] = ..., export: _Optional[bool] = ..., target_engine_id: _Optional[str] = ..., hold: _Optional[bool] = ..., hold_s: _Optional[float] = ..., handoff: _Optional[_Union[_common_pb2.Handoff, _Mapping]] = ..., fault: _Optional[str] = ..., adapter: _Optional[str] = ..., pin: _Optional[bool] = ..., blend: _Optional[_Union[Blend, _Mapping]] = ...) -> None: ...

class Blend(_message.Message):
    __slots__ = ("parts", "num_loaded")
    PARTS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[BlendPart]
    num_loaded: int
    def __init__(self, parts: _Optional[_Iterable[_Union[BlendPart, _Mapping]]] = ..., num_loaded: _Optional[int] = ...) -> None: ...

class BlendPart(_message.Message):
    __slots__ = ("source", "source_start", "length", "position")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_START_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    source: str
    source_start: int
    length: int
    position: int
    def __init__(self, source: _Optional[str] = ..., source_start: _Optional[int] = ..., length: _Optional[int] = ..., position: _Optional[int] = ...) -> None: ...

class Stage1Event(_message.Message):
    __slots__ = ("new_token_ids", "finish_reason", "handoff", "held_until", "logprobs", "num_imported_tokens", "num_imported_bytes", "num_computed_tokens", "engine_id", "num_blended_tokens", "blend_refused")
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    HELD_UNTIL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_IMPORTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_IMPORTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLENDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLEND_REFUSED_FIELD_NUMBER: _ClassVar[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    handoff: _common_pb2.Handoff
    held_until: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    num_imported_tokens: int
    num_imported_bytes: int
    num_computed_tokens: int
    engine_id: str
    num_blended_tokens: int
    blend_refused: str
    def __init__(self, new_token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., handoff: _Optional[_Union[_common_pb2.Handoff, _Mapping]] = ..., held_until: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., num_imported_tokens: _Optional[int] = ..., num_imported_bytes: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., engine_id: _Optional[str] = ..., num_blended_tokens: _Optional[int] = ..., blend_refused: _Optional[str] = ...) -> None: ...

class Stage2Request(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "beam", "handoff", "held_parent", "sampling", "fault", "adapter", "affinity", "resume")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BEAM_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    HELD_PARENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    AFFINITY_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    beam: _common_pb2.BeamSearch
    handoff: _common_pb2.Handoff
    held_parent: str
    sampling: _common_pb2.Stage1Sampling
    fault: str
    adapter: str
    affinity: str
    resume: StoppedSearch
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., beam: _Optional[_Union[_common_pb2.BeamSearch, _Mapping]] = ..., handoff: _Optional[_Union[_common_pb2.Handoff, _Mapping]] = ..., held_parent: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.Stage1Sampling, _Mapping]] = ..., fault: _Optional[str] = ..., adapter: _Optional[str] = ..., affinity: _Optional[str] = ..., resume: _Optional[_Union[StoppedSearch, _Mapping]] = ...) -> None: ...

class StoppedSearch(_message.Message):
    __slots__ = ("prompt_token_ids", "live", "completed", "steps_done", "members", "export")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    EXPORT_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    live: _containers.RepeatedCompositeFieldContainer[_common_pb2.Beam]
    completed: _containers.RepeatedCompositeFieldContainer[_common_pb2.Beam]
    steps_done: int
    members: int
    export: _common_pb2.Handoff
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., live: _Optional[_Iterable[_Union[_common_pb2.Beam, _Mapping]]] = ..., completed: _Optional[_Iterable[_Union[_common_pb2.Beam, _Mapping]]] = ..., steps_done: _Optional[int] = ..., members: _Optional[int] = ..., export: _Optional[_Union[_common_pb2.Handoff, _Mapping]] = ...) -> None: ...

class Stage2Event(_message.Message):
    __slots__ = ("new_token_ids", "result")
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    result: Stage2Response
    def __init__(self, new_token_ids: _Optional[_Iterable[int]] = ..., result: _Optional[_Union[Stage2Response, _Mapping]] = ...) -> None: ...

class Stage2Response(_message.Message):
    __slots__ = ("beams", "num_imported_tokens", "num_imported_bytes", "num_computed_tokens_first_step", "num_computed_tokens_total", "first_step_ms", "total_ms", "num_recomputed_beam_tokens", "num_beams_short", "num_dropped_beams", "engine_id", "stopped")
    BEAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_IMPORTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_IMPORTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOMPUTED_BEAM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BEAMS_SHORT_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_BEAMS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    beams: _containers.RepeatedCompositeFieldContainer[_common_pb2.Beam]
    num_imported_tokens: int
    num_imported_bytes: int
    num_computed_tokens_first_step: int
    num_computed_tokens_total: int
    first_step_ms: float
    total_ms: float
    num_recomputed_beam_tokens: int
    num_beams_short: int
    num_dropped_beams: int
    engine_id: str
    stopped: StoppedSearch
    def __init__(self, beams: _Optional[_Iterable[_Union[_common_pb2.Beam, _Mapping]]] = ..., num_imported_tokens: _Optional[int] = ..., num_imported_bytes: _Optional[int] = ..., num_computed_tokens_first_step: _Optional[int] = ..., num_computed_tokens_total: _Optional[int] = ..., first_step_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., num_recomputed_beam_tokens: _Optional[int] = ..., num_beams_short: _Optional[int] = ..., num_dropped_beams: _Optional[int] = ..., engine_id: _Optional[str] = ..., stopped: _Optional[_Union[StoppedSearch, _Mapping]] = ...) -> None: ...

class CapacityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("role", "engine_id", "num_total_blocks", "num_free_blocks", "block_size", "num_running_reqs", "num_waiting_reqs", "max_model_len", "max_beam_width", "vocab_size", "model_fingerprint", "handoff_target", "num_reserved_blocks", "beam_fork", "catalogs", "kv_events_endpoint", "kv_events_replay_endpoint", "catalog_widths", "adapters", "kv_events_curve")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_TARGET_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BEAM_FORK_FIELD_NUMBER: _ClassVar[int]
    CATALOGS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CATALOG_WIDTHS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_CURVE_FIELD_NUMBER: _ClassVar[int]
    role: str
    engine_id: str
    num_total_blocks: int
    num_free_blocks: int
    block_size: int
    num_running_reqs: int
    num_waiting_reqs: int
    max_model_len: int
    max_beam_width: int
    vocab_size: int
    model_fingerprint: str
    handoff_target: str
    num_reserved_blocks: int
    beam_fork: bool
    catalogs: _containers.RepeatedScalarFieldContainer[str]
    kv_events_endpoint: str
    kv_events_replay_endpoint: str
    catalog_widths: _containers.RepeatedCompositeFieldContainer[CatalogWidths]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    kv_events_curve: bool
    def __init__(self, role: _Optional[str] = ..., engine_id: _Optional[str] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_running_reqs: _Optional[int] = ..., num_waiting_reqs: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_beam_width: _Optional[int] = ..., vocab_size: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., handoff_target: _Optional[str] = ..., num_reserved_blocks: _Optional[int] = ..., beam_fork: _Optional[bool] = ..., catalogs: _Optional[_Iterable[str]] = ..., kv_events_endpoint: _Optional[str] = ..., kv_events_replay_endpoint: _Optional[str] = ..., catalog_widths: _Optional[_Iterable[_Union[CatalogWidths, _Mapping]]] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., kv_events_curve: _Optional[bool] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: str
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class CatalogWidths(_message.Message):
    __slots__ = ("name", "nodes_at_depth")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NODES_AT_DEPTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    nodes_at_depth: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., nodes_at_depth: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids", "engine_id", "prefixes")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    engine_id: str
    prefixes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., engine_id: _Optional[str] = ..., prefixes: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("request_ids", "target_engine_id", "engine_id")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    target_engine_id: str
    engine_id: str
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., target_engine_id: _Optional[str] = ..., engine_id: _Optional[str] = ...) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
