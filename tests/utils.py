"""Builders shared by the tests: a real vLLM Scheduler with no model, handoff params."""

from __future__ import annotations

import time
from typing import Any

from connector.handoff import PROTOCOL_VERSION, ImportRequest, token_digest
from connector.params import KEY

BLOCK_SIZE = 32
P_ENGINE_ID = "prefill-test"


def make_vllm_config(model_dir: str, *, kv_role: str = "kv_consumer", lease_s: int = 30,
                     max_num_batched_tokens: int = 4096,
                     extra_config: dict[str, Any] | None = None):
    import torch  # noqa: F401  (vLLM's config imports expect torch loaded)
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(model=model_dir, dtype="float32", seed=0)
    scheduler_config = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=4096,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    cache_config.kv_cache_layout = "LBHNC"
    kv_transfer = KVTransferConfig(
        kv_connector="ContinuationConnector",
        kv_connector_module_path="connector.nixl_continuation",
        kv_role=kv_role,
        engine_id="decode-test",
        kv_connector_extra_config={"kv_lease_duration": lease_s, **(extra_config or {})},
    )
    return VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                      cache_config=cache_config, kv_transfer_config=kv_transfer,
                      device_config=DeviceConfig("cpu"))


def make_scheduler(model_dir: str, *, num_blocks: int = 200, prefill: bool = False,
                   **config_kwargs: Any):
    """A real ContinuationScheduler (D's; ``prefill``: P's PrefillScheduler) with our
    connector over a fake KV layout."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    from decode_engine.scheduler import ContinuationScheduler
    from prefill_engine.scheduler import PrefillScheduler

    if prefill:
        config_kwargs.setdefault("kv_role", "kv_producer")
    vllm_config = make_vllm_config(model_dir, **config_kwargs)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(
            ["layer"],
            FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1,
                              dtype=torch.float32),
        )],
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return (PrefillScheduler if prefill else ContinuationScheduler)(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


def make_export_params(parent_ids: list[int], *, model_fingerprint: str,
                       lease_s: float = 30.0, **overrides: Any) -> dict[str, Any]:
    """What P's connector returns for a finished stage 1 over ``parent_ids``."""
    num_computed = len(parent_ids) - 1
    num_blocks = -(-num_computed // BLOCK_SIZE)
    now = time.time()
    fields = {
        "protocol_version": PROTOCOL_VERSION,
        "model_fingerprint": model_fingerprint,
        "engine_id": P_ENGINE_ID,
        "request_id": "stage1-req",
        "num_parent_tokens": len(parent_ids),
        "num_computed_tokens": num_computed,
        "token_digest": token_digest(parent_ids),
        "block_size": BLOCK_SIZE,
        "num_blocks": num_blocks,
        "kv_bytes_per_block": 8 * BLOCK_SIZE,
        "exported_at": now,
        "lease_expires_at": now + lease_s,
        "adapter": "",
        "adapter_digest": "",
        "cache_salt": "",
        "num_pool_blocks": 1000,
        **overrides,
    }
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(range(100, 100 + num_blocks))],
        "remote_engine_id": P_ENGINE_ID,
        "remote_request_id": "stage1-req",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "tp_size": 1,
        "remote_num_tokens": num_computed,
        "remote_blocks_expiry_time": time.perf_counter() + lease_s,
        KEY: fields,
    }


