"""The benchmark's data: its configuration, the modes it compares, one sample, and the
error a measurement that is not what it claims raises. The measuring modules and the
report both import this module; it imports none of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: The modes each prompt runs, in this order before rotation (``tools.bench.modes``).
MODES = ("text_roundtrip", "colocated", "handoff", "vllm_beam_search")


@dataclass
class BenchConfig:
    model: str | None = "bench"
    prompt_tokens: int = 500
    stage1_tokens: int = 200
    beam_width: int = 32
    beam_tokens: int = 3
    requests: int = 8
    concurrency: tuple[int, ...] = (1, 4, 16)
    #: Modes run at concurrency above 1 (the slow references are measured at 1).
    concurrent_modes: tuple[str, ...] = ("colocated", "handoff")
    sweep: tuple[int, ...] = (256, 1024, 2048, 4096)
    sweep_repeats: int = 3
    #: Stage-2 floor grid: beam widths x beam tokens, ``floor_repeats`` samples each.
    floor_widths: tuple[int, ...] = (4, 16, 32)
    floor_tokens: tuple[int, ...] = (3, 8)
    floor_repeats: int = 2
    #: ``--beams``: cold handoffs (and floors) per (W, T); the medians are reported.
    beam_repeats: int = 3
    #: Seconds over which the engines' CPU is measured idle and holding an export.
    idle_s: float = 10.0
    seed: int = 0
    nixl_sizes_mib: tuple[int, ...] = (32, 128, 512)
    #: Requests per concurrency level = level x rounds.
    rounds: int = 2
    #: Requests sent both through the router and as direct engine calls (0: skip).
    router_requests: int = 8

    @classmethod
    def quick(cls, **kw: Any) -> BenchConfig:
        base = dict(requests=2, stage1_tokens=64, concurrency=(1, 4), sweep=(256, 1024),
                    floor_repeats=1, nixl_sizes_mib=(32,), rounds=1, router_requests=3)
        return cls(**{**base, **kw})


@dataclass
class Sample:
    """One two-stage request in one mode."""

    mode: str
    stage1_tokens: int
    parent_tokens: int
    stage2_first_beam_ms: float
    stage2_total_ms: float
    end_to_end_ms: float
    computed_tokens_d: int
    #: Bytes NIXL read for this request (its telemetry), and in how many descriptors.
    kv_bytes: int = 0
    transfer_ms: float | None = None
    descriptors: int = 0
    beams: list[list[int]] = field(default_factory=list)
    #: Tokens computed for the first beam step (output-reported; None for vLLM's search).
    computed_first_step: int | None = None
    suffix_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    #: Handoff only: D's prefix cache before the import ("cold": emptied; "warm": it
    #: holds the prompt), and the import's prompt tokens read from P vs found on D.
    d_cache: str | None = None
    tokens_read: int = 0
    tokens_found: int = 0
    kv_bytes_per_block: int = 0
    block_size: int = 1
    #: Prefix-cache (hits, queried tokens) during the sample, per engine ("p", "d").
    prefix_cache: dict[str, tuple[int, int]] = field(default_factory=dict)
    stage2_prompt: list[int] = field(default_factory=list, repr=False)


class BenchError(RuntimeError):
    """A measurement that does not describe what it claims (raised, never reported)."""
