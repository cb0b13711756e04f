"""The worker side of beam search inside the engine: a logits processor that runs each
beam group's step and forces every slot's next token.

Loaded by vLLM in each worker (``logits_processors=[..., "decode_engine.beam_processor:
BeamSlotProcessor"]``, ``engine.config``). A slot is a request sent with
``SamplingParams(temperature=0, ignore_eos=True, max_tokens=T-1,
extra_args={SLOT_KEY: spec})`` (``decode_engine.slot_spec``); the W slots of a group are scheduled
together every step (``decode_engine.beam_slots``). At each step :meth:`apply` takes the
group's rows in slot order, lets ``decode_engine.beam_search`` pick the W new beams, and
turns each slot's row into one finite logit (0 at its token, -inf elsewhere), so vLLM's
greedy sampler picks it. Rows of other requests are left as they are. A search's step 0
is a group of one slot (``max_tokens=1``, the import's request): its one row gives the W
first beams, returned as the group's result.

What the step decided goes to the scheduler in this step's worker metadata
(``connector.step_meta.BeamStepMeta``): the parents of the new beams (the scheduler copies each
parent's KV into its children's slots before the next forward), and, at the last step,
the beams. vLLM builds that metadata in ``execute_model``, before sampling; the
connector worker opens it (``connector.step_meta.OUTBOX``) and the processor fills it during
sampling, before the step's output goes to the scheduler (``async_scheduling`` is off).
A step the processor cannot run (a slot missing from the batch) is posted as an error:
the scheduler ends the group; no beam is ever guessed.

A group may name a catalog (``engine.catalog``): the processor loads the engine's
catalogs once, at its start (``additional_config[CATALOGS_KEY]``), and limits each
beam's candidates to the catalog's (``decode_engine.beam_search.catalog_candidates``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from connector.params import CATALOGS_KEY, SLOT_KEY
from connector.step_meta import OUTBOX
from decode_engine.beam_search import (
    Candidates,
    GroupSearch,
    catalog_candidates,
    row_candidates,
)
from decode_engine.slot_spec import SlotSpec
from engine import catalog as catalogs

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class _Slot:
    group: str
    slot: int
    spec: SlotSpec
    own_tokens: list[int]  # its beam's own last prompt tokens (``SlotSpec.tail``)


def _slot_of(params: SamplingParams | None, prompt_token_ids: list[int] | None,
             output_token_ids: list[int]) -> _Slot | None:
    spec = SlotSpec.read(params.extra_args if params is not None else None)
    if spec is None:
        return None
    own = [int(t) for t in (prompt_token_ids or [])[-spec.tail:]]
    return _Slot(spec.group, spec.slot, spec, own or [-1])


class BeamSlotProcessor(LogitsProcessor):
    """Runs the beam groups whose slots are in the batch (module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        if SlotSpec.read(sampling_params.extra_args) is None:  # raises what is wrong
            return
        if sampling_params.temperature != 0.0 or not sampling_params.ignore_eos:
            raise ValueError(f"{SLOT_KEY}: a slot is greedy (temperature 0) and ignores "
                             "EOS; the search applies the EOS rule")

    def __init__(self, vllm_config: VllmConfig, device: torch.device,
                 is_pin_memory: bool) -> None:
        self._rows: dict[int, _Slot] = {}
        self._groups: dict[str, GroupSearch] = {}
        # Per group, the slot holding each live beam (the search's order): a beam's first
        # child stays in its parent's slot, so fewer blocks are copied.
        self._slot_of_beam: dict[str, np.ndarray] = {}
        self._failed: set[str] = set()
        self._catalogs = _load_catalogs(vllm_config)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, _slot_of)
        present = {row.group for row in self._rows.values()}
        # Every group's state goes with its last row (a one-slot group's search ends
        # before its row does, and its slot map must go too).
        for state in (self._groups, self._slot_of_beam):
            for group in [g for g in state if g not in present]:
                del state[group]
        self._failed &= present
        OUTBOX.active = bool(self._rows)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        by_group: dict[str, dict[int, int]] = {}
        for index, row in self._rows.items():
            by_group.setdefault(row.group, {})[row.slot] = index
        for group, rows in by_group.items():
            if group not in self._failed:
                self._step(group, rows, logits)
        return logits

    def _step(self, group: str, rows: dict[int, int], logits: torch.Tensor) -> None:
        spec = self._rows[next(iter(rows.values()))].spec
        width, members = spec.width, spec.members
        search = self._groups.get(group)
        if search is None:
            if len(rows) != members:
                return self._fail(group, 0, f"{len(rows)} of its {members} slots in the "
                                            "batch at its first step")
            catalog = None
            if spec.catalog is not None:
                catalog = self._catalogs.get(spec.catalog)
                if catalog is None:
                    return self._fail(group, 0, f"no catalog {spec.catalog!r} here")
            live = [self._rows[rows[i]] for i in range(spec.live)]
            search = self._groups[group] = GroupSearch(
                width=width, steps=spec.steps, eos_token_id=spec.eos,
                ignore_eos=spec.ignore_eos, catalog=catalog,
                cum_logprobs=np.array([row.spec.cum for row in live]))
            if catalog is not None and spec.in_item:
                # Its beams are inside an item already: their own prompt tokens (step 0's
                # pick; in a resumed search, every token so far).
                for i in range(spec.tail):
                    search.nodes = catalog.step(search.nodes, np.array(
                        [row.own_tokens[i] for row in live]))
        if search.done:
            return self._fail(group, search.step + 1, "a step past its last one")
        if members > 1 and (group in OUTBOX.stopping
                            or spec.stop_at == spec.tail + search.step):
            return self._stop(group, rows, search, logits, spec.tail)
        live = search.num_live
        slot_of = self._slot_of_beam.get(group)
        if slot_of is None:
            slot_of = self._slot_of_beam[group] = np.arange(live)
        if any(int(slot) not in rows for slot in slot_of):
            return self._fail(group, search.step + 1,
                              f"{sum(int(s) in rows for s in slot_of)} of its {live} live "
                              "beams in the batch")
        t0 = time.perf_counter()
        index = torch.tensor([rows[int(slot)] for slot in slot_of], device=logits.device,
                             dtype=torch.long)
        rows_logits = logits.index_select(0, index)
        if search.catalog is not None:
            candidates = _catalog_candidates(rows_logits, search)
        else:
            candidates = _deciding_candidates(rows_logits, search)
            if candidates is None:  # scores tie where it matters: vLLM's whole list
                candidates = _candidates(rows_logits, width)
        parents, tokens = search.select(candidates)
        forced = np.zeros(members, dtype=np.int64)  # slots with no beam: never read
        # The scheduler copies slot ``source[s]``'s blocks into slot ``s``'s.
        source = np.arange(members)
        if not search.done:
            slots = self._slot_of_beam[group] = place_beams(slot_of[parents], members)
            forced[slots] = tokens
            source[slots] = slot_of[parents]
        else:  # the slots end with this token: nothing to copy (a one-slot group, a
            # search's step 0, has more beams than slots then)
            shown = min(members, len(tokens))
            forced[:shown] = tokens[:shown]
        _force(logits, rows, forced)
        record: dict[str, Any] = {"step": search.step, "parents": source.tolist(),
                                  "select_ms": (time.perf_counter() - t0) * 1e3}
        if search.done:
            record["result"] = search.result(goes_on=spec.goes_on)
        OUTBOX.post(group, record)
        if members == 1 and search.done:
            # A one-slot group decides again if its row comes again: a chunked prompt's
            # partial steps are sampled too (discarded), and the scheduler reads only
            # the record of the step that completes the prompt.
            del self._groups[group]

    def _stop(self, group: str, rows: dict[int, int], search: GroupSearch,
              logits: torch.Tensor, done_before: int) -> None:
        """Stop the group to move it (``decode_engine.search_stops``), before this step's
        decision: the step is the resumed search's first, on the engine it moves to. Its
        state goes out as its result (every live beam, whole item or not), the slots end
        with this step's token (never read). ``done_before``: the search's beam steps
        before this group (step 0's; a resumed search's, before the move)."""
        search.steps = search.step  # done: a row that comes again fails the group
        _force(logits, rows, np.zeros(max(rows) + 1, dtype=np.int64))
        result = search.result(goes_on=True)
        result["stopped"] = done_before + search.step  # beam steps run, step 0 included
        OUTBOX.post(group, {"step": search.step + 1, "parents": list(range(len(rows))),
                            "select_ms": 0.0, "result": result, "stopped": True})

    def _fail(self, group: str, step: int, why: str) -> None:
        logger.error("Beam group %s fails at step %d: %s", group, step, why)
        self._failed.add(group)
        OUTBOX.post(group, {"step": step, "error": why})