def make_import_request(prompt_ids: list[int], export_params: dict[str, Any], *,
                        request_id: str = "import-1", beam_width: int = 4,
                        beam_max_tokens: int = 3):
    """D's step-0 request: prompt = parent + suffix, carrying the handoff."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sampling = SamplingParams(max_tokens=1, logprobs=2 * beam_width)
    sampling.update_from_generation_config({}, 1)
    req = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_ids),
        sampling_params=sampling,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    req.kv_transfer_params = ImportRequest(
        export_params, beam_width=beam_width, beam_max_tokens=beam_max_tokens
    ).to_params()
    return req


def assert_scheduler_clean(scheduler) -> None:
    """No request, no held block (cached blocks are free)."""
    pool = scheduler.kv_cache_manager.block_pool
    assert not scheduler.requests, f"requests left: {list(scheduler.requests)}"
    assert len(scheduler.waiting) == 0 and len(scheduler.running) == 0
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, "blocks leaked"


def make_request(pair, *, request_id: str = "req", prompt_len: int = 40, prompt_seed: int = 0,
                 stage1: dict[str, Any] | None = None, beam: dict[str, Any] | None = None,
                 prompt_token_ids: list[int] | None = None,
                 suffix_token_ids: list[int] | None = None):
    """A two-stage request on the built-in model with keyword overrides."""
    import random

    from kvhandoff.types import BeamParams, Stage1Params
    from tools.pipeline import TwoStageRequest

    rng = random.Random(f"{request_id}/{prompt_seed}")
    prompt = prompt_token_ids if prompt_token_ids is not None else [
        rng.randrange(6, pair.p.vocab_size) for _ in range(prompt_len)]
    return TwoStageRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        suffix_token_ids=pair.default_suffix_ids if suffix_token_ids is None else suffix_token_ids,
        stage1=Stage1Params(**{"max_tokens": 16, "temperature": 1.0, "seed": 1,
                               "stop_token_ids": (pair.think_end_id,), **(stage1 or {})}),
        beam=BeamParams(**{"beam_width": 4, "max_tokens": 3, **(beam or {})}),
        think_end_id=pair.think_end_id,
    )


def assert_handed_off(resp: Any, *, found_on_d: bool = False) -> None:
    """A router response whose stage 2 really imported the parent (not the recompute
    fallback): every test whose subject is not the fallback calls this. With
    ``found_on_d`` D may already hold some of the parent's blocks (an earlier request
    with the same prompt), so it imports only the rest (nothing, where it holds them all)."""
    s = resp.stats
    assert not s.recomputed, f"handoff recomputed: {s.handoff_failure}"
    if found_on_d:  # imports what D's cache lacks: nothing where it holds the whole parent
        assert 0 <= s.num_imported_tokens <= s.num_parent_tokens - 1, s
        assert s.num_imported_tokens or s.num_found_on_d_tokens == s.num_parent_tokens - 1, s
    else:
        assert s.num_imported_tokens == s.num_parent_tokens - 1, s
    assert s.num_computed_tokens_first_step == len(resp.suffix_token_ids) + 1, s


def assert_identical(got: Any, ref: Any, *, found_on_d: bool = False,
                     imported: bool = True, recomputed_for: str | None = None) -> None:
    """``got``, a router response whose stage 2 imported its parent, equals ``ref``, one
    that is asserted to have run colocated on one engine: stage 1's tokens, the beams'
    token ids in order, and their cumulative logprobs within the harness's bound
    (``LOGPROB_TOLERANCE``). The one identity check of the end-to-end tests; each path
    that uses it has a negative control (a fault injected through it) that fails it.
    ``imported`` False: stage 2 read no handoff (its stage 1 was moved to D or never
    left P); only "not recomputed" is asserted of the path. ``recomputed_for``: the test
    caused the handoff to fail on purpose; ``got`` must be the recompute, flagged with a
    reason that contains this text (a recompute for any other reason fails)."""
    from kvhandoff.v1 import common_pb2
    from tools.harness import LOGPROB_TOLERANCE

    assert ref.stats.path == common_pb2.PATH_COLOCATED and not ref.stats.decode_endpoint, \
        f"the reference did not run colocated: {ref.stats}"
    if recomputed_for is not None:
        assert got.stats.recomputed, f"not recomputed: {got.stats}"
        assert recomputed_for in got.stats.handoff_failure, \
            f"recomputed for {got.stats.handoff_failure!r}, not {recomputed_for!r}"
    elif imported:
        assert_handed_off(got, found_on_d=found_on_d)
    else:  # stage 1 moved to D, or finished on P (checked by the caller): no handoff
        assert not got.stats.recomputed, f"recomputed: {got.stats.handoff_failure}"
    assert list(got.thinking_token_ids) == list(ref.thinking_token_ids), "stage 1 differs"
    assert [list(b.token_ids) for b in got.beams] == [list(b.token_ids) for b in ref.beams], \
        "beams differ"
    for i, (a, b) in enumerate(zip(got.beams, ref.beams)):
        assert abs(a.cum_logprob - b.cum_logprob) <= LOGPROB_TOLERANCE, \
            f"beam {i}: cum_logprob {a.cum_logprob} vs {b.cum_logprob} (colocated)"


def assert_http_identical(stage1: Any, beams: Any, ref: Any, *,
                          found_on_d: bool = False, moved: bool = False) -> None:
    """:func:`assert_identical` for the HTTP front: ``stage1`` (a completion: the parent)
    and ``beams`` (its continuation with ``use_beam_search``), both as the ``openai``
    client returns them, against ``ref``, a gRPC response that ran colocated. ``moved``:
    its beam search was moved to another D (its import counts are that D's resume's:
    not checked)."""
    from kvhandoff.v1 import common_pb2
    from tools.harness import LOGPROB_TOLERANCE

    assert ref.stats.path == common_pb2.PATH_COLOCATED and not ref.stats.decode_endpoint, \
        f"the reference did not run colocated: {ref.stats}"
    info, details = beams.model_extra["kvhandoff"], beams.usage.prompt_tokens_details
    assert not info["recomputed"], f"handoff recomputed: {info['handoff_failure']}"
    thinking = stage1.choices[0].model_extra["token_ids"]
    num_parent = len(ref.prompt_token_ids) + len(thinking)
    if moved:
        assert info["moves"], "the search was not moved"
    elif found_on_d:
        assert 0 < details.model_extra["imported_tokens"] <= num_parent - 1, details
    else:
        assert details.model_extra["imported_tokens"] == num_parent - 1, details
    if not moved:
        assert details.model_extra["computed_tokens"] == len(ref.suffix_token_ids) + 1, \
            details
    assert thinking == list(ref.thinking_token_ids), "stage 1 differs"
    assert [c.model_extra["token_ids"] for c in beams.choices] == \
        [list(b.token_ids) for b in ref.beams], "beams differ"
    for i, (c, b) in enumerate(zip(beams.choices, ref.beams)):
        got = c.model_extra["cumulative_logprob"]
        assert abs(got - b.cum_logprob) <= LOGPROB_TOLERANCE, \
            f"beam {i}: cum_logprob {got} vs {b.cum_logprob} (colocated)"


def assert_idle_within(servers: list, seconds: float = 2.5) -> None:
    """No request running or waiting on any of ``servers`` within ``seconds``: what a
    cancel or a deadline must do to the engines (an export P holds under its lease may
    keep blocks a while longer; pools are checked clean separately)."""
    from tools.launch import pool_state

    deadline = time.monotonic() + seconds
    for server in servers:
        while True:
            _, cap = pool_state(server.address)
            if not cap.num_running_reqs and not cap.num_waiting_reqs:
                break
            assert time.monotonic() < deadline, (
                f"{server.role} {server.address} still runs {cap.num_running_reqs} and "
                f"queues {cap.num_waiting_reqs} requests {seconds:g}s after the cancel")
            time.sleep(0.05)


def scrape_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """A Prometheus endpoint's samples: (name, sorted labels) -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(value for (n, sample_labels), value in scrape_metrics(url).items()
               if n == name and set(labels.items()) <= set(sample_labels))


