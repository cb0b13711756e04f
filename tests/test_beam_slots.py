"""Beam search inside the engine, unit level: the logits processor and the search it runs,
driven as vLLM drives them, against vLLM's own online beam search on a scripted model.

The scripted engine below is a fake of the engine around the processor only: each
engine step it builds the batch's logits from each slot's context, hands them to the
real ``BeamSlotProcessor`` (as vLLM's sampler does, after ``update_state``), samples
greedily, and makes slot ``j``'s context its parent slot's plus the forced token (what
the scheduler's block copies do to the KV). The real engine runs in
``tests/test_beam_engine.py``.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams

from connector.params import KEY, SLOT_KEY
from connector.step_meta import OUTBOX
from decode_engine.beam import beam_search
from decode_engine.beam_processor import BeamSlotProcessor
from decode_engine.slot_spec import SlotSpec, slot_spec
from kvhandoff.types import BeamParams, StageError

EOS = 1
VOCAB = 64

pytestmark = pytest.mark.beams


def scripted_logits(tokens: list[int]) -> torch.Tensor:
    """A context's logits, float32, in steps of 1/4: exact ties at every step, the cutoff
    included (as bf16's coarse logits give)."""
    rng = random.Random(str(tokens))
    return torch.tensor([round(rng.gauss(0, 1.5) * 4) / 4 for _ in range(VOCAB)],
                        dtype=torch.float32)


def logprobs_dict(tokens: list[int], k: int) -> dict[int, SimpleNamespace]:
    """What a vLLM request with ``logprobs=k`` returns for one position: the sampled
    (greedy) token, then the top k, each token once (vLLM's sampler and dict)."""
    from vllm.v1.sample.sampler import Sampler

    logits = scripted_logits(tokens).unsqueeze(0)
    logprobs = Sampler.compute_logprobs(logits)[0]
    sampled = int(Sampler.greedy_sample(logits)[0])
    top = torch.topk(logprobs, min(k, VOCAB)).indices.tolist()
    return {t: SimpleNamespace(logprob=float(logprobs[t]), rank=r, decoded_token=None)
            for r, t in enumerate([sampled, *top])}


class ScriptedEngine:
    """Each beam group (step 0's one slot, then the slots) as one batch run by the real
    processor; a request that is no slot (vLLM's reference) answers its logprobs."""

    def __init__(self, copies: bool = True, drop_slot: int | None = None,
                 vllm_config=None):
        self.copies = copies  # False: the children's KV is not replaced (a fault)
        self.drop_slot = drop_slot  # a slot missing from the batch (a fault)
        self.vllm_config = vllm_config  # what the processor is made with (its catalogs)
        self.slots: dict[int, tuple[list[int], object, asyncio.Future]] = {}
        self.group = None  # the group of ``slots``
        self.steps_run = 0
        self.decided: dict[str, asyncio.Future] = {}  # one-slot groups' results

    def _decision(self, group: str) -> asyncio.Future:
        return self.decided.setdefault(group, asyncio.get_running_loop().create_future())

    async def generate(self, tokens, sampling, request_id):
        spec = (sampling.extra_args or {}).get(SLOT_KEY)
        if spec is None:
            return _output(tokens, None if sampling.logprobs is None
                           else [logprobs_dict(tokens, sampling.logprobs)], None)
        BeamSlotProcessor.validate_params(sampling)
        if spec.get("after"):
            # A leader sent with its step 0: filled in from step 0's result as the
            # scheduler fills it (decode_engine.slot_fill, tested below over vLLM's
            # Scheduler).
            live = (await self._decision(spec["after"]))["live"]
            starts = [live[min(i, len(live) - 1)] for i in range(spec["members"])]
            tokens = list(tokens[:-1]) + [starts[0][1][-1]]
            spec = SlotSpec.read({SLOT_KEY: spec}).filled(
                len(live), starts[0][2], tuple((t[-1], c) for _, t, c in starts[1:])
            ).to_wire()
            sampling = SamplingParams(**{**_fields(sampling), "extra_args": {
                **sampling.extra_args, SLOT_KEY: spec}})
        if spec["group"] != self.group:  # the slots of the last group: gone
            self.group, self.slots = spec["group"], {}
        future = asyncio.get_running_loop().create_future()
        self.slots[spec["slot"]] = (list(tokens), sampling, future)
        # The leader brings its group's other slots (the scheduler makes them:
        # decode_engine.beam_slots, tested below over vLLM's Scheduler).
        own = {k: v for k, v in spec.items() if k != "clones"}
        for i, (token, cum) in enumerate(spec.get("clones") or [], start=1):
            clone = SamplingParams(**{**_fields(sampling), "extra_args": {
                **sampling.extra_args, SLOT_KEY: {**own, "slot": i, "cum": cum}}})
            BeamSlotProcessor.validate_params(clone)
            prompt = list(tokens[:-1]) + [token] if token is not None else list(tokens)
            self.slots[i] = (prompt, clone, asyncio.get_running_loop().create_future())
        if len(self.slots) == spec["members"]:
            self._run(spec)
        return await future

    def _run(self, spec) -> None:
        processor = BeamSlotProcessor(self.vllm_config, torch.device("cpu"), False)
        order = sorted(self.slots)
        rows = [i for i in order if i != self.drop_slot]
        processor.update_state(SimpleNamespace(
            batch_size=len(rows), removed=[], moved=[],
            added=[(r, self.slots[i][1], self.slots[i][0], []) for r, i in enumerate(rows)]))
        contexts = {i: self.slots[i][0] for i in order}
        record, select_ms = {}, []
        for _ in range(spec["steps"]):
            meta = OUTBOX.open_step()
            logits = torch.stack([scripted_logits(contexts[i]) for i in rows])
            forced = processor.apply(logits).argmax(dim=-1).tolist()
            self.steps_run += 1
            record = meta.groups[spec["group"]]
            select_ms.append(record.get("select_ms", 0.0))
            if "error" in record or "result" in record:
                break  # the scheduler ends the slots with the result (or the error)
            by_slot = dict(zip(rows, forced))
            source = ({j: contexts[p] for j, p in enumerate(record["parents"])}
                      if self.copies else contexts)
            contexts = {i: source.get(i, contexts[i]) + [by_slot[i]] for i in order}
        processor.update_state(SimpleNamespace(batch_size=0, removed=list(range(len(rows))),
                                               moved=[], added=[]))
        if spec["members"] == 1 and "result" in record:  # a step 0
            self._decision(spec["group"]).set_result(record["result"])
        # As the scheduler answers (decode_engine.beam_slots): the result, the steps' figures.
        info = ({SLOT_KEY: {**record["result"], "steps": {"select_ms": select_ms}}}
                if "result" in record
                else {"reason": "beam_group", "error": record.get("error", "no result")})
        for i in order:
            tokens, _, future = self.slots[i]
            future.set_result(_output(tokens, None, {KEY: info} if i == 0 else None,
                                      "error" if "error" in record else "length"))


def _fields(params) -> dict:
    return {"max_tokens": params.max_tokens, "temperature": params.temperature,
            "ignore_eos": params.ignore_eos, "detokenize": params.detokenize,
            "extra_args": params.extra_args}


def _output(tokens, logprobs, params, reason="length"):
    return SimpleNamespace(
        outputs=[SimpleNamespace(logprobs=logprobs, finish_reason=reason)],
        prompt_token_ids=list(tokens), num_cached_tokens=len(tokens) - 1,
        kv_transfer_params=params)


def vllm_online(prompt: list[int], params: BeamParams) -> list[tuple[list[int], float]]:
    """vLLM's own online beam search (its code, unchanged) over the scripted model."""
    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin
    from vllm.inputs import tokens_input
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import BeamSearchParams

    async def generate(prompt_item, sampling, request_id, **_):
        tokens = list(prompt_item["prompt_token_ids"])
        yield RequestOutput(
            request_id=request_id, prompt=None, prompt_token_ids=tokens,
            prompt_logprobs=None, finished=True,
            outputs=[CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None,
                                      logprobs=[logprobs_dict(tokens, sampling.logprobs)],
                                      finish_reason="length")])

    class Peer(BeamSearchOnlineMixin):
        engine_client = SimpleNamespace(generate=generate, input_processor=SimpleNamespace(
            resolve_watermarking=lambda p: None))
        renderer = SimpleNamespace(get_tokenizer=lambda: SimpleNamespace(
            eos_token_id=EOS, decode=lambda tokens, **_: ""))

    search = BeamSearchParams(beam_width=params.beam_width, max_tokens=params.max_tokens,
                              length_penalty=params.length_penalty,
                              ignore_eos=params.ignore_eos, include_stop_str_in_output=True)

    async def final():
        outs = [out async for out in Peer().beam_search(tokens_input(prompt), "r", search)]
        return [(list(c.token_ids), c.cumulative_logprob) for c in outs[-1].outputs]

    return asyncio.run(final())


