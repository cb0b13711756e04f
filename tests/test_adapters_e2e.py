"""LoRA adapters through the router, end to end: P, D and the router as `kvhandoff serve`
processes, P and D serving the built-in adapters a and b (``--adapter a=builtin:1``).
A request under an adapter is placed on engines that serve it and hands its KV off
under it (equal to the same request colocated under it); a parent's continuation
inherits its adapter and one that names another is refused; the OpenAI front reads
``model`` as vLLM does (the base model or an adapter). The server-level negative
control: D's Stage2 refuses an export under a for a stage 2 under b (INVALID_ARGUMENT),
and a D made to skip that check answers beams that are not b's."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvhandoff.v1 import engine_pb2, router_pb2, router_pb2_grpc
from tests.conftest import engine_stub
from tests.utils import assert_identical
from tools.client import RouterClient, make_request

pytestmark = [pytest.mark.engines, pytest.mark.fleet, pytest.mark.timeout(900)]

PROMPT = list(range(40, 200))


@pytest.fixture(scope="module")
def lora_cluster(model_dir, tmp_path_factory):
    from kvhandoff.ports import free_port
    from tools.launch import local_cluster

    http_port = free_port()
    with local_cluster(model_dir, tmp_path_factory.mktemp("lora-logs"), decode_mib=24,
                       prefill_mib=32, lease_s=20,
                       engine_flags=("--fault-injection", "--adapter", "a=builtin:1",
                                     "--adapter", "b=builtin:2"),
                       router_flags=("--http-port", str(http_port))) as cluster:
        yield {**cluster, "http": f"http://127.0.0.1:{http_port}"}


def _generate(cluster, adapter: str, path: str, **kw):
    req = make_request(prompt=PROMPT, max_tokens=12, seed=7, beam_width=4, path=path, **kw)
    req.adapter = adapter
    with RouterClient(cluster["router"]) as client:
        return client.generate(req, timeout=300)


def test_a_request_under_an_adapter_hands_off_under_it(lora_cluster):
    """Under a: the handoff equals the same request colocated under a, and differs from
    the base model's (the adapter ran). The engines say what they serve."""
    cap = engine_stub(lora_cluster["decode"][0].address).GetCapacity(
        engine_pb2.CapacityRequest(), timeout=10)
    assert sorted(a.name for a in cap.adapters) == ["a", "b"]
    assert all(len(a.digest) == 64 for a in cap.adapters)
    got = _generate(lora_cluster, "a", "handoff")
    ref = _generate(lora_cluster, "a", "colocated")
    assert_identical(got, ref)
    base = _generate(lora_cluster, "", "colocated")
    assert [list(b.token_ids) for b in base.beams] != [list(b.token_ids) for b in got.beams] \
        or list(base.thinking_token_ids) != list(got.thinking_token_ids)


def test_an_adapter_no_engine_serves_is_not_found(lora_cluster):
    with pytest.raises(grpc.RpcError) as e:
        _generate(lora_cluster, "zzz", "handoff")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no prefill engine has adapter 'zzz' (theirs: a, b" in e.value.details()


def test_a_continuation_inherits_its_parents_adapter_and_may_not_name_another(
        lora_cluster):
    channel = grpc.insecure_channel(lora_cluster["router"])
    stub = router_pb2_grpc.RouterStub(channel)
    try:
        parent_req = router_pb2.ParentRequest(request_id="lora-parent", adapter="a")
        parent_req.prompt_token_ids.ids.extend(PROMPT)
        parent_req.stage1.max_tokens, parent_req.stage1.seed = 12, 7
        parent = [e.parent for e in stub.StartParent(parent_req, timeout=300)
                  if e.HasField("parent")][0]
        assert parent.adapter == "a" and parent.held, parent
        cont = router_pb2.ContinueRequest(parent_id=parent.parent_id, strict=True)
        cont.beam.beam_width, cont.beam.max_tokens = 4, 3
        got = stub.Continue(cont, timeout=300)
        ref = _generate(lora_cluster, "a", "colocated")
        # D holds most of the parent already (the first test's request under a, same
        # seed): it reads the rest. Its cached blocks are a's: they carry the adapter.
        assert_identical(got, ref, found_on_d=True)
        cont.adapter = "b"
        with pytest.raises(grpc.RpcError) as e:
            stub.Continue(cont, timeout=60)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "ran under adapter 'a', not adapter 'b'" in e.value.details()
        stub.ReleaseParent(router_pb2.ReleaseParentRequest(parent_id=parent.parent_id),
                           timeout=30)
    finally:
        channel.close()


def test_the_openai_front_reads_model_as_the_base_or_an_adapter(lora_cluster):
    """With OpenAI's own client: the adapters are listed as models whose parent is the
    base (as vLLM lists LoRA modules); ``model="a"`` runs stage 1 under a (its tokens
    are the gRPC request's under a), and its continuation named as the base model is
    refused (412) while one that leaves model out runs under a, labelled so; an unknown
    model is a 400 that names them."""
    import openai

    client = openai.OpenAI(base_url=lora_cluster["http"] + "/v1", api_key="unused",
                           max_retries=0)
    models = client.models.list().data
    assert [m.id for m in models][1:] == ["a", "b"]
    assert all(m.model_extra["parent"] == models[0].id for m in models[1:])
    out = client.completions.create(model="a", prompt=PROMPT, max_tokens=12,
                                    temperature=1.0, seed=7)
    assert out.model == "a"
    # Its continuation: named as the base model, refused (it would run under a, labelled
    # the base); with model left out, it inherits a and says so.
    beams = {"continuation_of": out.id, "use_beam_search": True}
    with pytest.raises(openai.APIStatusError) as base:
        client.completions.create(model=models[0].id, prompt="", max_tokens=2, n=2,
                                  extra_body=beams)
    assert base.value.status_code == 412 and "adapter 'a'" in str(base.value), base.value
    inherited = client.completions.create(model="", prompt="", max_tokens=2, n=2,
                                          extra_body=beams)
    assert inherited.model == "a" and len(inherited.choices) == 2
    with RouterClient(lora_cluster["router"]) as grpc_client:
        grpc_client.release_parent(out.id)
    ref = _generate(lora_cluster, "a", "colocated")
    assert out.choices[0].model_extra["token_ids"] == list(ref.thinking_token_ids)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="zzz", prompt=PROMPT, max_tokens=4)
    assert "the adapters ['a', 'b']" in str(bad.value), bad.value


