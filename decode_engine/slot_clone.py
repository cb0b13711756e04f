"""A beam group's slots made in the engine from its leader (``decode_engine.beam_slots``):
each a vLLM ``Request`` over the leader's prompt with its own last tokens, its own slot
parameters, and the leader's block hashes wherever the two prompts agree."""

from __future__ import annotations

import copy
import hashlib
from typing import TYPE_CHECKING, Any

from connector.handoff import CLONE_SEP
from connector.params import SLOT_KEY
from decode_engine.slot_spec import CloneTail, SlotSpec

if TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.v1.request import Request


def clone_slot(leader: Request, spec: SlotSpec, slot: int, tail: CloneTail, cum: float,
               hasher: Callable[[Request], list[Any]] | None,
               hash_block_size: int) -> Request:
    """Slot ``slot`` of the leader's group: the leader's prompt with its own last
    ``spec.tail`` tokens (``tail``: one token, or a tuple of ``spec.tail``; None: the
    leader's prompt as it is), its own slot parameters; its outputs go to a client that
    never asked for them and drops them. ``hasher``: vLLM's block hasher (None: no
    prefix caching)."""
    from vllm.v1.request import Request

    params = leader.sampling_params
    assert params is not None and params.extra_args is not None
    prompt = list(leader.prompt_token_ids or [])
    if isinstance(tail, tuple):
        prompt[-len(tail):] = tail
    elif tail is not None:
        prompt[-1] = int(tail)
    # Its own dicts one level down (its beam parameters are changed per slot); the
    # leader's sampling parameters, already checked, with its own extra_args
    # (``msgspec.structs.replace`` would check them again: 511 clones at W=512).
    transfer = {k: dict(v) if isinstance(v, dict) else v
                for k, v in (params.extra_args.get("kv_transfer_params") or {}).items()}
    extra = {**params.extra_args, SLOT_KEY: spec.for_slot(slot, cum).to_wire(),
             "kv_transfer_params": transfer or None}
    sampling = copy.copy(params)
    sampling.extra_args = extra
    clone = Request(request_id=f"{leader.request_id}{CLONE_SEP}{slot}",
                    prompt_token_ids=prompt,
                    sampling_params=sampling,
                    pooling_params=None, client_index=leader.client_index,
                    arrival_time=leader.arrival_time, priority=leader.priority,
                    # Its leader's adapter: the same weights, and block hashes that
                    # find the leader's blocks (they carry the adapter).
                    lora_request=leader.lora_request, cache_salt=leader.cache_salt,
                    block_hasher=None)
    if hasher is not None:
        # Its full blocks before its own last tokens are its leader's, with the same
        # adapter and salt: their hashes are copied, not computed again (511 slots of a
        # 500-token parent hashed ~7.7k blocks); vLLM's hasher goes on from there, for
        # the blocks holding its own tokens and for those it decodes.
        clone.block_hashes = list(leader.block_hashes[:(len(prompt) - spec.tail)
                                                      // hash_block_size])
        clone._block_hasher = hasher
        clone.update_block_hashes()
        unshare_own_blocks(clone, spec, hash_block_size)
    return clone


def unshare_own_blocks(request: Request, spec: SlotSpec, hash_block_size: int) -> None:
    """A slot of a resumed search (``spec.tail`` > 1): its own tokens may fill a block
    whose tokens another slot's share (beams that start alike), and vLLM would serve it
    to that slot as a prefix hit, in the step both start in; a parent's blocks copied
    into it later would then write a block another slot holds. Its own blocks' hashes
    are made its own, never matched (vLLM's hasher goes on from them), as the group's
    blocks never stay cached anyway (``decode_engine.beam_slots`` evicts them). The
    shared prefix's hashes are kept: its blocks are hits."""
    if spec.tail <= 1 or not request.block_hashes:
        return
    from vllm.v1.core.kv_cache_utils import BlockHash

    first = (request.num_prompt_tokens - spec.tail) // hash_block_size
    request.block_hashes[first:] = [
        BlockHash(hashlib.sha256(f"{request.request_id}/{i}".encode()).digest())
        for i in range(first, len(request.block_hashes))]


def block_hasher(scheduler: Any) -> Any:
    """vLLM's request block hasher, as its engine core builds it (for the slots made
    here); None without prefix caching."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    if not scheduler.cache_config.enable_prefix_caching:
        return None
    return get_request_block_hasher(scheduler.hash_block_size, get_hash_fn_by_name(
        scheduler.cache_config.prefix_caching_hash_algo))