def ours(prompt: list[int], params: BeamParams, engine: ScriptedEngine | None = None):
    engine = engine if engine is not None else ScriptedEngine()
    out = asyncio.run(beam_search(engine.generate, prompt, params, eos_token_id=EOS,
                                  request_id="r"))
    return [(b.token_ids, b.cum_logprob) for b in out.beams], out


#: (width, beam tokens, length penalty, ignore_eos)
CASES = [(1, 5, 1.0, False), (2, 4, 1.0, False), (3, 3, 1.0, False), (4, 6, 0.5, False),
         (5, 3, 1.0, True), (8, 4, 2.0, False), (16, 3, 1.0, False), (32, 3, 1.0, True),
         (7, 5, 1.0, False), (4, 1, 1.0, False)]


@pytest.mark.parametrize("width,tokens,penalty,ignore_eos", CASES)
def test_in_engine_beams_equal_vllms_online_beam_search(width, tokens, penalty, ignore_eos):
    """Token ids, order and cumulative logprobs, bit for bit, ties included; EOS beams,
    length penalty and ignore_eos as vLLM has them."""
    for seed in range(3):
        prompt = [3 + seed, 4, width, tokens]
        params = BeamParams(beam_width=width, max_tokens=tokens, length_penalty=penalty,
                            ignore_eos=ignore_eos)
        got, outcome = ours(prompt, params)
        assert got == vllm_online(prompt, params), (prompt, params)
        assert outcome.step_computed_tokens == [1] + [width] * (tokens - 1)


