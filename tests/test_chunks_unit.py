"""The chunk registry's rules over a fake P (no engines; ``router.chunks``): the share
and what is evicted for room, a Release that failed sent again, a registration that
failed leaving nothing held, and the chains a composition accepts. The end-to-end
behaviour (held blocks read after a flush, identity, pools) is tests/test_chunks.py."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from kvhandoff.types import InvalidRequest
from kvhandoff.v1 import engine_pb2
from router import RouterError
from router.requests import ChunkCall

pytestmark = pytest.mark.chunks

BLOCK = 32


class FakeP:
    """GetCapacity, Stage1 (a finished, held event) and Release, recorded."""

    def __init__(self, total_blocks: int = 100):
        self.total_blocks = total_blocks
        self.stage1s: list[engine_pb2.Stage1Request] = []
        self.released: list[list[str]] = []
        self.prefixes: list[str] = []
        self.fail_release = False
        self.fail_stage1 = False
        self.engine_id = "p-1"

    async def GetCapacity(self, request, timeout=None):  # noqa: N802 (the rpc's name)
        return engine_pb2.Capacity(num_free_blocks=self.total_blocks,
                                   num_total_blocks=self.total_blocks, block_size=BLOCK,
                                   max_model_len=4096, vocab_size=1000,
                                   engine_id=self.engine_id)

    def Stage1(self, request, timeout=None):  # noqa: N802
        self.stage1s.append(request)
        fail, engine_id = self.fail_stage1, self.engine_id

        class Stream:
            def cancel(self):
                pass

            async def __aiter__(self):
                if fail:
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE,
                                               grpc.aio.Metadata(), grpc.aio.Metadata(),
                                               "P went away")
                yield engine_pb2.Stage1Event(new_token_ids=[7], finish_reason="length",
                                             held_until=math.inf, engine_id=engine_id,
                                             num_computed_tokens=len(request.prompt_token_ids))

        return Stream()

    async def Release(self, request, timeout=None):  # noqa: N802
        if self.fail_release:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "P went away")
        if request.request_ids:
            self.released.append(list(request.request_ids))
        self.prefixes.extend(request.prefixes)
        return engine_pb2.ReleaseResponse()


def _router(model_dir: str, share: float = 0.25):
    from router import Endpoint, Router, RouterConfig

    config = RouterConfig(prefill=("p",), decode=(), model=model_dir, warm_up=False,
                          chunk_pool_share=share)
    router = Router(config, endpoints=([Endpoint("p", FakeP(), None)], []))
    asyncio.run(router.refresh_capacity())
    return router


def _register(router, name: str, blocks: int, under: str = "", **kw):
    tokens = [10 + i % 900 for i in range(blocks * BLOCK)]
    return asyncio.run(router.chunks.register(ChunkCall(tokens, name, under, **kw), None))


def _status(call) -> grpc.StatusCode:
    with pytest.raises(RouterError) as e:
        call()
    return e.value.code


def test_a_chunk_larger_than_the_share_is_refused_before_p_runs_anything(model_dir):
    router = _router(model_dir)  # 25 of P's 100 blocks
    p = router.prefill[0].stub
    # It never fits: not a retry's to fix (RESOURCE_EXHAUSTED would say retry).
    assert _status(lambda: _register(router, "big", 26)) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(InvalidRequest, match="only the 'stale' fault"):
        _register(router, "x", 1, fault="zero-block")
    assert not p.stage1s and not router.chunks.records()
    assert _register(router, "fits", 25).num_blocks == 25
    assert p.stage1s[0].pin and p.stage1s[0].hold and not p.stage1s[0].export


def test_room_is_made_from_least_recently_used_leaves_never_a_chain_in_use(model_dir):
    router = _router(model_dir)
    p = router.prefill[0].stub
    _register(router, "root", 5)
    _register(router, "under", 5, under="root")  # 10 tokens' blocks beyond root: 5
    _register(router, "old", 5)
    _register(router, "new", 5)
    with router.chunks.using(("root", "under")):
        # 20 of 25 held; 10 more: "old", the least recently used leaf, goes; never
        # "root" (a chunk is under it) nor "under" (in use).
        _register(router, "next", 10)
    assert sorted(r.chunk_id for r in router.chunks.records()) == [
        "new", "next", "root", "under"]
    assert [n.split("-", 3)[3] for n in p.released[-1]] == ["old"]
    assert router.chunks.evictions == 1
    with router.chunks.using(("root", "under", "new")), router.chunks.using(("next",)):
        # Only chunks in use or with chunks under them are left: refused, nothing more
        # held, nothing released.
        assert _status(lambda: _register(router, "more", 10)) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
    assert router.chunks.held_blocks(router.prefill[0]) == 25 and len(p.released) == 1


def test_one_name_registered_at_once_twice_is_one_chunk_after_the_start_holds(model_dir):
    """Registrations wait while an earlier run's leftovers are released (the router's
    start); two of one name waiting there give one chunk and ALREADY_EXISTS, and P
    prefilled only the one."""
    router = _router(model_dir)
    p = router.prefill[0].stub
    router.chunks.hold_registrations()

    async def both():
        calls = [asyncio.create_task(router.chunks.register(
            ChunkCall([10 + i for i in range(64)], "same"), None)) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert not p.stage1s, "a registration ran before the leftovers were released"
        await router.chunks.release_leftovers()
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(both())
    refused = [r for r in results if isinstance(r, RouterError)]
    assert len(refused) == 1 and refused[0].code == grpc.StatusCode.ALREADY_EXISTS
    assert [r.chunk_id for r in router.chunks.records()] == ["same"] and len(p.stage1s) == 1
    assert p.prefixes == ["chunk-default-"]


def test_a_failed_release_is_sent_again_and_a_failed_registration_holds_nothing(model_dir):
    router = _router(model_dir)
    p = router.prefill[0].stub
    _register(router, "a", 3)
    _register(router, "z", 2)
    p.fail_release = True
    for name in ("a", "z"):
        with pytest.raises(grpc.aio.AioRpcError):
            asyncio.run(router.chunks.delete(name))
    assert not router.chunks.records()  # forgotten: never composed again
    # ... but counted against the share while P still holds them.
    assert router.chunks.held_blocks(router.prefill[0]) == 5
    p.fail_release, p.fail_stage1 = False, True
    with pytest.raises(grpc.aio.AioRpcError):
        _register(router, "b", 3)
    # The failed registration's Release carries "a" and "z", whose Releases failed before.
    assert [n.split("-", 3)[3] for names in p.released for n in names] == ["a", "z", "b"]
    assert not router.chunks.records() and router.chunks.held_blocks(router.prefill[0]) == 0
    # The failed registration is named once more with the next release on its P (its
    # prefill may have finished on P after the first Release reached it).
    p.fail_stage1 = False
    _register(router, "c", 1)
    asyncio.run(router.chunks.delete("c"))
    # (by engine: "b" never reached P's answer, so it has no engine id)
    assert [n.split("-", 3)[3] for names in p.released[-2:] for n in names] == ["b", "c"]


def test_a_composition_must_be_a_registered_chain_from_its_root_under_its_adapter(
        model_dir):
    router = _router(model_dir)
    _register(router, "sys", 2)
    _register(router, "hist", 2, under="sys")
    _register(router, "other", 2)
    chain = router.chunks.compose(("sys", "hist"), "")
    assert chain.prefix_ids == router.chunks.get("hist").chain_ids
    assert len(chain.prefix_ids) == 4 * BLOCK
    for ids, adapter, code in ((("hist",), "", grpc.StatusCode.FAILED_PRECONDITION),
                               (("sys", "other"), "", grpc.StatusCode.FAILED_PRECONDITION),
                               (("sys", "hist"), "x", grpc.StatusCode.FAILED_PRECONDITION),
                               (("sys", "gone"), "", grpc.StatusCode.NOT_FOUND)):
        assert _status(lambda ids=ids, adapter=adapter: router.chunks.compose(ids, adapter)) \
            == code, ids
    assert asyncio.run(router.chunks.delete("sys")) == ["sys", "hist"]
    assert [r.chunk_id for r in router.chunks.records()] == ["other"]


def test_a_started_router_releases_the_chunks_its_namespace_left_on_every_p(model_dir):
    """A router's registry dies with it, P's pins do not: at its start it releases every
    hold named under its namespace (``router.main`` calls this once the engines
    answer), and only those: another namespace's are other routers'."""
    router = _router(model_dir)
    p = router.prefill[0].stub
    assert _register(router, "a", 2).held_name.startswith("chunk-default-")
    asyncio.run(router.chunks.release_leftovers())
    assert p.prefixes == ["chunk-default-"]


@pytest.mark.parametrize("one_engine", [True, False], ids=["engine", "serve-replicas"])
def test_chunks_go_with_their_p_when_it_restarts(model_dir, one_engine):
    """A P that restarted (its engine id changed) lost its pins: its chunks are
    forgotten, uncounted, and a request naming one is NOT_FOUND. The control: an
    endpoint standing for several engines (Serve's replicas answer with their own ids)
    keeps them."""
    router = _router(model_dir)
    ep = router.prefill[0]
    ep.one_engine = one_engine
    _register(router, "sys", 2)
    _register(router, "hist", 2, under="sys")
    ep.stub.engine_id = "p-2"
    asyncio.run(router.refresh_capacity())
    if one_engine:
        assert not router.chunks.records() and router.chunks.held_blocks(ep) == 0
        assert _status(lambda: router.chunks.compose(("sys", "hist"), "")) == \
            grpc.StatusCode.NOT_FOUND
        assert router.chunks.lost == 2
    else:
        assert [r.chunk_id for r in router.chunks.records()] == ["sys", "hist"]
        assert router.chunks.compose(("sys", "hist"), "").prefill is ep
