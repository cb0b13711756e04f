"""The parts of an approximate composition, each alone: token reads and writes through
vLLM's own CPU cache writer (every block interior it uses here), keys moved by vLLM's own
RoPE table, the composition the router plans, and the connector's refusals."""

from __future__ import annotations

import types

import pytest
import torch

from connector.params import BlendReport
from connector.token_kv import LayoutError, Rerotation, TokenKV


def _cpu_writer(dtype: torch.dtype, block_size: int, head_size: int):
    """vLLM's CPU attention writing a cache, as its forward pass does
    (``CPUAttentionBackendImpl.do_kv_cache_update``, with the ISA vLLM picks)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa

    impl = types.SimpleNamespace(attn_type="decoder", kv_cache_dtype="auto")
    layer = types.SimpleNamespace(isa=_get_attn_isa(dtype, block_size, head_size, "auto"),
                                  _k_scale_float=1.0, _v_scale_float=1.0)

    def write(k, v, cache, slots):
        CPUAttentionBackendImpl.do_kv_cache_update(impl, layer, k, v, cache, slots)

    return write, layer.isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,heads,head", [(32, 2, 64), (16, 2, 64), (32, 2, 48)])
def test_tokens_read_back_what_vllms_writer_put_in_any_block_interior(
        dtype, block_size, heads, head):
    """The probe learns the interior (``vec``: block size 32 and head 64; ``vec16``
    otherwise); a read returns what vLLM's writer wrote at scattered slots, and a write
    lays tokens out exactly as vLLM's writer does."""
    write, isa = _cpu_writer(dtype, block_size, head)
    layout = TokenKV(write, (heads, block_size, 2 * head), dtype, "cpu", block_size, heads,
                     head)
    cache = torch.zeros(6, heads, block_size, 2 * head, dtype=dtype)
    slots = torch.randperm(6 * block_size, generator=torch.Generator().manual_seed(0))[:40]
    k, v = (torch.randn(40, heads, head).to(dtype) for _ in range(2))
    write(k, v, cache, slots)
    got_k, got_v = layout.read(cache, slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, v), isa
    ours = torch.zeros_like(cache)
    layout.write(ours, slots, k, v)
    assert torch.equal(ours, cache), isa
    # The control: rows of the tensor are not tokens in a packed interior.
    if isa == "vec":
        naive = cache.view(6, heads, 2 * block_size, head)[:, :, :block_size]
        rows = naive.permute(0, 2, 1, 3).reshape(-1, heads, head)[slots]
        assert not torch.equal(rows, k), "the interior was not packed: the probe untested"


def test_a_layout_that_is_not_a_permutation_is_refused():
    def lossy(k, v, cache, slots):  # writes every token to slot 0
        cache[0, :, 0, : k.shape[-1]] = k[-1]

    with pytest.raises(LayoutError, match="not a permutation"):
        TokenKV(lossy, (2, 16, 128), torch.float32, "cpu", 16, 2, 64)


def _rope(head: int = 64):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(head, 8192, True, None, dtype=torch.float32)


def test_a_moved_key_is_the_key_vllm_computes_at_the_new_position():
    """Keys rotated at p, moved by delta (either sign), equal vLLM's RoPE at p + delta;
    unmoved they do not (the control)."""
    rope, n = _rope(), 64
    g = torch.Generator().manual_seed(1)
    raw = torch.randn(n, 2 * 64, generator=g)
    pos = torch.randint(0, 2000, (n,), generator=g)
    delta = torch.maximum(torch.randint(-1500, 1500, (n,), generator=g), -pos)
    query = torch.zeros(n, 4 * 64)
    _, at_p = rope.forward_native(pos, query.clone(), raw.clone())
    _, at_new = rope.forward_native(pos + delta, query.clone(), raw.clone())
    moved = Rerotation(rope.cos_sin_cache).apply(at_p.view(n, 2, 64), delta)
    assert torch.allclose(moved, at_new.view(n, 2, 64), atol=1e-3)
    assert (at_p - at_new).abs().max() > 1.0


def test_the_router_composes_by_position_and_refuses_what_it_cannot():
    import grpc

    from router.composition import approximate, is_chain
    from router.errors import RouterError

    p = object()
    rec = lambda cid, under, own, chain, **kw: types.SimpleNamespace(  # noqa: E731
        chunk_id=cid, under=under, token_ids=own, chain_ids=chain, held_name=f"pin-{cid}",
        prefill=kw.get("prefill", p), engine_id="e", adapter=kw.get("adapter", ""))
    sys_, hist = rec("sys", "", [1] * 10, [1] * 10), rec("hist", "sys", [2] * 6, [1] * 10 + [2] * 6)
    doc = rec("doc", "", [3] * 20, [3] * 20)
    assert is_chain((sys_, hist)) and not is_chain((sys_, doc)) and not is_chain((hist,))
    comp = approximate((sys_, hist, doc), 0.25, "")
    assert comp.prefix_ids == [1] * 10 + [2] * 6 + [3] * 20
    assert [(q.source, q.source_start, q.length, q.position) for q in comp.blend.parts] == [
        ("pin-sys", 0, 10, 0), ("pin-hist", 10, 6, 10), ("pin-doc", 0, 20, 16)]
    assert comp.blend.num_loaded == 36 - 9  # ceil(0.25 * 36) recomputed
    assert approximate((doc,), 0.0, "").blend.num_loaded == 20
    assert comp.blend.cache_salt() == approximate((sys_, hist, doc), 0.25, "").blend.cache_salt()
    assert comp.blend.cache_salt() != approximate((sys_, hist, doc), 0.3, "").blend.cache_salt()
    for records, share, adapter, code, text in (
            ((doc,), 1.5, "", grpc.StatusCode.INVALID_ARGUMENT, "recompute_share"),
            ((doc, rec("far", "", [4], [4], prefill=object())), 0.1, "",
             grpc.StatusCode.FAILED_PRECONDITION, "different P engines"),
            ((doc,), 0.1, "lora-a", grpc.StatusCode.FAILED_PRECONDITION, "no adapter")):
        with pytest.raises(RouterError) as e:
            approximate(records, share, adapter)
        assert e.value.code == code and text in str(e.value)


