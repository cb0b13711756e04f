"""The model's identity (kvhandoff.model.model_identity) and its cache
(kvhandoff.digests), without engines: the weights are in it, a restart reads none of
them, a broken cache costs a hash and nothing else; and the parent registry's check of
the weights a continuation's engine serves."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from connector.handoff import Handoff, HandoffError, validate_import
from kvhandoff import digests
from kvhandoff.digests import FileDigests
from kvhandoff.model import model_fingerprint, model_identity
from tests.utils import make_export_params

PARENT = list(range(100, 171))


def perturbed_copy(src: str | Path, dst: Path) -> Path:
    """``src`` copied to ``dst`` with one value of one tensor changed (weights "B": the
    same config and tokenizer, one layer's weights another training step's)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    name = sorted(n for n in tensors if "layers.0" in n and n.endswith("q_proj.weight"))[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 0.25
    save_file(tensors, str(weights), metadata=metadata)
    return dst


def config_only_fingerprint(model_dir: str | Path) -> str:
    """The rule the identity replaced: config.json alone."""
    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()[:16]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A digest cache of this test's own, and a fresh process's view of it."""
    where = tmp_path / "digest-cache"
    monkeypatch.setenv(digests.ENV_CACHE, str(where))
    monkeypatch.setattr(digests, "_DEFAULTS", {})
    return where


@pytest.fixture
def weights_a(model_dir, tmp_path) -> Path:
    return Path(shutil.copytree(model_dir, tmp_path / "a"))


@pytest.fixture
def weights_b(model_dir, tmp_path) -> Path:
    return perturbed_copy(model_dir, tmp_path / "b")


def test_other_weights_of_the_same_config_are_another_model(cache, weights_a, weights_b):
    """The rolling update's pair: equal under the config-only rule (which let the
    handoff through), different under the identity (which refuses it as "model")."""
    a_old, b_old = config_only_fingerprint(weights_a), config_only_fingerprint(weights_b)
    assert a_old == b_old
    a, b = model_fingerprint(weights_a), model_fingerprint(weights_b)
    assert a != b and len(a) == len(b) == 16 and int(a, 16) >= 0

    def handoff(fp: str) -> Handoff:
        return Handoff.from_params(make_export_params(PARENT, model_fingerprint=fp))

    validate_import(handoff(a_old), PARENT + [1], model_fingerprint=b_old)  # the old hole
    with pytest.raises(HandoffError) as err:
        validate_import(handoff(a), PARENT + [1], model_fingerprint=b)
    assert err.value.reason == "model"


def test_a_copy_of_the_same_files_is_the_same_model(cache, model_dir, weights_a):
    """The identity is the files' content, not where they are or when they were written."""
    assert model_identity(weights_a) == model_identity(model_dir)


@pytest.mark.parametrize("change", ["tokenizer.json", "weight file added", "config.json",
                                    "weight file removed"])
