"""The handoff: what P exports when stage 1 ends, and the checks D makes before importing.

A handoff travels inside vLLM's ``kv_transfer_params``. The stock NIXL keys
(``remote_block_ids``, ``remote_engine_id``, ...) stay where vLLM's NIXL connector
expects them; our own fields live under ``KEY`` and are typed by :class:`Handoff`.

Token ranges (N parent tokens, S suffix tokens, block size B)::

    | prompt | stage-1 tokens ........ last |  suffix (S)  |
    |<-------- parent: N tokens ---------->|
    |<--- computed on P: N-1 tokens --->|      (the last sampled token has no KV yet)
    |<----- imported by D: N-1 ------->|<- computed on D: S+1 ->|

P exports ``cdiv(N-1, B)`` blocks (the last one partial). D imports exactly the tokens
P computed, never its own suffix, so D computes ``S + 1`` tokens for the import step.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from connector.params import FAULT_KEY, KEY
from kvhandoff.types import BeamParams, HandoffError

#: Bumped whenever the meaning of a handoff field changes. P and D must agree.
#: 2: the adapter's identity (``adapter``, ``adapter_digest``); 3: the cache salt; 4: P's
#: pool size (``num_pool_blocks``) and a model fingerprint over the weights and tokenizer
#: files, not only the config (``kvhandoff.model``).
PROTOCOL_VERSION = 4

#: A beam slot made in the engine from its group's leader (``decode_engine.beam_slots``):
#: ``<leader's request id>`` + this + its index. The front end never sees its outputs.
CLONE_SEP = ".slot"


def is_made_slot(request_id: str) -> bool:
    """Whether ``request_id`` names a slot made in the engine (``CLONE_SEP`` + index)."""
    head, sep, index = request_id.rpartition(CLONE_SEP)
    return bool(head and sep and index.isdigit())


#: Reads are refused this long before the lease ends: the READ itself, the clock
#: difference between hosts and a stalled step must all fit in it.
DEFAULT_LEASE_SAFETY_MARGIN_S = 2.0


#: Longest string field a handoff may carry (ids, digests, adapter names, salts).
MAX_STR = 512
#: A field's declared type -> the Python types its value may have.
_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "str": (str,), "float": (int, float)}


def _malformed(field: str, why: str) -> HandoffError:
    return HandoffError("malformed", f"malformed handoff: {field} {why}")


def kv_bytes_per_block(kv_cache_config: Any) -> int:
    """Bytes one logical block holds across all layers (K and V), from vLLM's
    ``KVCacheConfig``: a handoff's ``kv_bytes_per_block``."""
    return sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names)
               for g in kv_cache_config.kv_cache_groups)


