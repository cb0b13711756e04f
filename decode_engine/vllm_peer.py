"""vLLM's own beam search (the online one its server runs), the reference our beam
search (``decode_engine.beam``) is compared with, token for token."""

from __future__ import annotations

from typing import Any

from kvhandoff.types import Beam, BeamParams

__all__ = ["vllm_beam_search"]


async def vllm_beam_search(llm: Any, tokenizer: Any, prompt_token_ids: list[int],
                           params: BeamParams, request_id: str,
                           lora_request: Any = None) -> list[Beam]:
    """vLLM's own beam search (the online one its server runs) on an AsyncLLM (under
    ``lora_request``, vLLM's LoRA request): the peer our beam search is compared with. It
    cannot carry ``kv_transfer_params``."""
    from types import SimpleNamespace

    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin
    from vllm.inputs import tokens_input
    from vllm.sampling_params import BeamSearchParams

    class _Peer(BeamSearchOnlineMixin):
        engine_client = llm
        renderer = SimpleNamespace(get_tokenizer=lambda: tokenizer)

    search = BeamSearchParams(beam_width=params.beam_width, max_tokens=params.max_tokens,
                              length_penalty=params.length_penalty,
                              ignore_eos=params.ignore_eos, include_stop_str_in_output=True)
    final = None
    async for out in _Peer().beam_search(tokens_input(prompt_token_ids), request_id, search,
                                         lora_request=lora_request):
        final = out
    assert final is not None
    return [Beam(token_ids=list(c.token_ids), cum_logprob=c.cumulative_logprob,
                 finish_reason=c.finish_reason) for c in final.outputs]