def test_the_cases_have_eos_beams_and_ties():
    """The comparison above covers what it claims: some beams end by EOS and some steps
    tie at the cutoff."""
    ended = [b for w, t, lp, ie in CASES if not ie
             for b, _ in ours([3, 4, w, t], BeamParams(w, t, length_penalty=lp))[0]
             if b and b[-1] == EOS]
    assert ended, "no case returns a beam ended by EOS"
    logits = scripted_logits([3, 4, 16, 3])
    assert len(set(logits.tolist())) < VOCAB / 2, "the scripted logits do not tie"


def test_without_the_block_copies_the_beams_differ():
    """Negative control: a slot whose KV is not replaced by its parent's (the copies
    skipped) continues the wrong beam, and the result leaves vLLM's."""
    differ = 0
    for width, tokens, penalty, ignore_eos in CASES:
        if tokens < 3:
            continue
        params = BeamParams(width, tokens, length_penalty=penalty, ignore_eos=ignore_eos)
        prompt = [3, 4, width, tokens]
        got, _ = ours(prompt, params, ScriptedEngine(copies=False))
        differ += got != vllm_online(prompt, params)
    assert differ >= 3


def test_a_stable_pick_among_ties_leaves_vllms_beams(monkeypatch):
    """Control for the ties: the same search picking a step's W in candidate order (a
    stable sort) leaves vLLM's beams on some cases, so the comparison above sees ties."""
    import numpy as np

    import decode_engine.beam_search

    monkeypatch.setattr(decode_engine.beam_search, "top_candidates",
                        lambda cums, width: np.argsort(-cums, kind="stable")[:width])
    differ = [case for case in CASES
              if ours([3, 4, case[0], case[1]], BeamParams(*case[:2], length_penalty=case[2],
                                                            ignore_eos=case[3]))[0]
              != vllm_online([3, 4, case[0], case[1]],
                             BeamParams(*case[:2], length_penalty=case[2], ignore_eos=case[3]))]
    assert differ, "no case has a tie that numpy resolves otherwise than candidate order"


def test_score_matches_vllm():
    from vllm.entrypoints.generate.beam_search.utils import get_beam_search_score

    from decode_engine.beam import beam_score

    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
        cum, lp = -rng.random() * 10, rng.choice([0.0, 0.5, 1.0, 2.0])
        assert beam_score(tokens, cum, EOS, lp) == get_beam_search_score(tokens, cum, EOS, lp)


def test_a_slot_missing_from_the_batch_fails_the_group_with_its_reason():
    """The processor never guesses: a group whose slots are not all in the batch fails
    at once, and the caller learns why."""
    engine = ScriptedEngine(drop_slot=2)
    with pytest.raises(StageError, match="3 of its 4 slots") as err:
        ours([3, 4, 5], BeamParams(4, 4), engine)
    assert err.value.reason == "beam_group" and engine.steps_run == 2  # step 0, then 1