def token_digest(token_ids: list[int] | tuple[int, ...]) -> str:
    """SHA-256 over the token ids as little-endian int64: what D checks its prompt with."""
    data = np.asarray(token_ids, dtype="<i8").tobytes()
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True)
class Handoff:
    """A finished stage-1 request's exported state, as P describes it."""

    protocol_version: int
    model_fingerprint: str
    #: P's engine id and the engine-internal request id that holds the blocks.
    engine_id: str
    request_id: str
    #: Parent = prompt + stage-1 tokens; P computed KV for all but the last one.
    num_parent_tokens: int
    num_computed_tokens: int
    token_digest: str
    block_size: int
    num_blocks: int
    kv_bytes_per_block: int
    #: Wall-clock export time and lease end (seconds since the epoch, P's clock).
    exported_at: float
    #: Seconds since the epoch on P's clock; D checks it on its own clock with
    #: ``lease_safety_margin_s`` to spare (hosts' clocks may differ by that much).
    lease_expires_at: float
    #: The LoRA adapter the KV was computed under ("": none) and a digest of its files
    #: (``connector.adapters``): D imports it only into a request under the same one.
    adapter: str
    adapter_digest: str
    #: The cache salt P's blocks hash under ("": none): an approximate composition's
    #: (``connector.blend``). D imports it only into a request under the same salt, so
    #: its prefix cache never serves the KV to another.
    cache_salt: str
    #: P's KV pool in blocks (vLLM's null block included): every id in the handoff is
    #: below it (``connector.field_checks``).
    num_pool_blocks: int

    def __post_init__(self) -> None:
        if self.num_computed_tokens != self.num_parent_tokens - 1:
            raise ValueError(
                f"num_computed_tokens={self.num_computed_tokens} must be "
                f"num_parent_tokens-1={self.num_parent_tokens - 1}"
            )

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.kv_bytes_per_block

    def lease_remaining_s(self, now: float | None = None) -> float:
        return self.lease_expires_at - (time.time() if now is None else now)

    # ---- kv_transfer_params <-> Handoff -------------------------------------------------
    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> Handoff:
        """Parse the handoff out of P's returned ``kv_transfer_params``."""
        if not params or KEY not in params:
            raise HandoffError("missing", "kv_transfer_params carry no kvhandoff handoff")
        fields = params[KEY]
        if not isinstance(fields, dict) or "malformed" in fields:
            raise HandoffError("malformed", "kvhandoff handoff is not a mapping")
        if not can_reach_p(params):
            raise HandoffError("malformed", "handoff lacks well-formed NIXL transport fields")
        version = fields.get("protocol_version")
        if version != PROTOCOL_VERSION:
            raise HandoffError(
                "protocol",
                f"handoff protocol version {version!r}, this engine speaks "
                f"{PROTOCOL_VERSION}",
            )
        missing = [k for k in cls.__dataclass_fields__ if k not in fields]
        if missing:
            raise HandoffError("malformed", f"malformed handoff: no {', '.join(missing)}")
        cls.check_types(fields)
        try:
            return cls(**{k: fields[k] for k in cls.__dataclass_fields__})
        except (TypeError, ValueError) as e:
            raise HandoffError("malformed", f"malformed handoff: {e}") from e

    @classmethod
    def check_types(cls, fields: Mapping[str, Any]) -> None:
        """Each field in ``fields`` has its declared type (``bool`` is not an ``int``),
        strings at most :data:`MAX_STR` characters, numbers finite and not negative;
        raises :class:`HandoffError` ("malformed") naming the first that has not. The
        rest of a handoff's checks: ``connector.field_checks``."""
        for name, spec in cls.__dataclass_fields__.items():
            value = fields.get(name)
            kinds = _TYPES[str(spec.type)]
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise _malformed(name, f"is a {type(value).__name__}, not {spec.type}")
            if isinstance(value, str) and len(value) > MAX_STR:
                raise _malformed(name, f"is {len(value)} characters long (at most {MAX_STR})")
            if isinstance(value, float) and not math.isfinite(value):
                raise _malformed(name, f"is {value}")
            if not isinstance(value, str) and value < 0:
                raise _malformed(name, f"is negative ({value})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- the wire format: the only definition of a handoff's field lists ----------------
#: The stock NIXL fields D needs to reach P (to READ, or to tell P to release), with
#: their types: a handoff without them well-formed never reaches vLLM's connector.
REQUIRED_TRANSPORT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "remote_engine_id": str,
    "remote_request_id": str,
    "remote_block_ids": (list, tuple),
    "remote_host": str,
    "remote_port": int,
    "tp_size": int,
}
#: Every stock NIXL field a handoff carries (beside ``remote_num_tokens``, which D
#: derives from ``num_computed_tokens``).
TRANSPORT_FIELDS = (*REQUIRED_TRANSPORT_FIELDS, "dcp_size", "pp_size",
                    "remote_blocks_expiry_time")
#: Our fields under ``KEY``: the :class:`Handoff`, the D it is addressed to, and P's
#: signature over :data:`SIGNED_FIELDS` (``connector.signing``).
HANDOFF_FIELDS = (*Handoff.__dataclass_fields__, "target_engine_id", "signature")
#: What a signature covers: (transport fields, handoff fields).
SIGNED_FIELDS = (
    tuple(REQUIRED_TRANSPORT_FIELDS),
    tuple(f for f in HANDOFF_FIELDS if f not in ("exported_at", "kv_bytes_per_block",
                                                  "signature")),
)


def can_reach_p(params: dict[str, Any]) -> bool:
    """Whether the stock NIXL fields are well-formed enough to contact P. A handoff
    without them must never reach vLLM's connector: it indexes them unchecked."""
    return all(isinstance(params.get(k), t) for k, t in REQUIRED_TRANSPORT_FIELDS.items()) and all(
        isinstance(group, (list, tuple)) and all(isinstance(b, int) for b in group)
        for group in params["remote_block_ids"]
    )