def _load_catalogs(vllm_config: VllmConfig) -> dict[str, catalogs.Catalog]:
    """The engine's catalogs (``additional_config[CATALOGS_KEY]``: name -> path). The
    front end loaded and checked the same files before the engine started."""
    extra = getattr(vllm_config, "additional_config", None)
    paths = (extra.get(CATALOGS_KEY) if isinstance(extra, dict) else None) or {}
    if not paths:
        return {}
    model = vllm_config.model_config
    eos = getattr(model.hf_config, "eos_token_id", None)
    return {name: catalogs.load(name, path, model.get_vocab_size(), eos)
            for name, path in paths.items()}


def _candidates(rows: torch.Tensor, width: int) -> Any:
    """Each row's candidates as vLLM's beam search reads them from a ``2W``-logprobs
    request: vLLM's own greedy pick, logprobs and ``torch.topk`` (its sampler's)."""
    from vllm.v1.sample.sampler import Sampler

    logprobs = Sampler.compute_logprobs(rows)
    top_logprobs, top_tokens = torch.topk(logprobs, min(2 * width, rows.shape[-1]), dim=-1)
    sampled = Sampler.greedy_sample(rows).long()
    sampled_logprobs = logprobs.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    return row_candidates(sampled.cpu().numpy(), sampled_logprobs.cpu().numpy(),
                          top_tokens.cpu().numpy(), top_logprobs.cpu().numpy())