def in_this_netns(pid: int) -> bool:
    """Whether process ``pid`` shares this process's network namespace: the Ray tests of
    the two lanes tell their processes apart by it (the two-node cluster runs on hosts of
    its own, tools/netns; the other Serve tests on this one). False once it is gone."""
    import os

    try:
        return os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
    except OSError:
        return False


def long_stage1_request(prompt: str | list[int], num_tokens: int, **kwargs: Any):
    """A router request whose stage 1 samples exactly ``num_tokens`` tokens
    (min_tokens = max_tokens: neither EOS nor ``</think>`` ends it early)."""
    from tools.client import make_request

    req = make_request(prompt=prompt, max_tokens=num_tokens, **kwargs)
    req.stage1.min_tokens = num_tokens
    return req


def assert_servers_clean(servers: list, timeout_s: float) -> None:
    """Every engine server's pool ends with no block held and no request (running,
    waiting or reserved), within ``timeout_s`` each: the one clean-pool check of the
    tests that run engine servers (the in-process pair's is ``PoolSnapshot.is_clean``)."""
    from tools.launch import wait_pool_clean

    for server in servers:
        clean, cap = wait_pool_clean(server.address, timeout_s)
        assert clean, f"{server.role} {server.address} not clean: {cap}"


class HeldParents:
    """Parents tests started on shared routers, given back with Router.ReleaseParent at
    the test's end, so P's pool is clean at once instead of at its lease's end (the
    clean-pool check after it still waits for anything not given back)."""

    def __init__(self) -> None:
        self._held: list[tuple[str, str]] = []

    def add(self, router: str, parent_id: str) -> None:
        self._held.append((router, parent_id))

    def release_all(self) -> None:
        """Release each; one the router forgot (evicted, expired, released by the test)
        or still uses is left to its lease."""
        import grpc

        from tools.client import RouterClient

        held, self._held = self._held, []
        for router, parent_id in held:
            with RouterClient(router) as client:
                try:
                    client.release_parent(parent_id)
                except grpc.RpcError as e:
                    if e.code() not in (grpc.StatusCode.NOT_FOUND,
                                        grpc.StatusCode.FAILED_PRECONDITION):
                        raise