def test_the_connector_refuses_a_composition_it_cannot_honour():
    """Each refusal computes the prompt instead (0 tokens loaded) and says why."""
    from connector.beam_fork import KeptRequest
    from connector.blend import BlendScheduler

    kept = {"pin-a": KeptRequest("r-a", [5, 6, 7, 8], ([3],), float("inf"), held=True),
            "pin-l": KeptRequest("r-l", [5, 6, 7, 8], ([4],), float("inf"), held=True,
                                 adapter="lora")}
    blend = BlendScheduler(4, kept)

    def request(prompt, rid="q", salt="s"):
        return types.SimpleNamespace(request_id=rid, prompt_token_ids=prompt,
                                     num_prompt_tokens=len(prompt), lora_request=None,
                                     cache_salt=salt)

    spec = {"parts": [["pin-a", 0, 4, 0]], "num_loaded": 4}
    assert blend.match(request([5, 6, 7, 8, 9]), spec, 0) == 4
    blend.scheduled(request([5, 6, 7, 8, 9]), [10, 11], 4, rotate=True)
    (copies,) = blend.take_copies()
    assert (copies.source_slots, copies.dest_slots, copies.deltas) == (
        [12, 13, 14, 15], [40, 41, 42, 43], [0, 0, 0, 0])
    assert blend.finished(request([5, 6, 7, 8, 9])) == BlendReport(num_blended_tokens=4,
                                                                   refused="")
    for prompt, parts, why in (
            ([5, 6, 7, 0, 9], [["pin-a", 0, 4, 0]], "not the prompt's"),
            ([5, 6, 7, 8, 9], [["gone", 0, 4, 0]], "not held here"),
            ([5, 6, 7, 8, 9], [["pin-l", 0, 4, 0]], "another adapter"),
            ([5, 6, 7, 8, 9], [["pin-a", 0, 4, 1]], "tile the prompt")):
        r = request(prompt, "bad")
        assert blend.match(r, {"parts": parts, "num_loaded": 4}, 0) == 0
        assert why in blend.finished(r).refused
    # Unsalted, its blocks would reach the prefix cache of every request: refused.
    r = request([5, 6, 7, 8, 9], "unsalted", salt=None)
    assert blend.match(r, spec, 0) == 0 and "salt" in blend.finished(r).refused
    # Refused after a preemption (its source gone since): the prefix hits under its salt
    # are copied KV still, and counted.
    r = request([5, 6, 7, 8, 9], "again")
    assert blend.match(r, {"parts": [["gone", 0, 4, 0]], "num_loaded": 4}, 4) == 0
    assert blend.finished(r).num_blended_tokens == 4
    # The last prompt token is always computed, to sample from it.
    assert blend.match(request([5, 6, 7, 8]), spec, 0) == 3


def test_copies_cross_blocks_start_inside_a_chain_and_follow_the_prefix_hits():
    """Slots and deltas for parts that start mid-source (a chunk under a chain), cross
    block boundaries and move either way, after a prefix hit of one block."""
    from connector.beam_fork import KeptRequest
    from connector.blend import BlendScheduler

    bs = 4
    chain = list(range(100, 110))  # a root of 4 tokens and a child of 6 under it
    doc = list(range(200, 207))
    kept = {"pin-child": KeptRequest("r-c", chain, ([7, 3, 9],), float("inf"), held=True),
            "pin-doc": KeptRequest("r-d", doc, ([5, 6],), float("inf"), held=True)}
    blend = BlendScheduler(bs, kept)
    prompt = doc + chain[4:] + [1, 2]  # doc at 0, the child's own tokens at 7
    req = types.SimpleNamespace(request_id="q", prompt_token_ids=prompt,
                                num_prompt_tokens=len(prompt), lora_request=None,
                                cache_salt="s")
    spec = {"parts": [["pin-doc", 0, 7, 0], ["pin-child", 4, 6, 7]], "num_loaded": 12}
    assert blend.match(req, spec, bs) == 12 - bs  # block 0 found under the salt
    blend.scheduled(req, [20, 21, 22, 23], 12 - bs, rotate=True)
    (c,) = blend.take_copies()
    # Prompt positions 4..11: doc 4..6 (blocks 5,6 at offsets), child 4..8 (source
    # blocks 3 and 9), into blocks 21 and 22.
    assert c.source_slots == [6 * bs + 0, 6 * bs + 1, 6 * bs + 2,
                              3 * bs + 0, 3 * bs + 1, 3 * bs + 2, 3 * bs + 3, 9 * bs + 0]
    assert c.dest_slots == [21 * bs + k for k in range(4)] + [22 * bs + k for k in range(4)]
    assert c.deltas == [0, 0, 0, 3, 3, 3, 3, 3]
    # The child moved earlier than where it was prefilled: a negative delta.
    early = {"parts": [["pin-child", 4, 6, 0]], "num_loaded": 6}
    req2 = types.SimpleNamespace(request_id="e", prompt_token_ids=chain[4:] + [1],
                                 num_prompt_tokens=7, lora_request=None, cache_salt="s")
    assert blend.match(req2, early, 0) == 6
    blend.scheduled(req2, [30, 31], 6, rotate=True)
    assert blend.take_copies()[0].deltas == [-4] * 6
