"""Wheels into parts of at most N bytes, and back, every byte checked.

The wheels of a bundle are one uncompressed tar (sorted names, fixed times: the same
wheels give the same bytes), cut into pieces. Part ``k`` is a folder ``part-kk/`` holding
piece ``bundle.tar.kk`` and ``manifest.json``; every part carries the whole manifest, so
the host knows from any one of them what must arrive. The manifest names each piece's
size and sha256, the whole tar's, and each wheel's.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path

FORMAT = 1
MANIFEST = "manifest.json"
_CHUNK = 1 << 20


class BundleError(Exception):
    """A bundle that cannot be joined or installed as it stands; the message says which
    part or wheel is wrong and what to do."""


class PartsMissing(BundleError):
    """Some parts have not arrived yet (the others check)."""


@dataclass(frozen=True)
class Piece:
    part: str
    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Wheel:
    name: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    target: str
    bytes: int
    sha256: str
    pieces: tuple[Piece, ...]
    wheels: tuple[Wheel, ...]
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: Path) -> Manifest:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise BundleError(f"{where}: bundle format {raw.get('format')!r}; this "
                                  f"checkout reads format {FORMAT}: split it again here")
            return cls(target=raw["target"], bytes=raw["bytes"], sha256=raw["sha256"],
                       pieces=tuple(Piece(**p) for p in raw["pieces"]),
                       wheels=tuple(Wheel(**w) for w in raw["wheels"]))
        except (ValueError, KeyError, TypeError) as e:
            raise BundleError(f"{where}: not a bundle manifest ({e})") from e


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _tar_of(wheels: list[Path]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in wheels:
            info = tarfile.TarInfo(path.name)
            info.size = path.stat().st_size
            info.mode = 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)
    return buf.getvalue()


def split(wheel_dir: Path, out_dir: Path, part_bytes: int, target: str) -> Manifest:
    """Packs every ``*.whl`` of ``wheel_dir`` into ``out_dir/part-kk/`` folders whose
    files together stay under ``part_bytes`` (the manifest's size is allowed for);
    replaces parts an earlier split left there."""
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise BundleError(f"{wheel_dir}: no .whl files to bundle")
    names = [w.name for w in wheels]
    dupes = {n.split("-")[0].lower().replace("_", "-") for n in names}
    if len(dupes) != len(names):
        raise BundleError(f"{wheel_dir}: two versions of one package; keep one "
                          "(pip stops the whole install on two)")
    data = _tar_of(wheels)
    # Room for the manifest: a line of ~200 bytes a piece and a wheel.
    piece_bytes = part_bytes - 4096 - 256 * (len(wheels) + len(data) // part_bytes + 2)
    if piece_bytes < 64 << 10:
        raise BundleError(f"part size {part_bytes} bytes is too small for {len(wheels)} "
                          "wheels' manifest")
    count = -(-len(data) // piece_bytes)
    width = max(2, len(str(count)))
    pieces = []
    for k in range(count):
        chunk = data[k * piece_bytes:(k + 1) * piece_bytes]
        part = f"part-{k + 1:0{width}d}"
        pieces.append(Piece(part=part, file=f"bundle.tar.{k + 1:0{width}d}",
                            bytes=len(chunk), sha256=hashlib.sha256(chunk).hexdigest()))
    manifest = Manifest(target=target, bytes=len(data),
                        sha256=hashlib.sha256(data).hexdigest(), pieces=tuple(pieces),
                        wheels=tuple(Wheel(w.name, w.stat().st_size, sha256_of(w))
                                     for w in wheels))
    for old in out_dir.glob("part-*"):
        shutil.rmtree(old)
    offset = 0
    for piece in pieces:
        folder = out_dir / piece.part
        folder.mkdir(parents=True)
        (folder / piece.file).write_bytes(data[offset:offset + piece.bytes])
        (folder / MANIFEST).write_text(manifest.to_json())
        offset += piece.bytes
    return manifest


def read_manifest(parts_dir: Path) -> Manifest:
    """The manifest the parts under ``parts_dir`` carry; every part's must be the same."""
    found = sorted(parts_dir.glob(f"part-*/{MANIFEST}"))
    if not found:
        raise BundleError(f"{parts_dir}: no part-*/{MANIFEST}: carry a part folder there")
    texts = {p.read_text() for p in found}
    if len(texts) > 1:
        raise BundleError(f"{parts_dir}: parts of different bundles "
                          f"({', '.join(p.parent.name for p in found)}): remove the old ones")
    return Manifest.from_json(texts.pop(), found[0])


def join(parts_dir: Path, wheel_dir: Path) -> Manifest:
    """Checks every piece under ``parts_dir`` against the manifest, then the whole, then
    writes the wheels into ``wheel_dir`` and checks each. Nothing is written until every
    piece is there and intact."""
    manifest = read_manifest(parts_dir)
    missing = [p.part for p in manifest.pieces if not (parts_dir / p.part / p.file).is_file()]
    if missing:
        have = sorted(p.name for p in parts_dir.glob("part-*"))
        raise PartsMissing(f"bundle {manifest.target}: {len(missing)} of "
                          f"{len(manifest.pieces)} parts missing ({', '.join(missing)}; "
                          f"have {', '.join(have)}): carry them, one a transfer")
    for p in manifest.pieces:
        path = parts_dir / p.part / p.file
        size, digest = path.stat().st_size, sha256_of(path)
        if (size, digest) != (p.bytes, p.sha256):
            raise BundleError(f"{path}: {size} bytes, sha256 {digest[:16]}; the manifest "
                              f"says {p.bytes} bytes, {p.sha256[:16]}: carry {p.part} again")
    data = b"".join((parts_dir / p.part / p.file).read_bytes() for p in manifest.pieces)
    if hashlib.sha256(data).hexdigest() != manifest.sha256:
        raise BundleError(f"bundle {manifest.target}: the joined parts do not match the "
                          "manifest's whole: split it again here")
    wheel_dir.mkdir(parents=True, exist_ok=True)
    want = {w.name: w for w in manifest.wheels}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        members = tar.getmembers()
        if sorted(m.name for m in members) != sorted(want):
            raise BundleError(f"bundle {manifest.target}: the tar's files are not the "
                              "manifest's wheels")
        tar.extractall(wheel_dir, filter="data")
    for w in manifest.wheels:
        path = wheel_dir / w.name
        if (path.stat().st_size, sha256_of(path)) != (w.bytes, w.sha256):
            raise BundleError(f"{path}: does not match the manifest")
    return manifest