def test_step_0_decides_again_when_its_row_comes_again():
    """Step 0 is a group of one slot. A chunked prompt (vLLM's default on GPUs) puts its
    row in the batch at each partial step too, sampled and discarded: the processor
    decides again from the row it gets (the scheduler reads the record of the step that
    completes the prompt) instead of failing the group as a step past its last."""
    spec = slot_spec(group="s0", slot=0, members=1, width=4, live=1, steps=1,
                     cum_logprob=0.0, eos_token_id=EOS, ignore_eos=False)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                            extra_args={SLOT_KEY: spec})
    processor = BeamSlotProcessor(None, torch.device("cpu"), False)
    processor.update_state(SimpleNamespace(batch_size=1, removed=[], moved=[],
                                           added=[(0, params, [3, 4, 5], [])]))
    records = []
    for context in ([3, 4], [3, 4, 5]):  # a partial step's row, then the prompt's end
        meta = OUTBOX.open_step()
        processor.apply(scripted_logits(context).unsqueeze(0))
        records.append(meta.groups["s0"])
    assert all("error" not in r and r["step"] == 1 for r in records), records
    assert [len(r["result"]["live"]) for r in records] == [4, 4]
    assert records[0]["result"] != records[1]["result"]  # each from its own row
    processor.update_state(SimpleNamespace(batch_size=0, removed=[0], moved=[], added=[]))
    # Nothing of the group stays once its row has gone (a map kept per one-slot group,
    # every W=1 search and every step 0, grew D's heap under the soak).
    assert not (processor._groups or processor._slot_of_beam or processor._failed)


def test_slot_params_are_checked_where_vllm_checks_them():
    from vllm import SamplingParams

    spec = slot_spec(group="g", slot=0, members=2, width=2, live=2, steps=3,
                     cum_logprob=-1.0, eos_token_id=EOS, ignore_eos=False)
    ok = SamplingParams(temperature=0.0, ignore_eos=True, extra_args={SLOT_KEY: spec})
    BeamSlotProcessor.validate_params(ok)
    for bad, match in [({"temperature": 0.7, "ignore_eos": True}, "greedy"),
                       ({"temperature": 0.0, "ignore_eos": False}, "ignores"),
                       ]:
        with pytest.raises(ValueError, match=match):
            BeamSlotProcessor.validate_params(SamplingParams(**bad, extra_args={SLOT_KEY: spec}))
    with pytest.raises(ValueError, match="outside the group"):
        BeamSlotProcessor.validate_params(SamplingParams(
            temperature=0.0, ignore_eos=True, extra_args={SLOT_KEY: {**spec, "slot": 2}}))
    with pytest.raises(ValueError, match="missing"):
        BeamSlotProcessor.validate_params(SamplingParams(
            temperature=0.0, ignore_eos=True, extra_args={SLOT_KEY: {"group": "g"}}))


