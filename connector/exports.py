"""What an export's handoff says of the request that ends as one: its tokens, the KV it
holds, in which blocks (:func:`describe_export`). Called by the connector's scheduler
side when a request ends as an export (``connector.nixl_scheduler``): P's finished or
stopped stage 1, and D's beam search stopped to move (``decode_engine.search_stops``),
whose slot 0 exports only the search's shared prefix."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from connector.handoff import Handoff, token_digest
from connector.params import EXPORT_TOKENS_KEY

if TYPE_CHECKING:
    from vllm.v1.request import Request


def describe_export(request: Request, params: dict[str, Any], *, block_size: int,
                    exported_at: float, lease_expires_at: float,
                    fields: dict[str, Any]) -> Handoff:
    """The handoff of ``request``, ending now as an export with stock NIXL's ``params``
    (its blocks, ``remote_num_tokens``); ``fields``: the engine's own (fingerprint,
    engine id, adapter, ...). The parent is the request's tokens, P computed KV for all
    but the last; a request that names :data:`EXPORT_TOKENS_KEY` exports only that many
    first tokens: ``params``' blocks and token count are cut to them (the lease still
    holds all its blocks until the importer has read)."""
    num_parent_tokens = request.num_tokens
    prefix = (request.kv_transfer_params or {}).get(EXPORT_TOKENS_KEY)
    if prefix is not None:
        num_parent_tokens = int(prefix)
        assert 1 < num_parent_tokens <= request.num_computed_tokens, (
            f"{request.request_id}: a prefix of {num_parent_tokens} tokens of "
            f"{request.num_computed_tokens} computed")
        kept = -(-(num_parent_tokens - 1) // block_size)
        params["remote_block_ids"] = [list(group)[:kept] for group in params["remote_block_ids"]]
        params["remote_num_tokens"] = num_parent_tokens - 1
    else:
        assert request.num_computed_tokens == num_parent_tokens - 1, (
            f"P exported {request.num_computed_tokens} computed tokens for a "
            f"{num_parent_tokens}-token parent: the lease would cover the wrong KV")
    return Handoff(
        request_id=request.request_id,
        num_parent_tokens=num_parent_tokens,
        num_computed_tokens=num_parent_tokens - 1,
        token_digest=token_digest(request.all_token_ids[:num_parent_tokens]),
        block_size=block_size,
        num_blocks=len(params["remote_block_ids"][0]),
        exported_at=exported_at,
        lease_expires_at=lease_expires_at,
        cache_salt=request.cache_salt or "",
        **fields,
    )