def _deciding_candidates(rows: torch.Tensor, search: GroupSearch) -> Candidates | None:
    """The candidates that decide this step, found on the dense scores (each row's
    cumulative logprob plus every token's logprob, float64 as vLLM adds them) instead
    of vLLM's list of ``2W`` per row: each row's EOS candidate where the search ends
    beams by EOS and EOS is in that row's list (sampled, or in its top ``2W``), and the
    W best of the others over all rows. ``GroupSearch.select`` picks from them exactly
    what it picks from the whole list when no two of the W + 1 best scores are equal
    and no EOS sits on a tie at its row's ``2W`` boundary: then the W best are one set in
    one order whatever breaks ties, and each is in its row's list (2W better ones in
    its row would rank above it). None otherwise: the whole list, ties as vLLM breaks
    them. At W=512 over 1024 tokens: ~7 ms instead of ~60 (``torch.topk`` of the whole
    vocabulary per row, and numpy over half a million candidates)."""
    from vllm.v1.sample.sampler import Sampler

    width, vocab = search.width, rows.shape[-1]
    k = min(2 * width, vocab)
    whole_rows = k == vocab  # every token of a row is in its list (W >= vocab / 2)
    logprobs = Sampler.compute_logprobs(rows).float()
    scores = (torch.from_numpy(search.cum_logprobs).to(rows.device)[:, None]
              + logprobs.double())
    greedy = Sampler.greedy_sample(rows).long()
    eos = None if search.ignore_eos else search.eos_token_id
    eos_rows = torch.empty(0, dtype=torch.long, device=rows.device)
    if eos is not None and 0 <= eos < vocab:
        if whole_rows:
            eos_rows = torch.arange(len(rows), device=rows.device)
        else:
            eos_logprobs = logprobs[:, eos:eos + 1]
            above = (logprobs > eos_logprobs).sum(1)
            level = (logprobs == eos_logprobs).sum(1)  # with itself
            sampled = greedy == eos
            if bool(((above < k) & (above + level > k) & ~sampled).any()):
                return None  # EOS on its row's boundary: in the list by topk's pick alone
            eos_rows = ((above < k) | sampled).nonzero().flatten()
        scores[:, eos] = float("-inf")
    best, flat = torch.topk(scores.flatten(), min(width + 1, scores.numel()))
    # A NaN logit makes its whole row NaN, and topk ranks NaN above every number.
    if bool(torch.isnan(best).any()):
        return None
    kept = torch.isfinite(best)
    best, flat = best[kept], flat[kept]
    if bool((best[1:] == best[:-1]).any()):
        return None
    chosen = flat[:width]
    parents, tokens = chosen // vocab, chosen % vocab
    chosen_logprobs = logprobs[parents, tokens]
    if not whole_rows:
        ranks = (logprobs[parents] > chosen_logprobs[:, None]).sum(1)
        if bool(((ranks >= k) & (tokens != greedy[parents])).any()):
            return None  # not in its row's list (cannot happen without ties; checked)
    return Candidates(
        torch.cat((eos_rows, parents)).cpu().numpy(),
        torch.cat((torch.full_like(eos_rows, eos if eos is not None else 0),
                   tokens)).cpu().numpy(),
        torch.cat((logprobs[eos_rows, eos] if eos is not None else logprobs.new_empty(0),
                   chosen_logprobs)).cpu().numpy())