# ---- the scheduler side: vLLM's real Scheduler with no model (tests/utils) -------------
def _slot_request(prompt, *, group="g", slot, width, steps=2, fork_from=None):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from connector.params import BEAM_KEY
    from tests.utils import BLOCK_SIZE

    init_none_hash(sha256)
    spec = slot_spec(group=group, slot=slot, members=width, width=width, live=width,
                     steps=steps, cum_logprob=-1.0, eos_token_id=EOS, ignore_eos=False)
    sampling = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True,
                              extra_args={SLOT_KEY: spec})
    sampling.update_from_generation_config({}, 1)
    req = Request(request_id=f"{group}{slot}", prompt_token_ids=list(prompt),
                  sampling_params=sampling, pooling_params=None,
                  block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    req.kv_transfer_params = {BEAM_KEY: {"fork_from": fork_from, "fork_children": width}
                              if fork_from else {}}
    return req


def _slot_step(scheduler, groups=None, finished_sending=()):
    """One schedule() and a step output: token 5 for every scheduled request, and the
    processor's records (``groups``) in the worker metadata."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from connector.step_meta import BeamStepMeta

    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    meta = None
    if groups is not None:
        meta = BeamStepMeta()
        meta.groups.update(groups)
    outputs = scheduler.update_from_output(out, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[5] for _ in ids],
        kv_connector_output=KVConnectorOutput(finished_sending=set(finished_sending),
                                              kv_connector_worker_meta=meta)))
    return out, {o.request_id: o for eco in outputs.values() for o in eco.outputs}


@pytest.mark.parametrize("beam_fork", [True, False])
def test_slots_start_together_and_their_blocks_follow_their_parents(model_dir, beam_fork):
    """Three slots over a 95-token parent (first block a slot holds alone: 2, full at
    admission, so vLLM hashes it): they wait for each other and start in one step; their
    own blocks are out of the prefix cache; a step whose beams continue slots 0, 0, 1
    copies slot 0's blocks into slot 1's and slot 1's into slot 2's before the next
    forward (on the connector's worker with beam fork on, else through vLLM's
    ``kv_cache_block_copies``); slot 0's final output carries the beams; nothing is
    left."""
    from connector.params import KEY
    from tests.utils import assert_scheduler_clean, make_scheduler

    scheduler = make_scheduler(model_dir, extra_config={"beam_fork": beam_fork})
    parent = list(range(10, 105))
    slots = [_slot_request(parent + [20 + i], slot=i, width=3) for i in range(3)]
    scheduler.add_request(slots[0])
    scheduler.add_request(slots[1])
    out, _ = _slot_step(scheduler)
    assert out.num_scheduled_tokens == {}, "two of three slots must wait"
    scheduler.add_request(slots[2])
    out, _ = _slot_step(scheduler, {"g": {"step": 1, "parents": [0, 0, 1]}})
    assert sorted(out.num_scheduled_tokens) == ["g0", "g1", "g2"]
    first_computed = sum(out.num_scheduled_tokens.values())
    manager = scheduler.kv_cache_manager
    own = {r.request_id: manager.get_block_ids(r.request_id)[0][2:] for r in slots}
    pool = manager.block_pool
    assert all(pool.blocks[b].block_hash is None for ids in own.values() for b in ids), \
        "a slot's own block stayed in the prefix cache"

    result = {"completed": [], "live": [[0, [5, 5], -2.0], [1, [5, 5], -2.5], [0, [5, 6], -3.0]]}
    out, outputs = _slot_step(scheduler, {"g": {"step": 2, "parents": [0, 1, 2],
                                                "result": result}})
    cached = out.scheduled_cached_reqs
    for rid, new in zip(cached.req_ids, cached.new_block_ids):
        own[rid] = own[rid] + (list(new[0]) if new else [])
    assert len(own["g0"]) == 2, "block 2 and the one step 2 writes into"
    on_worker = list(out.kv_connector_metadata.orders.fork_copies)
    by_vllm = list(out.kv_cache_block_copies or [])
    assert not (by_vllm if beam_fork else on_worker), "copies sent two ways"
    # vLLM runs the connector's loads before the forward only in a step marked so.
    assert out.has_sync_kv_loads or not beam_fork, "the copies would run after the forward"
    assert sorted(on_worker or by_vllm) == sorted(
        [*zip(own["g0"], own["g1"]), *zip(own["g1"], own["g2"])])
    got = dict(outputs["g0"].kv_transfer_params[KEY][SLOT_KEY])
    assert got.pop("steps") == {"select_ms": [0.0, 0.0], "copied_blocks": [4],
                                "first_computed": first_computed}
    assert got == result
    assert all(outputs[f"g{i}"].finish_reason is not None for i in range(3))
    assert_scheduler_clean(scheduler)


def test_a_group_waits_for_room_and_a_step_without_decision_ends_it(model_dir):
    """16 running requests at most: a second group of 8 waits while 12 slots run, and
    starts when they end. A step whose decision never arrived ends every slot of its
    group with the reason; no block is left."""
    from connector.params import KEY
    from tests.utils import assert_scheduler_clean, make_scheduler

    scheduler = make_scheduler(model_dir)
    parent = list(range(10, 50))
    first = [_slot_request(parent + [i], group="a", slot=i, width=12, steps=1)
             for i in range(12)]
    second = [_slot_request(parent + [i], group="b", slot=i, width=8, steps=1)
              for i in range(8)]
    for req in first + second:
        scheduler.add_request(req)
    result = {"completed": [], "live": [[i, [5], -1.0] for i in range(12)]}
    out, outputs = _slot_step(scheduler, {"a": {"step": 1, "parents": list(range(12)),
                                                "result": result}})
    assert sorted(out.num_scheduled_tokens) == sorted(r.request_id for r in first)
    got = dict(outputs["a0"].kv_transfer_params[KEY][SLOT_KEY])
    assert got.pop("steps") == {"select_ms": [0.0], "copied_blocks": [],
                                "first_computed": sum(out.num_scheduled_tokens.values())}
    assert got == result

    out, outputs = _slot_step(scheduler, {})  # group b ran; its decision is missing
    assert sorted(out.num_scheduled_tokens) == sorted(r.request_id for r in second)
    assert all(str(outputs[r.request_id].finish_reason).lower().endswith("error")
               for r in second)
    info = outputs["b0"].kv_transfer_params[KEY]
    assert info["reason"] == "beam_group" and "no decision for beam step 1" in info["error"]
    assert_scheduler_clean(scheduler)


def test_an_incomplete_group_ends_after_its_start_timeout(model_dir, monkeypatch):
    import decode_engine.beam_slots
    from connector.params import KEY
    from tests.utils import assert_scheduler_clean, make_scheduler

    monkeypatch.setattr(decode_engine.beam_slots, "START_TIMEOUT_S", 0.0)
    scheduler = make_scheduler(model_dir)
    scheduler.add_request(_slot_request(list(range(10, 50)), slot=0, width=2))
    out, outputs = _slot_step(scheduler)
    assert out.num_scheduled_tokens == {}
    info = outputs["g0"].kv_transfer_params[KEY]
    assert info["reason"] == "beam_group" and "1 of its 2 slots arrived" in info["error"]
    # The late slot does not wait for a group that has ended.
    scheduler.add_request(_slot_request(list(range(10, 50)), slot=1, width=2))
    out, outputs = _slot_step(scheduler)
    assert out.num_scheduled_tokens == {}
    assert outputs["g1"].kv_transfer_params[KEY]["reason"] == "beam_group"
    assert_scheduler_clean(scheduler)


def test_a_group_starts_only_with_blocks_for_its_first_step_and_one_too_big_ends(model_dir):
    """Each slot holds its own block from its first step: a group of 6 over a 40-token
    parent (blocks of 32: 1 shared, 1 own each: 7) waits while a running request holds 5
    of the pool's 11 blocks, and starts when it has ended; a group that needs more than
    the whole pool ends at once with the numbers (it was scheduled split before and
    failed a step later)."""
    from connector.params import KEY
    from tests.utils import BLOCK_SIZE, assert_scheduler_clean, make_scheduler

    assert BLOCK_SIZE == 32
    scheduler = make_scheduler(model_dir, num_blocks=12)
    parent = list(range(10, 50))
    # A plain request holding 5 blocks for three steps (scheduled before the group).
    hog = _plain_request(list(range(300, 450)), max_tokens=3)
    scheduler.add_request(hog)
    _slot_step(scheduler)
    group = [_slot_request(parent + [i], slot=i, width=6, steps=1) for i in range(6)]
    for req in group:
        scheduler.add_request(req)
    for _ in range(2):  # the hog decodes on; 6 slots need 7 blocks, 6 are free
        out, _ = _slot_step(scheduler)
        assert sorted(out.num_scheduled_tokens) == ["hog"], out.num_scheduled_tokens
    assert "hog" not in scheduler.requests
    result = {"completed": [], "live": [[i, [5], -1.0] for i in range(6)]}
    out, outputs = _slot_step(scheduler, {"g": {"step": 1, "parents": list(range(6)),
                                                "result": result}})
    assert sorted(out.num_scheduled_tokens) == [f"g{i}" for i in range(6)]
    assert outputs["g0"].kv_transfer_params[KEY][SLOT_KEY]["live"] == result["live"]

    wide = [_slot_request(parent + [i], group="w", slot=i, width=12, steps=1)
            for i in range(12)]
    for req in wide:
        scheduler.add_request(req)
    out, outputs = _slot_step(scheduler)
    assert out.num_scheduled_tokens == {}
    info = outputs["w0"].kv_transfer_params[KEY]
    assert "its 12 slots need 13 blocks at their first step; the pool holds 11" in info["error"]
    assert_scheduler_clean(scheduler)


def _plain_request(prompt, *, max_tokens):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from tests.utils import BLOCK_SIZE

    init_none_hash(sha256)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sampling.update_from_generation_config({}, 1)
    return Request(request_id="hog", prompt_token_ids=list(prompt), sampling_params=sampling,
                   pooling_params=None, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))


def _leader(prompt, *, group="g", members, clones, steps=2):
    """Slot 0 as the front end sends it: its spec lists the other slots to make."""
    req = _slot_request(prompt, group=group, slot=0, width=members, steps=steps)
    req.sampling_params.extra_args[SLOT_KEY]["clones"] = clones
    return req


def test_the_scheduler_makes_a_groups_slots_from_its_leader(model_dir):
    """Only slot 0 comes from the front end: the scheduler adds the others (the
    leader's prompt with each one's own last token, its own slot and score), they start
    together with it, slot 0's output carries the beams, and the made slots end with
    the group; nothing is left."""
    from connector.handoff import CLONE_SEP
    from connector.params import KEY
    from tests.utils import assert_scheduler_clean, make_scheduler

    scheduler = make_scheduler(model_dir)
    parent = list(range(10, 70))
    leader = _leader(parent + [20], members=3, clones=[[21, -1.5], [22, -2.0]], steps=1)
    scheduler.add_request(leader)
    made = [scheduler.requests[f"{leader.request_id}{CLONE_SEP}{i}"] for i in (1, 2)]
    assert [r.prompt_token_ids for r in made] == [parent + [21], parent + [22]]
    specs = [r.sampling_params.extra_args[SLOT_KEY] for r in made]
    assert [(s["slot"], s["cum"], "clones" in s) for s in specs] == [(1, -1.5, False),
                                                                      (2, -2.0, False)]
    assert len(made[0].block_hashes) == len(leader.block_hashes) == 1  # vLLM's hasher
    result = {"completed": [], "live": [[0, [5], -1.0], [1, [5], -2.0], [2, [5], -3.0]]}
    out, outputs = _slot_step(scheduler, {"g": {"step": 1, "parents": [0, 1, 2],
                                                "result": result}})
    assert sorted(out.num_scheduled_tokens) == sorted([leader.request_id]
                                                      + [r.request_id for r in made])
    assert outputs[leader.request_id].kv_transfer_params[KEY][SLOT_KEY]["live"] == \
        result["live"]
    # The made slots have no client: their outputs never leave the engine core.
    assert list(outputs) == [leader.request_id]
    assert_scheduler_clean(scheduler)


def test_a_leader_aborted_by_its_client_ends_the_slots_made_from_it(model_dir):
    """The client aborts slot 0 before its group started: the slots made from it have
    no one to answer and end in the next step (without the rule they would wait out the
    group's start timeout, holding their requests)."""
    from vllm.v1.request import RequestStatus

    from tests.utils import assert_scheduler_clean, make_scheduler

    scheduler = make_scheduler(model_dir)
    leader = _leader(list(range(10, 70)) + [20], members=4,
                     clones=[[21, -1.0], [22, -1.0], [23, -1.0]], steps=4)
    scheduler.add_request(leader)
    assert len(scheduler.requests) == 4
    scheduler.finish_requests([leader.request_id], RequestStatus.FINISHED_ABORTED)
    out, _ = _slot_step(scheduler)
    assert out.num_scheduled_tokens == {}, "a group missing its leader started"
    assert not scheduler.requests, "the made slots outlived their leader"
    assert_scheduler_clean(scheduler)


def test_the_deciding_candidates_pick_what_the_whole_list_picks():
    """``_deciding_candidates`` (the W best over the dense scores, and each row's EOS)
    against vLLM's whole list of 2W per row, through the same ``GroupSearch.select``:
    the same parents, tokens, scores and completed beams, over widths 1 to 512, rows
    fewer than W, EOS ignored or not, and vocabularies smaller than 2W. Where scores tie
    (logits rounded to halves) it declines, and the whole list decides."""
    import numpy as np

    from decode_engine.beam_processor import _candidates, _deciding_candidates
    from decode_engine.beam_search import GroupSearch

    def search(width, eos, ignore, cums):
        return GroupSearch(width=width, steps=8, eos_token_id=eos, ignore_eos=ignore,
                           cum_logprobs=cums.copy())

    g = torch.Generator().manual_seed(0)
    outcomes = {"same": 0, "declined": 0, "declined with ties": 0}
    for trial in range(120):
        width = [1, 2, 4, 32, 64, 512][trial % 6]
        vocab = [50, 1024][trial % 2]
        rows = min(width, [1, width, max(1, width // 2)][trial % 3])
        logits = torch.randn(rows, vocab, generator=g) * (1 + trial % 4)
        tied = trial % 5 == 0
        if tied:
            logits = (logits * 2).round() / 2
        cums = -np.abs(np.random.default_rng(trial).normal(size=rows)) * (trial % 3)
        eos, ignore = [None, EOS, 7][trial % 3], trial % 7 == 0
        fast, full = search(width, eos, ignore, cums), search(width, eos, ignore, cums)
        deciding = _deciding_candidates(logits, fast)
        if deciding is None:
            outcomes["declined with ties" if tied else "declined"] += 1
            continue
        got, want = fast.select(deciding), full.select(_candidates(logits, width))
        assert [a.tolist() for a in got] == [a.tolist() for a in want], trial
        assert fast.cum_logprobs.tolist() == full.cum_logprobs.tolist(), trial
        assert [f.to_wire() for f in fast.completed] == [f.to_wire() for f in full.completed]
        outcomes["same"] += 1
    assert outcomes["same"] >= 90 and outcomes["declined"] == 0, outcomes
    assert outcomes["declined with ties"] >= 10, outcomes
    # A NaN logit (its row's logprobs all NaN) declines too, at every width.
    for width, vocab in ((4, 1024), (512, 1024), (64, 50)):
        logits = torch.randn(3, vocab, generator=g)
        logits[1, 7] = float("nan")
        assert _deciding_candidates(logits, search(width, EOS, False, np.zeros(3))) is None


@pytest.mark.parametrize("parent_len", [60, 63, 64, 95])
def test_a_made_slot_copies_its_leaders_block_hashes_and_goes_on_as_vllm_would(parent_len):
    """The slots made from a leader reuse its hashes of the full blocks before their
    own last token: each slot's hashes equal vLLM's hasher's over its own prompt (a
    last token inside a partial block, or completing a full one), and stay equal as it
    decodes; a catalog slot (the leader's own prompt) the same."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from decode_engine.beam_slots import SlotGroups
    from tests.utils import BLOCK_SIZE

    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    parent = list(range(10, 10 + parent_len))
    leader = _leader(parent + [20], members=3, clones=[[21, -1.5], [None, -2.0]])
    made = SlotGroups(BLOCK_SIZE, lambda *a: None, hasher).add(leader)

    def fresh(tokens):
        return Request("x", list(tokens), leader.sampling_params, None,
                       block_hasher=hasher).block_hashes

    assert [r.prompt_token_ids for r in made] == [parent + [21], parent + [20]]
    for slot in made:
        assert slot.block_hashes == fresh(slot.prompt_token_ids)
        for token in range(BLOCK_SIZE + 3):  # decoding into the next blocks
            slot.append_output_token_ids(token)
        assert slot.block_hashes == fresh(slot.all_token_ids)
    assert len(made[0].block_hashes) >= (parent_len + 1) // BLOCK_SIZE


def test_a_beams_first_child_stays_in_its_parents_slot():
    """New beams whose parents sit in slots 0, 0, 1, 3 (of 5): the first child of each
    stays (nothing to copy), the second of slot 0 takes the lowest slot no child took;
    the slots' sources ask for that one copy only."""
    import numpy as np

    from decode_engine.beam_processor import place_beams

    slots = place_beams(np.array([0, 0, 1, 3]), 5)
    assert slots.tolist() == [0, 2, 1, 3]
    source = np.arange(5)
    source[slots] = [0, 0, 1, 3]
    assert [s for s in range(5) if source[s] != s] == [2]
    assert place_beams(np.array([2, 2, 2]), 3).tolist() == [2, 0, 1]
    assert place_beams(np.array([], dtype=np.int64), 3).tolist() == []


def test_a_group_that_never_gets_room_ends_as_a_retryable_refusal(model_dir, monkeypatch):
    """Every slot arrived but the group's W sequences never fit (here W=32 over a
    scheduler of 16): it ends with reason ``beam_room``, RESOURCE_EXHAUSTED for its
    client (retry later), not ``beam_group``'s INTERNAL."""
    import grpc

    import decode_engine.beam_slots
    from connector.params import KEY
    from kvhandoff.errors import status_for
    from kvhandoff.types import StageError
    from tests.utils import assert_scheduler_clean, make_scheduler

    monkeypatch.setattr(decode_engine.beam_slots, "START_TIMEOUT_S", 0.0)
    scheduler = make_scheduler(model_dir)
    for slot in range(32):
        scheduler.add_request(_slot_request(list(range(10, 50)), slot=slot, width=32))
    out, outputs = _slot_step(scheduler)
    assert out.num_scheduled_tokens == {}
    info = outputs["g0"].kv_transfer_params[KEY]
    assert info["reason"] == "beam_room" and "no room for its 32 slots" in info["error"]
    code, _ = status_for(StageError("stage2", info["reason"], info["error"]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_scheduler_clean(scheduler)
