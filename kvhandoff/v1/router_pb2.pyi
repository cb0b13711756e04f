from kvhandoff.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MoveRequest(_message.Message):
    __slots__ = ("request_id", "to_endpoint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TO_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    to_endpoint: str
    def __init__(self, request_id: _Optional[str] = ..., to_endpoint: _Optional[str] = ...) -> None: ...

class MoveResponse(_message.Message):
    __slots__ = ("from_endpoint", "to_endpoint")
    FROM_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TO_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    from_endpoint: str
    to_endpoint: str
    def __init__(self, from_endpoint: _Optional[str] = ..., to_endpoint: _Optional[str] = ...) -> None: ...

class Move(_message.Message):
    __slots__ = ("from_endpoint", "to_endpoint", "at_token", "num_imported_tokens", "num_computed_tokens", "reason", "pause_ms", "num_bytes_moved", "at_beam_step", "from_engine_id", "to_engine_id")
    FROM_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TO_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    AT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_IMPORTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PAUSE_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    AT_BEAM_STEP_FIELD_NUMBER: _ClassVar[int]
    FROM_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TO_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    from_endpoint: str
    to_endpoint: str
    at_token: int
    num_imported_tokens: int
    num_computed_tokens: int
    reason: str
    pause_ms: float
    num_bytes_moved: int
    at_beam_step: int
    from_engine_id: str
    to_engine_id: str
    def __init__(self, from_endpoint: _Optional[str] = ..., to_endpoint: _Optional[str] = ..., at_token: _Optional[int] = ..., num_imported_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., reason: _Optional[str] = ..., pause_ms: _Optional[float] = ..., num_bytes_moved: _Optional[int] = ..., at_beam_step: _Optional[int] = ..., from_engine_id: _Optional[str] = ..., to_engine_id: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("endpoint", "timeout_ms", "undo")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    UNDO_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    timeout_ms: int
    undo: bool
    def __init__(self, endpoint: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., undo: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("endpoint", "moved", "finished_in_place", "failed", "empty", "seconds")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    EMPTY_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    moved: int
    finished_in_place: int
    failed: int
    empty: bool
    seconds: float
    def __init__(self, endpoint: _Optional[str] = ..., moved: _Optional[int] = ..., finished_in_place: _Optional[int] = ..., failed: _Optional[int] = ..., empty: _Optional[bool] = ..., seconds: _Optional[float] = ...) -> None: ...

class ParentRequest(_message.Message):
    __slots__ = ("request_id", "prompt_text", "prompt_token_ids", "stage1", "timeout_ms", "model", "path", "adapter", "chunk_ids", "recompute_share")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STAGE1_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_IDS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_SHARE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_text: str
    prompt_token_ids: _common_pb2.TokenIds
    stage1: _common_pb2.Stage1Sampling
    timeout_ms: int
    model: str
    path: _common_pb2.Path
    adapter: str
    chunk_ids: _containers.RepeatedScalarFieldContainer[str]
    recompute_share: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_text: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., stage1: _Optional[_Union[_common_pb2.Stage1Sampling, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., model: _Optional[str] = ..., path: _Optional[_Union[_common_pb2.Path, str]] = ..., adapter: _Optional[str] = ..., chunk_ids: _Optional[_Iterable[str]] = ..., recompute_share: _Optional[float] = ...) -> None: ...

class Parent(_message.Message):
    __slots__ = ("parent_id", "prompt_token_ids", "thinking_token_ids", "thinking_text", "finish_reason", "held", "not_held_reason", "prefill_endpoint", "lease_expires_at", "stage1_ms", "model", "thinking_logprobs", "stage1_seed", "stage1_positional", "adapter", "approximate", "num_blended_tokens", "recomputed_share")
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    THINKING_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    THINKING_TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    NOT_HELD_REASON_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    STAGE1_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    THINKING_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STAGE1_SEED_FIELD_NUMBER: _ClassVar[int]
    STAGE1_POSITIONAL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    APPROXIMATE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLENDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_SHARE_FIELD_NUMBER: _ClassVar[int]
    parent_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    thinking_token_ids: _containers.RepeatedScalarFieldContainer[int]
    thinking_text: str
    finish_reason: str
    held: bool
    not_held_reason: str
    prefill_endpoint: str
    lease_expires_at: float
    stage1_ms: float
    model: str
    thinking_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    stage1_seed: int
    stage1_positional: bool
    adapter: str
    approximate: bool
    num_blended_tokens: int
    recomputed_share: float
    def __init__(self, parent_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., thinking_token_ids: _Optional[_Iterable[int]] = ..., thinking_text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., held: _Optional[bool] = ..., not_held_reason: _Optional[str] = ..., prefill_endpoint: _Optional[str] = ..., lease_expires_at: _Optional[float] = ..., stage1_ms: _Optional[float] = ..., model: _Optional[str] = ..., thinking_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., stage1_seed: _Optional[int] = ..., stage1_positional: _Optional[bool] = ..., adapter: _Optional[str] = ..., approximate: _Optional[bool] = ..., num_blended_tokens: _Optional[int] = ..., recomputed_share: _Optional[float] = ...) -> None: ...

class ParentEvent(_message.Message):
    __slots__ = ("stage1_tokens", "parent")
    STAGE1_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    stage1_tokens: _common_pb2.TokenIds
    parent: Parent
    def __init__(self, stage1_tokens: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., parent: _Optional[_Union[Parent, _Mapping]] = ...) -> None: ...

class ReleaseParentRequest(_message.Message):
    __slots__ = ("parent_id",)
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    parent_id: str
    def __init__(self, parent_id: _Optional[str] = ...) -> None: ...

class ReleaseParentResponse(_message.Message):
    __slots__ = ("parent_id", "hold_ended")
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    HOLD_ENDED_FIELD_NUMBER: _ClassVar[int]
    parent_id: str
    hold_ended: bool
    def __init__(self, parent_id: _Optional[str] = ..., hold_ended: _Optional[bool] = ...) -> None: ...

class ContinueRequest(_message.Message):
    __slots__ = ("request_id", "parent_id", "suffix_text", "suffix_token_ids", "beam", "strict", "timeout_ms", "model", "sampling", "fault", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_TEXT_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BEAM_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    parent_id: str
    suffix_text: str
    suffix_token_ids: _common_pb2.TokenIds
    beam: _common_pb2.BeamSearch
    strict: bool
    timeout_ms: int
    model: str
    sampling: _common_pb2.Stage1Sampling
    fault: str
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., parent_id: _Optional[str] = ..., suffix_text: _Optional[str] = ..., suffix_token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., beam: _Optional[_Union[_common_pb2.BeamSearch, _Mapping]] = ..., strict: _Optional[bool] = ..., timeout_ms: _Optional[int] = ..., model: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.Stage1Sampling, _Mapping]] = ..., fault: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_text", "prompt_token_ids", "stage1", "suffix_text", "suffix_token_ids", "beam", "path", "timeout_ms", "fault", "adapter", "chunk_ids", "recompute_share")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STAGE1_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_TEXT_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BEAM_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_IDS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_SHARE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_text: str
    prompt_token_ids: _common_pb2.TokenIds
    stage1: _common_pb2.Stage1Sampling
    suffix_text: str
    suffix_token_ids: _common_pb2.TokenIds
    beam: _common_pb2.BeamSearch
    path: _common_pb2.Path
    timeout_ms: int
    fault: str
    adapter: str
    chunk_ids: _containers.RepeatedScalarFieldContainer[str]
    recompute_share: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_text: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., stage1: _Optional[_Union[_common_pb2.Stage1Sampling, _Mapping]] = ..., suffix_text: _Optional[str] = ..., suffix_token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., beam: _Optional[_Union[_common_pb2.BeamSearch, _Mapping]] = ..., path: _Optional[_Union[_common_pb2.Path, str]] = ..., timeout_ms: _Optional[int] = ..., fault: _Optional[str] = ..., adapter: _Optional[str] = ..., chunk_ids: _Optional[_Iterable[str]] = ..., recompute_share: _Optional[float] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("stage1_ms", "stage2_first_step_ms", "stage2_ms", "total_ms", "router_overhead_ms")
    STAGE1_MS_FIELD_NUMBER: _ClassVar[int]
    STAGE2_FIRST_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    STAGE2_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    stage1_ms: float
    stage2_first_step_ms: float
    stage2_ms: float
    total_ms: float
    router_overhead_ms: float
    def __init__(self, stage1_ms: _Optional[float] = ..., stage2_first_step_ms: _Optional[float] = ..., stage2_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., router_overhead_ms: _Optional[float] = ...) -> None: ...

class HandoffStats(_message.Message):
    __slots__ = ("path", "prefill_endpoint", "decode_endpoint", "num_parent_tokens", "num_imported_tokens", "num_bytes_moved", "num_computed_tokens_first_step", "num_computed_tokens_total", "recomputed", "failed_decode_endpoint", "num_recomputed_beam_tokens", "handoff_failure", "num_found_on_d_tokens", "num_cached_prompt_tokens", "prefill_engine_id", "approximate", "num_blended_tokens", "recomputed_share", "decode_engine_id")
    PATH_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NUM_PARENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_IMPORTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    FAILED_DECODE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOMPUTED_BEAM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FAILURE_FIELD_NUMBER: _ClassVar[int]
    NUM_FOUND_ON_D_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    APPROXIMATE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLENDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_SHARE_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    path: _common_pb2.Path
    prefill_endpoint: str
    decode_endpoint: str
    num_parent_tokens: int
    num_imported_tokens: int
    num_bytes_moved: int
    num_computed_tokens_first_step: int
    num_computed_tokens_total: int
    recomputed: bool
    failed_decode_endpoint: str
    num_recomputed_beam_tokens: int
    handoff_failure: str
    num_found_on_d_tokens: int
    num_cached_prompt_tokens: int
    prefill_engine_id: str
    approximate: bool
    num_blended_tokens: int
    recomputed_share: float
    decode_engine_id: str
    def __init__(self, path: _Optional[_Union[_common_pb2.Path, str]] = ..., prefill_endpoint: _Optional[str] = ..., decode_endpoint: _Optional[str] = ..., num_parent_tokens: _Optional[int] = ..., num_imported_tokens: _Optional[int] = ..., num_bytes_moved: _Optional[int] = ..., num_computed_tokens_first_step: _Optional[int] = ..., num_computed_tokens_total: _Optional[int] = ..., recomputed: _Optional[bool] = ..., failed_decode_endpoint: _Optional[str] = ..., num_recomputed_beam_tokens: _Optional[int] = ..., handoff_failure: _Optional[str] = ..., num_found_on_d_tokens: _Optional[int] = ..., num_cached_prompt_tokens: _Optional[int] = ..., prefill_engine_id: _Optional[str] = ..., approximate: _Optional[bool] = ..., num_blended_tokens: _Optional[int] = ..., recomputed_share: _Optional[float] = ..., decode_engine_id: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "thinking_token_ids", "thinking_text", "stage1_finish_reason", "suffix_token_ids", "beams", "timings", "stats", "prompt_token_ids", "parent_id", "stage1_seed", "stage1_positional", "moves", "num_beams_short", "num_dropped_beams")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    THINKING_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    THINKING_TEXT_FIELD_NUMBER: _ClassVar[int]
    STAGE1_FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BEAMS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE1_SEED_FIELD_NUMBER: _ClassVar[int]
    STAGE1_POSITIONAL_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    NUM_BEAMS_SHORT_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_BEAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    thinking_token_ids: _containers.RepeatedScalarFieldContainer[int]
    thinking_text: str
    stage1_finish_reason: str
    suffix_token_ids: _containers.RepeatedScalarFieldContainer[int]
    beams: _containers.RepeatedCompositeFieldContainer[_common_pb2.Beam]
    timings: Timings
    stats: HandoffStats
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    parent_id: str
    stage1_seed: int
    stage1_positional: bool
    moves: _containers.RepeatedCompositeFieldContainer[Move]
    num_beams_short: int
    num_dropped_beams: int
    def __init__(self, request_id: _Optional[str] = ..., thinking_token_ids: _Optional[_Iterable[int]] = ..., thinking_text: _Optional[str] = ..., stage1_finish_reason: _Optional[str] = ..., suffix_token_ids: _Optional[_Iterable[int]] = ..., beams: _Optional[_Iterable[_Union[_common_pb2.Beam, _Mapping]]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., stats: _Optional[_Union[HandoffStats, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., parent_id: _Optional[str] = ..., stage1_seed: _Optional[int] = ..., stage1_positional: _Optional[bool] = ..., moves: _Optional[_Iterable[_Union[Move, _Mapping]]] = ..., num_beams_short: _Optional[int] = ..., num_dropped_beams: _Optional[int] = ...) -> None: ...

class GenerateStreamEvent(_message.Message):
    __slots__ = ("stage1_tokens", "result")
    STAGE1_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    stage1_tokens: _common_pb2.TokenIds
    result: GenerateResponse
    def __init__(self, stage1_tokens: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., result: _Optional[_Union[GenerateResponse, _Mapping]] = ...) -> None: ...

class ChunkRequest(_message.Message):
    __slots__ = ("chunk_id", "text", "token_ids", "under", "adapter", "fault")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    UNDER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    chunk_id: str
    text: str
    token_ids: _common_pb2.TokenIds
    under: str
    adapter: str
    fault: str
    def __init__(self, chunk_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., under: _Optional[str] = ..., adapter: _Optional[str] = ..., fault: _Optional[str] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("chunk_id", "under", "token_ids", "num_chain_tokens", "num_blocks", "prefill_endpoint", "adapter", "uses", "last_used", "prefill_ms", "num_cached_tokens")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    UNDER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHAIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    USES_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    chunk_id: str
    under: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_chain_tokens: int
    num_blocks: int
    prefill_endpoint: str
    adapter: str
    uses: int
    last_used: float
    prefill_ms: float
    num_cached_tokens: int
    def __init__(self, chunk_id: _Optional[str] = ..., under: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_chain_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., prefill_endpoint: _Optional[str] = ..., adapter: _Optional[str] = ..., uses: _Optional[int] = ..., last_used: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class ListChunksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListChunksResponse(_message.Message):
    __slots__ = ("chunks", "held_blocks", "share_blocks", "evictions")
    class HeldBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ShareBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    held_blocks: _containers.ScalarMap[str, int]
    share_blocks: _containers.ScalarMap[str, int]
    evictions: int
    def __init__(self, chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., held_blocks: _Optional[_Mapping[str, int]] = ..., share_blocks: _Optional[_Mapping[str, int]] = ..., evictions: _Optional[int] = ...) -> None: ...

class DeleteChunkRequest(_message.Message):
    __slots__ = ("chunk_id",)
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    chunk_id: str
    def __init__(self, chunk_id: _Optional[str] = ...) -> None: ...

class DeleteChunkResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, deleted: _Optional[_Iterable[str]] = ...) -> None: ...