def _catalog_candidates(rows: torch.Tensor, search: GroupSearch) -> Any:
    """The candidates of a constrained group's rows: the catalog's tokens, scored by
    vLLM's logprobs of the whole vocabulary."""
    from vllm.v1.sample.sampler import Sampler

    assert search.catalog is not None
    logprobs = Sampler.compute_logprobs(rows)

    def logprob_of(r: np.ndarray, t: np.ndarray) -> np.ndarray:
        return logprobs[torch.from_numpy(r), torch.from_numpy(t)].cpu().numpy()

    return catalog_candidates(search.catalog, search.nodes, logprob_of, search.width,
                              search.eos_token_id, search.ignore_eos)


def place_beams(parent_slots: np.ndarray, members: int) -> np.ndarray:
    """The slot of each new beam (``parent_slots``: its parent's slot, in the search's
    order): a parent's first child takes the parent's slot (nothing to copy), the others
    take the slots no child took, lowest first."""
    slots = np.full(len(parent_slots), -1, dtype=np.int64)
    taken = np.zeros(members, dtype=bool)
    for j, parent in enumerate(parent_slots.tolist()):
        if not taken[parent]:
            slots[j] = parent
            taken[parent] = True
    rest = np.flatnonzero(slots < 0)
    slots[rest] = np.flatnonzero(~taken)[:len(rest)]
    return slots


def _force(logits: torch.Tensor, rows: dict[int, int], tokens: np.ndarray) -> None:
    """Slot ``j`` samples ``tokens[j]`` (``tokens``: one per slot of the group, 0 in a
    slot holding no beam: its output is never read)."""
    slots = sorted(rows)
    index = torch.tensor([rows[s] for s in slots], device=logits.device)
    forced = torch.from_numpy(tokens[slots]).to(logits.device)
    logits.index_fill_(0, index, float("-inf"))
    logits[index, forced] = 0.0