def test_d_refuses_an_export_under_another_adapter_and_the_fault_shows_why(lora_cluster,
                                                                          model_dir):
    """Straight to the engines' gRPC: P exports under a; D's Stage2 under b is refused
    INVALID_ARGUMENT before any READ. With the fault that skips the check (negative
    control) D imports a's KV and answers beams that are not b's: those of the same
    stage 2 under b from token ids."""
    from kvhandoff.model import ModelTokens

    suffix = list(ModelTokens.load(Path(model_dir)).default_suffix_ids)
    p = engine_stub(lora_cluster["prefill"].address)
    d = engine_stub(lora_cluster["decode"][0].address)
    target = d.GetCapacity(engine_pb2.CapacityRequest(), timeout=10).handoff_target

    def export(name: str):
        req = engine_pb2.Stage1Request(request_id=name, prompt_token_ids=PROMPT,
                                       export=True, target_engine_id=target, adapter="a")
        req.sampling.max_tokens, req.sampling.temperature = 8, 0.0
        events = list(p.Stage1(req, timeout=120))
        thinking = [t for e in events for t in e.new_token_ids]
        return events[-1].handoff, PROMPT + thinking + suffix

    def stage2(name: str, prompt, handoff=None, fault=""):
        req = engine_pb2.Stage2Request(request_id=name, prompt_token_ids=prompt,
                                       adapter="b", fault=fault)
        req.beam.beam_width, req.beam.max_tokens = 4, 3
        if handoff is not None:
            req.handoff.CopyFrom(handoff)
        return d.Stage2(req, timeout=120)

    handoff, prompt = export("x-refused")
    with pytest.raises(grpc.RpcError) as e:
        stage2("x-refused-d", prompt, handoff)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "computed under adapter 'a' and this request runs under adapter 'b'" \
        in e.value.details()
    handoff, prompt = export("x-accepted")
    wrong = stage2("x-accepted-d", prompt, handoff, fault="accept-any-adapter")
    assert wrong.num_imported_tokens > 0
    right = stage2("x-from-ids", prompt)
    assert [(list(b.token_ids), round(b.cum_logprob, 4)) for b in wrong.beams] != \
        [(list(b.token_ids), round(b.cum_logprob, 4)) for b in right.beams]


def test_the_routers_prefix_index_keeps_adapters_apart(lora_cluster):
    """From the engines' own KV events (vLLM's BlockStored carries the adapter): once P
    stored a prompt's blocks under a, the next request under a is placed on a P holding
    them; the same prompt under the base model holds none (they are a's), until a base
    request stored its own (the control: the index answers for the base model too)."""
    import time

    from tests.utils import metric_sum

    url = lora_cluster["router_metrics"]
    prompt = list(range(300, 700))  # 12 full blocks, no other test's

    def hits() -> float:
        return metric_sum(url, "kvhandoff_router_placement_hit_blocks_total",
                          role="prefill")

    def generate(adapter: str) -> None:
        req = make_request(prompt=prompt, max_tokens=2, seed=1, beam_width=1,
                           path="colocated")
        req.adapter = adapter
        with RouterClient(lora_cluster["router"]) as client:
            client.generate(req, timeout=300)

    def until_hit(adapter: str) -> float:
        before, deadline = hits(), time.monotonic() + 30
        while hits() == before:
            assert time.monotonic() < deadline, f"no prefill hit under {adapter!r}"
            generate(adapter)  # the events of the one before have arrived, or not yet
            time.sleep(0.5)
        return hits() - before

    generate("a")
    assert until_hit("a") >= 12
    before = hits()
    generate("")
    assert hits() == before, "a's blocks counted for the base model"
    assert until_hit("") >= 12


def test_nothing_is_left_held(lora_cluster):
    """After every test above (refusals, the fault, a released parent): no block held
    and no request on either engine (within the lease and the reaping after it)."""
    from tests.utils import assert_servers_clean

    assert_servers_clean([lora_cluster["prefill"], *lora_cluster["decode"]], 2 * 20 + 5)
