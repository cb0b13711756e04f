"""The contract is the .proto, not the Python stubs: a Node.js client built with
@grpc/grpc-js from proto/ alone gets the same answers as the project's own client."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.utils import assert_handed_off
from tools.client import make_request
from tools.harness import LOGPROB_TOLERANCE

NODE_DIR = Path(__file__).resolve().parent.parent / "interop" / "node"

_NO_NODE = shutil.which("node") is None or shutil.which("npm") is None

pytestmark = [
    pytest.mark.engines,
    # Skipped on a developer's machine without Node; in CI a missing Node is a failure
    # (nothing is skipped silently there).
    pytest.mark.skipif(_NO_NODE and not os.environ.get("CI"),
                       reason="Node.js and npm are needed for the second gRPC implementation"),
]


@pytest.fixture(scope="module")
def node_client() -> Path:
    assert not _NO_NODE, "CI needs Node.js and npm for the second gRPC implementation"
    if not (NODE_DIR / "node_modules" / ".package-lock.json").exists():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                       cwd=NODE_DIR, check=True, timeout=600)
    return NODE_DIR / "client.js"


def _node(client: Path, router: str, request: dict, then: dict | None = None
          ) -> tuple[int, dict]:
    extra = [] if then is None else [json.dumps(then)]
    proc = subprocess.run(["node", str(client), router, json.dumps(request), *extra],
                          capture_output=True, text=True, timeout=300)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def _same(node_resp: dict, py_resp) -> None:
    assert node_resp["thinking_token_ids"] == list(py_resp.thinking_token_ids)
    assert node_resp["thinking_text"] == py_resp.thinking_text
    assert node_resp["prompt_token_ids"] == list(py_resp.prompt_token_ids)
    assert node_resp["suffix_token_ids"] == list(py_resp.suffix_token_ids)
    assert [b["token_ids"] for b in node_resp["beams"]] == [list(b.token_ids) for b in py_resp.beams]
    assert [b["text"] for b in node_resp["beams"]] == [b.text for b in py_resp.beams]
    for a, b in zip(node_resp["beams"], py_resp.beams):
        assert abs(a["cum_logprob"] - b.cum_logprob) <= LOGPROB_TOLERANCE
    assert node_resp["stats"]["path"] == "PATH_HANDOFF"
    # Not the recompute fallback. Not num_imported_tokens == N - 1: the second request
    # finds the first one's full blocks in D's prefix cache and imports only the rest.
    assert not node_resp["stats"].get("recomputed", False), node_resp["stats"]
    assert node_resp["stats"]["num_imported_tokens"] > 0
    assert node_resp["stats"]["num_parent_tokens"] == py_resp.stats.num_parent_tokens


@pytest.mark.parametrize("prompt", [
    "a customer who bought tents and maps",
    list(range(300, 380)),
], ids=["text", "token_ids"])
def test_node_client_gets_the_same_answers(node_client, cluster, router_client, prompt,
                                           assert_cluster_clean):
    request = {"request_id": "", "stage1": {"max_tokens": 24, "temperature": 1.0, "seed": 7},
               "beam": {"beam_width": 4, "max_tokens": 3}, "path": "PATH_HANDOFF"}
    if isinstance(prompt, str):
        request["prompt_text"] = prompt
    else:
        request["prompt_token_ids"] = {"ids": prompt}
    rc, out = _node(node_client, cluster["router"], request)
    assert rc == 0, out
    ours = router_client.generate(make_request(prompt=prompt, max_tokens=24, seed=7,
                                               beam_width=4, path="handoff"))
    assert_handed_off(ours, found_on_d=True)
    _same(out["unary"], ours)
    _same(out["stream"]["result"], ours)
    assert out["stream"]["stage1_ids"] == list(ours.thinking_token_ids)
    assert_cluster_clean()


def test_node_client_sees_invalid_argument_with_the_field(node_client, cluster):
    request = {"prompt_text": "hello", "beam": {"beam_width": 1000}}
    rc, out = _node(node_client, cluster["router"], request)
    assert rc == 3
    assert out["code"] == 3  # INVALID_ARGUMENT
    assert "beam.beam_width" in out["details"]


def test_node_client_runs_the_two_call_flow(node_client, family):
    """StartParent then Continue from the .proto alone: the same parent and beams as the
    Python client's one-shot Generate on the colocated path (same seed)."""
    from kvhandoff.v1 import common_pb2
    from tools.client import RouterClient

    prompt = list(range(400, 470))
    rc, out = _node(node_client, family["router"],
                    {"prompt_token_ids": {"ids": prompt},
                     "stage1": {"max_tokens": 16, "temperature": 1.0, "seed": 11}},
                    {"beam": {"beam_width": 4, "max_tokens": 3}})
    assert rc == 0, out
    with RouterClient(family["router"]) as client:
        ref = client.generate(make_request(prompt=prompt, max_tokens=16, seed=11,
                                           beam_width=4, path="colocated"))
    assert out["stage1_ids"] == list(ref.thinking_token_ids)
    assert out["parent"]["held"] and out["parent"]["thinking_token_ids"] == out["stage1_ids"]
    cont = out["continuation"]
    assert cont["parent_id"] == out["parent"]["parent_id"]
    assert not cont["stats"].get("recomputed", False), cont["stats"]
    assert cont["stats"]["num_imported_tokens"] > 0
    assert ref.stats.path == common_pb2.PATH_COLOCATED and not ref.stats.decode_endpoint
    assert [b["token_ids"] for b in cont["beams"]] == [list(b.token_ids) for b in ref.beams]
    for got, want in zip(cont["beams"], ref.beams):
        assert abs(got["cum_logprob"] - want.cum_logprob) <= LOGPROB_TOLERANCE