@dataclass(frozen=True, slots=True)
class ImportRequest:
    """What D's step-0 request asks of D's scheduler, typed from D's engine to its
    scheduler: P's export as it arrived (wire form: the scheduler, the one authority on
    what D accepts, parses and checks it), the beam fan-out D must hold, the blocks the
    stage 2s already running on D may still grow into, and, for the harness's negative
    controls only, a fault to inject."""

    export: Mapping[str, Any]
    beam_width: int
    beam_max_tokens: int
    reserved_blocks: int = 0
    fault: str | None = None
    #: The beams start at the parent itself (a constrained search: ``kvhandoff.budget``).
    beam_from_parent: bool = False

    @classmethod
    def for_beams(cls, export: Mapping[str, Any], beam: BeamParams,
                  fault: str | None = None) -> ImportRequest:
        """What a stage 2 with ``beam`` asks of D for P's ``export`` (D's engine adds the
        blocks its running stage 2s reserve)."""
        return cls(export, beam_width=beam.beam_width, beam_max_tokens=beam.max_tokens,
                   fault=fault, beam_from_parent=beam.catalog is not None)

    def to_params(self) -> dict[str, Any]:
        """The request's ``kv_transfer_params`` (the one place they are built): a fresh
        copy each time, since vLLM's connector mutates them. P's
        ``remote_prefill_cached_tokens`` is left out: given it, vLLM 0.32 reports P's
        prefix hits as D's ``num_cached_tokens``, and D's first step would then count
        the tokens it imported as computed."""
        params = {k: v for k, v in self.export.items()
                  if k not in (KEY, "remote_prefill_cached_tokens")}
        fields = self.export.get(KEY)
        if fields is not None:
            params[KEY] = dict(fields) if isinstance(fields, dict) else {"malformed": fields}
            params[KEY].update(beam_width=self.beam_width,
                               beam_max_tokens=self.beam_max_tokens,
                               beam_from_parent=self.beam_from_parent,
                               reserved_blocks=self.reserved_blocks)
        params["do_remote_prefill"] = True
        params["do_remote_decode"] = False
        if self.fault is not None:
            params[FAULT_KEY] = self.fault
        return params

    @classmethod
    def parse(cls, params: dict[str, Any]) -> tuple[Handoff, ImportRequest]:
        """D's scheduler: the handoff and the request, or :class:`HandoffError`."""
        handoff = Handoff.from_params(params)
        fields = params[KEY]
        try:
            return handoff, cls(export=params,
                                beam_width=int(fields.get("beam_width", 1)),
                                beam_max_tokens=int(fields.get("beam_max_tokens", 1)),
                                reserved_blocks=int(fields.get("reserved_blocks", 0)),
                                fault=params.get(FAULT_KEY),
                                beam_from_parent=bool(fields.get("beam_from_parent", False)))
        except (TypeError, ValueError, OverflowError) as e:
            raise HandoffError("malformed", f"malformed import request: {e}") from e


def validate_import(
    handoff: Handoff,
    prompt_token_ids: list[int],
    *,
    model_fingerprint: str,
    now: float | None = None,
    safety_margin_s: float = DEFAULT_LEASE_SAFETY_MARGIN_S,
) -> None:
    """Everything D checks before any READ. Raises :class:`HandoffError`."""
    if handoff.model_fingerprint != model_fingerprint:
        raise HandoffError(
            "model",
            f"handoff from model {handoff.model_fingerprint}, this engine serves "
            f"{model_fingerprint}",
        )
    n = handoff.num_parent_tokens
    if len(prompt_token_ids) < n:
        raise HandoffError(
            "digest",
            f"prompt has {len(prompt_token_ids)} tokens, fewer than the "
            f"{n}-token parent it continues",
        )
    if token_digest(prompt_token_ids[:n]) != handoff.token_digest:
        raise HandoffError(
            "digest",
            f"the first {n} prompt tokens do not match the parent's token digest",
        )
    remaining = handoff.lease_remaining_s(now)
    if remaining < safety_margin_s:
        raise HandoffError(
            "expired",
            f"handoff lease expired or about to ({remaining:.2f}s left, need "
            f">= {safety_margin_s:.2f}s)",
        )