def test_any_file_of_the_identity_changes_it(cache, weights_a, change):
    before = model_identity(weights_a)
    if change == "weight file added":
        (weights_a / "model-extra.safetensors").write_bytes(b"\0" * 8)
    elif change == "weight file removed":
        (weights_a / "model.safetensors").unlink()
    else:
        data = bytearray((weights_a / change).read_bytes())
        data[len(data) // 2] ^= 1
        (weights_a / change).write_bytes(bytes(data))
    assert model_identity(weights_a) != before


def test_generation_config_is_not_in_it(cache, weights_a):
    before = model_identity(weights_a)
    (weights_a / "generation_config.json").write_text('{"temperature": 0.5}')
    assert model_identity(weights_a) == before


def test_touched_without_a_change_is_hashed_again_to_the_same_digest(cache, weights_a,
                                                                     monkeypatch):
    monkeypatch.setattr(digests, "RACY_S", 0.0)
    before = model_identity(weights_a)
    hashed = digests.file_digests().num_hashed
    weights = weights_a / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert model_identity(weights_a) == before
    assert digests.file_digests().num_hashed == hashed + 1  # that file only


def test_a_restart_reads_no_weights(cache, weights_a, monkeypatch):
    """A fresh process (an empty in-process cache) finds every file's digest on disk."""
    monkeypatch.setattr(digests, "RACY_S", 0.0)
    before = model_identity(weights_a)
    monkeypatch.setattr(digests, "_DEFAULTS", {})

    def no_read(path):
        raise AssertionError(f"{path} read on a cache hit")

    monkeypatch.setattr(digests, "_sha256_of", no_read)
    assert model_identity(weights_a) == before
    assert digests.file_digests().num_hashed == 0


def test_files_written_just_before_the_hash_are_not_cached(tmp_path, weights_a):
    """Within RACY_S of its hash a file's times may not tell a second write apart."""
    config = weights_a / "config.json"
    config.write_bytes(config.read_bytes())
    first = FileDigests(tmp_path / "c")
    digest = first.digest(weights_a, ["config.json"], "t")
    again = FileDigests(tmp_path / "c")
    assert again.digest(weights_a, ["config.json"], "t") == digest
    assert again.num_hashed == 1


@pytest.mark.parametrize("garbage", [b"{not json", b'{"version": 1, "root": 3}', b"\xff\xfe",
                                     b'{"version": 1, "root": "R", "files": {"config.json": '
                                     b'[1, 2, 3, "short"]}}'])
def test_a_corrupt_cache_is_hashed_past_and_repaired(tmp_path, weights_a, monkeypatch,
                                                     garbage):
    monkeypatch.setattr(digests, "RACY_S", 0.0)
    where = tmp_path / "c"
    names = ["config.json", "model.safetensors"]
    digest = FileDigests(where).digest(weights_a, names, "t")
    [stored] = where.iterdir()
    stored.write_bytes(garbage.replace(b'"R"', f'"{weights_a}"'.encode()))
    fresh = FileDigests(where)
    assert fresh.digest(weights_a, names, "t") == digest and fresh.num_hashed == 2
    restarted = FileDigests(where)
    assert restarted.digest(weights_a, names, "t") == digest and restarted.num_hashed == 0


def test_an_unwritable_cache_never_fails_a_start(tmp_path, weights_a, caplog, monkeypatch):
    monkeypatch.setattr(digests, "RACY_S", 0.0)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    digests_ = FileDigests(blocker / "cache")  # under a regular file: mkdir fails
    first = digests_.digest(weights_a, ["config.json"], "t")
    assert first == FileDigests(None).digest(weights_a, ["config.json"], "t")
    assert "not writable" in caplog.text


def test_dummy_weights_are_named_as_such(cache, weights_a, weights_b):
    """vLLM draws dummy weights: the files' weights are not the engine's."""
    dummy_a = model_identity(weights_a, load_format="dummy")
    assert dummy_a == model_identity(weights_b, load_format="dummy")
    assert dummy_a != model_identity(weights_a)


def test_a_continuation_is_not_sent_to_an_engine_now_on_other_weights():
    """A parent held for a D that restarted on other weights is recomputed (or refused,
    strict) instead of sent to be refused there; the same D on the same weights is used."""
    import time

    from kvhandoff.v1 import engine_pb2
    from router.endpoint import Endpoint
    from router.parents import ParentRecord, ParentState

    def engine(fingerprint: str) -> Endpoint:
        return Endpoint("d:1", None, None, capacity=engine_pb2.Capacity(
            model_fingerprint=fingerprint), out_reason=None)

    record = ParentRecord("p1", "m", [1, 2, 3], decode=engine("aaaa"),
                          held_until=time.time() + 60, model_fingerprint="aaaa")
    record.enter(ParentState.HELD)  # stage 1 ended, P holds the blocks
    assert record.why_not_importable() == ""
    record.decode = engine("bbbb")
    assert "now serves other weights (model bbbb" in record.why_not_importable()
    record.local, record.prefill_ep = True, engine("bbbb")
    assert "the prefill engine holding it now serves other weights" in \
        record.why_not_importable()
