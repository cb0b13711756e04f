"""Injected faults in the import path: the negative controls of the correctness harness.

Inert unless an engine is started with ``fault_injection`` on (``EngineConfig``; the
connector's extra config key ``fault_injection``) *and* a request names a fault under
``FAULT_KEY`` in its ``kv_transfer_params``. An engine without the switch refuses such
a request at admission (``connector.admission``), and never runs any code below.

Each fault corrupts one thing the real connector does, on real engines. What the
harness compares (beams, cumulative logprobs within the harness's bound, floor 1e-5,
tokens computed by D for the import step) and why each fault is or is not expected to
show, with N parent tokens, block size B and ``S`` suffix tokens::

    | block 0 | block 1 | ... | last block (partial unless B divides N-1) | suffix |
    |<------------ imported: N-1 tokens -------------->|<-- computed: S+1 ---->|
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from connector.params import FAULT_KEY

Side = Literal["prefill", "decode_scheduler", "decode_worker"]


@dataclass(frozen=True)
class Fault:
    name: str
    side: Side
    what: str
    #: Why the harness must catch it, or why it cannot.
    caught_by: str
    #: Parent shapes the fault can corrupt (others are reported "n/a", not passed).
    min_full_blocks: int = 0
    needs_partial_block: bool = False
    expected_caught: bool = True
    #: Corrupts only an import whose adapter differs from its request's.
    needs_adapter: bool = False
    #: Corrupts only an approximate composition (``connector.blend``): not a harness
    #: case, the composition's own tests and quality table run it.
    needs_blend: bool = False
    #: Corrupts only an import of an export P released before D read it: not a harness
    #: case (every harness export is live), tests/test_stale_reads.py runs it.
    needs_release: bool = False


#: The fault that lets D import under another adapter (its admission's check skipped).
ANY_ADAPTER_FAULT = "accept-any-adapter"
#: The fault that lets D use a READ P has not confirmed (``connector.liveness`` skipped).
SKIP_LIVE_FAULT = "skip-live-check"


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("duplicate-block", "decode_worker",
          "after the READ, imported block 0 is written over block 1: one block read "
          "twice, B positions lost",
          "keys carry their positions (RoPE before the cache): B positions are missing "
          "and B are doubled, so attention changes: logprobs, often beams",
          min_full_blocks=2),
    Fault("zero-block", "decode_worker",
          "after the READ, imported block 0 is zeroed in every layer",
          "B positions attend as zero keys and values: logprobs, often beams",
          min_full_blocks=1),
    Fault("partial-as-full", "decode_scheduler",
          "the partial last block is claimed whole: D counts the slots after N-1 as "
          "imported (capped at its prompt length - 1) and never computes them",
          "those slots hold no KV for D's suffix tokens: computed count, logprobs",
          needs_partial_block=True),
    Fault("import-short", "decode_scheduler",
          "D claims N-2 tokens as imported instead of N-1",
          "D recomputes one parent token itself, harmless for the output, so the computed "
          "count (S+2, not S+1) shows it; where N-2 is a block boundary D also reads one "
          "block fewer than P exported, and vLLM aligns the blocks from the end, which "
          "misplaces all of them: logprobs, beams"),
    Fault("import-long", "decode_scheduler",
          "D claims N tokens as imported: the last sampled token, which has no KV on P",
          "its slot holds no KV: computed count (S, not S+1), logprobs",
          needs_partial_block=True),  # within the last block: no extra block to READ
    Fault("stale", "prefill",
          "P's exported blocks are overwritten (as when they are reused after the "
          "lease) before D reads them; D's lease fence sees a valid lease (on a parent "
          "or chunk held on P: its held blocks, before anything reads them)",
          "D imports another request's KV: logprobs, beams. The overwritten blocks stay in "
          "P's prefix cache, so the harness resets it after each such case"),
    Fault("layer-swap", "decode_worker",
          "after the READ, layer 1's imported blocks are replaced by layer 0's",
          "layer 1 attends to layer 0's keys and values: logprobs, beams",
          min_full_blocks=1),
    Fault(ANY_ADAPTER_FAULT, "decode_scheduler",
          "D's admission skips the adapter check: it imports KV computed under one LoRA "
          "adapter into a request under another (or none)",
          "the parent's KV is the other adapter's: logprobs, beams (only where the "
          "export's adapter differs from the request's: adapter cases)",
          needs_adapter=True),
    Fault("merge-long", "decode_worker",
          "D's READ joins a run of blocks past its boundary (D's destination is "
          "allocated with a one-block gap for it): the piece after the boundary is read "
          "from the address that would continue the run, its own destination left "
          "unread (``connector.runs``)",
          "one block of one layer region holds other KV and one is unread: logprobs, "
          "often beams",
          min_full_blocks=2),
    Fault("merge-short", "decode_worker",
          "D's READ ends its first merged run one block short: that block of one layer "
          "region is never read (``connector.runs``)",
          "B positions of one layer region hold no parent KV: logprobs, often beams",
          min_full_blocks=1),
    Fault("swap-full-blocks", "decode_worker",
          "after the READ, imported blocks 0 and 1 (both full) trade places",
          "not caught, by design: each key carries its position (RoPE is applied before "
          "the cache) and attention sums over slots in any order, so the outputs are "
          "the same within float summation noise; it is listed to show the harness "
          "does not report what cannot matter",
          min_full_blocks=2, expected_caught=False),
    Fault("unrotated", "prefill",
          "P's approximate composition copies chunks' keys without RoPE applied again for "
          "their new positions (``connector.blend``)",
          "moved chunks' keys say their old positions: layer-0 keys differ from full "
          "prefill's, and agreement with full prefill drops",
          needs_blend=True),
    Fault(SKIP_LIVE_FAULT, "decode_worker",
          "D's worker reports a completed READ as done without P's confirmation that the "
          "export was still held (``connector.liveness``)",
          "where P released and reused the blocks before D read them, D imports another "
          "request's KV: beams, logprobs",
          needs_release=True),
)}


def applies(fault: Fault, num_parent_tokens: int, block_size: int,
            adapters_differ: bool = False) -> bool:
    """Whether ``fault`` can corrupt a parent of ``num_parent_tokens`` tokens (exported
    under another adapter than the import's request runs under: ``adapters_differ``)."""
    if (fault.needs_adapter and not adapters_differ) or fault.needs_blend or (
            fault.needs_release):
        return False
    num_imported = num_parent_tokens - 1
    if num_imported // block_size < fault.min_full_blocks:
        return False
    return not (fault.needs_partial_block and num_imported % block_size == 0)


def fault_of(params: dict[str, Any] | None) -> str | None:
    name = (params or {}).get(FAULT_KEY)
    return str(name) if name else None


def num_imported_with_fault(fault: str | None, num_importable: int,
                            num_prompt_tokens: int, block_size: int) -> int:
    """D scheduler: the token count a scheduler-side fault claims as imported."""
    if fault == "import-short":
        return num_importable - 1
    if fault == "import-long" and num_importable % block_size:
        return min(num_importable + 1, num_prompt_tokens - 1)
    if fault == "partial-as-full":
        return min(-(-num_importable // block_size) * block_size, num_prompt_tokens - 1)
    return num_importable


def corrupt_imported(fault: str, views: list[tuple[Any, int]], block_ids: list[int],
                     ratio: int) -> bool:
    """D worker, after a READ completed: corrupt the request's imported blocks; False
    (nothing touched) where the import has fewer blocks than the fault needs (a short
    parent: the harness counts it as a case the fault does not apply to).

    ``views`` are the KV tensors with their block dimension, one per layer in layer
    order; ``block_ids`` the request's logical local blocks; ``ratio`` kernel blocks per
    logical block.
    """
    import torch

    if len(block_ids) < max(FAULTS[fault].min_full_blocks, 1):
        return False

    def kernel(i: int) -> torch.Tensor:
        return torch.arange(block_ids[i] * ratio, (block_ids[i] + 1) * ratio)

    if fault == "zero-block":
        for tensor, dim in views:
            tensor.index_fill_(dim, kernel(0).to(tensor.device), 0)
    elif fault == "duplicate-block":
        for tensor, dim in views:
            src, dst = kernel(0).to(tensor.device), kernel(1).to(tensor.device)
            tensor.index_copy_(dim, dst, tensor.index_select(dim, src))
    elif fault == "swap-full-blocks":
        for tensor, dim in views:
            a, b = kernel(0).to(tensor.device), kernel(1).to(tensor.device)
            first = tensor.index_select(dim, a)
            tensor.index_copy_(dim, a, tensor.index_select(dim, b))
            tensor.index_copy_(dim, b, first)
    elif fault == "layer-swap":
        (src_t, src_dim), (dst_t, dst_dim) = views[0], views[1]
        idx = torch.cat([kernel(i) for i in range(len(block_ids))])
        dst_t.index_copy_(dst_dim, idx.to(dst_t.device),
                          src_t.index_select(src_dim, idx.to(src_t.device)))
    else:
        raise ValueError(f"not a decode-worker fault: {fault}")
    return True


def scribble(views: list[tuple[Any, int]], block_ids: list[int], ratio: int) -> None:
    """P worker (``stale``): overwrite exported blocks with other values, seeded."""
    import torch

    g = torch.Generator().manual_seed(len(block_ids))
    idx = torch.tensor([b * ratio + j for b in block_ids for j in range(ratio)])
    for tensor, dim in views:
        shape = list(tensor.shape)
        shape[dim] = len(idx)
        noise = torch.randn(shape, generator=g, dtype=torch.float32).to(tensor.dtype)
        tensor.index_copy_(dim, idx.to(tensor.device), noise.to(tensor.device))