#: The family's parents, released by its clean-pool fixtures.
HELD_PARENTS = HeldParents()


def model_output(finished_recving=None):
    """An empty step's output from the workers, with the READs that finished."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    return ModelRunnerOutput(
        req_ids=[], req_id_to_index={},
        kv_connector_output=KVConnectorOutput(finished_recving=finished_recving or set()),
    )


def schedule_and_collect(scheduler):
    """One scheduler step with no model: what was scheduled and the outputs."""
    out = scheduler.schedule()
    engine_outputs = scheduler.update_from_output(out, model_output())
    return out, [o for eco in engine_outputs.values() for o in eco.outputs]


def reject_at_admission(scheduler, req, *, notify_p=True):
    """Add ``req``; D's admission must refuse it in the same step (and tell P to
    release, unless the handoff was unverified). Returns the refusal's fields."""
    scheduler.add_request(req)
    out, outputs = schedule_and_collect(scheduler)
    assert out.num_scheduled_tokens == {}, "a rejected request must not be scheduled"
    (result,) = outputs
    assert result.finish_reason is not None and str(result.finish_reason).lower().endswith("error")
    notify = out.kv_connector_metadata.reqs_to_recv
    if notify_p:
        # In the same step P is told to release its blocks: an empty read.
        assert req.request_id in notify and not any(notify[req.request_id].local_block_ids)
    else:
        # An unverified handoff names a P nobody vouched for: D must not contact it.
        assert req.request_id not in notify
    assert_scheduler_clean(scheduler)
    return result.kv_transfer_params[KEY]


#: What ``move_or_raced`` returns when the stop reached P after stage 1 had ended.
RACED = object()


def move_or_raced(stub, request_id: str, **call_kwargs: Any):
    """Router.Move of ``request_id`` on ``stub`` (a router's, or Serve's proxy with its
    metadata in ``call_kwargs``); RACED when the router answers that stage 1 ended on P
    before the stop reached it (a client's stream lags P: under load P can finish first,
    and Move says so rather than claim a move)."""
    import grpc

    from kvhandoff.v1 import router_pb2

    try:
        return stub.Move(router_pb2.MoveRequest(request_id=request_id), **call_kwargs)
    except grpc.RpcError as e:
        if (e.code() == grpc.StatusCode.FAILED_PRECONDITION
                and "before the stop reached it" in e.details()):
            return RACED
        raise

