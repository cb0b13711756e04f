"""One beam group's state (:class:`Group`), the arithmetic of its first step
(:func:`shared_from_free`, :func:`mid_prompt`, :func:`has_room`) and its copies after a
fork (:func:`fork_copies`), for ``decode_engine.beam_slots``, which owns
the groups."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: How long a group's first slot waits for the others.
START_TIMEOUT_S = 30.0


@dataclass(slots=True)
class Group:
    members: int  # its slots
    first_block: int  # index of the first block each slot holds alone
    tokens_each: int  # tokens a slot computes at its first step (worst case)
    own_blocks: int  # blocks a slot holds alone at its first step
    #: Prompt tokens before the slots' own (the search's shared prefix: stage 2's prompt).
    shared_tokens: int = 0
    first_computed: int = 0  # tokens its slots computed at their first step
    slots: dict[int, str] = field(default_factory=dict)  # slot -> request id
    started: bool = False
    step: int = 0  # beam steps decided so far
    parents: list[int] | None = None  # the last step's, until copied
    result: dict[str, Any] | None = None
    error: str | None = None
    #: The refusal's reason (kvhandoff.errors): "beam_room" when the running requests
    #: kept the group's room past START_TIMEOUT_S (the client may retry), else a failure.
    reason: str = "beam_group"
    reported: bool = False  # the error was sent to the slots
    # Per beam step: the processor's milliseconds, the blocks copied after it.
    select_ms: list[float] = field(default_factory=list)
    copied: list[int] = field(default_factory=list)
    arrived_at: float = field(default_factory=time.monotonic)  # its first slot
    #: Asked to stop to move (``decode_engine.search_stops``): the engine id its
    #: handoff goes to ("": the group's own default); None: not asked.
    stop_to: str | None = None
    #: A group whose leader came with its search's step 0 (``SlotSpec.after``): step
    #: 0's group, until the leader is filled in from its result (None: filled, or sent
    #: filled).
    after: str | None = None
    #: A one-slot group (a step 0): whether its request is kept for its slots to fork
    #: from (``connector.beam_fork``), read when it decided.
    kept: bool = False

    def ids(self) -> list[str]:
        return [self.slots[i] for i in sorted(self.slots)]


def mid_prompt(request: Request | None) -> bool:
    """Whether ``request``'s last scheduled step left part of its prompt to compute."""
    return request is not None and request.num_computed_tokens < request.num_prompt_tokens


def shared_from_free(pool: Any, leader: Request, num_blocks: int) -> int:
    """Of the first ``num_blocks`` blocks of ``leader``'s prompt (the group's shared
    prefix), those its first step takes from the pool's free count: not cached (the
    first slot computes it; the others hit it), or cached with no request holding it."""
    hashes = leader.block_hashes[:num_blocks]
    taken = num_blocks - len(hashes)
    for block_hash in hashes:
        cached = pool.get_cached_block(block_hash, [0])
        taken += cached is None or cached[0].ref_cnt == 0
    return taken


def has_room(scheduler: Any, seqs: int, tokens: int) -> bool:
    """Whether ``seqs`` more requests computing ``tokens`` fit beside the running
    ones (each computes at least one token) this step."""
    running = scheduler.running
    running_tokens = sum(max(r.num_tokens - r.num_computed_tokens, 1) for r in running)
    return (len(running) + seqs <= scheduler.max_num_active_reqs
            and running_tokens + tokens <= scheduler.max_num_scheduled_tokens)


def fork_copies(group: Group, blocks: list[list[int]], pool: Any) -> list[Any]:
    """The block copies (vLLM's ``KVCacheBlockCopy``) that make each slot of ``group``
    (``blocks``: each slot's own blocks) a copy of its new beam's parent slot, after a
    step that forked; none, and the group's error set, where a slot's own blocks do not
    line up with its parent's or are shared."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    assert group.parents is not None
    copies = []
    for child, parent in enumerate(group.parents):
        if child == parent:
            continue
        src, dst = blocks[parent], blocks[child]
        if len(src) != len(dst) or not dst:
            group.error = (f"slot {child} and its parent slot {parent} hold "
                           f"{len(dst)} and {len(src)} blocks of their own")
            return []
        if any(pool.blocks[b].ref_cnt != 1 for b in dst):
            group.error = f"slot {child}'s own blocks are shared"
            return []
        copies.extend(KVCacheBlockCopy(s, d) for s, d in zip(src, dst))
    return copies
