"""Fetching a target's wheels here, and installing them on the host, with pip.

A target is a file ``targets/<name>.txt``: a header of ``# key: value`` lines (python,
platforms, what the host already has) and one exact pin a line. Its wheels are fetched
without dependency resolution: the host's own packages (torch above all) are part of
the target, and resolving against this machine would pull in another torch.
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from deploy.bundle.parts import BundleError, Manifest

TARGETS = Path(__file__).parent / "targets"
#: What ``install`` leaves in the site folder: the manifest's sha256 of the installed
#: bundle, so that a second install of the same bundle is a no-op.
STAMP = ".kvhandoff-bundle"
_HEADER_KEYS = ("python", "platforms", "imports", "drop")


@dataclass(frozen=True)
class Target:
    name: str
    python: str
    platforms: tuple[str, ...]
    pins: tuple[str, ...]
    #: Modules that must import once the bundle is installed (beside the host's own).
    imports: tuple[str, ...]
    #: Files left out of the wheels (globs on paths inside a wheel): compiled libraries
    #: the target never loads, to save transfers.
    drop: tuple[str, ...] = ()


def load_target(name: str) -> Target:
    path = TARGETS / f"{name}.txt"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in TARGETS.glob("*.txt")))
        raise BundleError(f"unknown target {name!r}; known: {known}")
    header: dict[str, str] = {}
    pins = []
    for line in path.read_text().splitlines():
        line = line.strip()
        key, _, value = line[2:].partition(":")
        if line.startswith("# ") and key in _HEADER_KEYS:
            header[key] = value.strip()
        elif line and not line.startswith("#"):
            if "==" not in line:
                raise BundleError(f"{path}: {line!r} is not an exact pin (name==version)")
            pins.append(line)
    try:
        return Target(name=name, python=header["python"],
                      platforms=tuple(header["platforms"].split()), pins=tuple(pins),
                      imports=tuple(header.get("imports", "").split()),
                      drop=tuple(header.get("drop", "").split()))
    except KeyError as e:
        raise BundleError(f"{path}: header line '# {e.args[0]}: ...' missing") from e


def download(target: Target, wheel_dir: Path, pip: tuple[str, ...] = ()) -> list[Path]:
    """Every pin's wheel for the target's Python and platforms, into ``wheel_dir``."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    platforms = [a for p in target.platforms for a in ("--platform", p)]
    # The machine's pip constraints (a torch cap for this host's own wheels) do not
    # apply to another host's target.
    env = {**os.environ, "PIP_CONSTRAINT": ""}
    cmd = [*(pip or (sys.executable, "-m", "pip")), "download", "--no-deps",
           "--only-binary=:all:", "--python-version", target.python, "--implementation",
           "cp", *platforms, "--dest", str(wheel_dir), *target.pins]
    subprocess.run(cmd, check=True, env=env)
    wheels = sorted(wheel_dir.glob("*.whl"))
    for wheel in wheels:
        slim(wheel, target.drop)
    return wheels


def slim(wheel: Path, drop: tuple[str, ...]) -> list[str]:
    """Rewrites ``wheel`` without the files matching ``drop`` (and their RECORD lines);
    returns what was left out. A wheel with nothing to drop is left as it is."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        gone = [n for n in names if any(fnmatch.fnmatch(n, g) for g in drop)]
        if not gone:
            return []
        tmp = wheel.with_suffix(".slim")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
            for info in z.infolist():
                if info.filename in gone:
                    continue
                data = z.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    data = b"".join(line for line in data.splitlines(keepends=True)
                                    if line.split(b",", 1)[0].decode() not in gone)
                out.writestr(info, data)
    tmp.replace(wheel)
    print(f"{wheel.name}: left out {', '.join(gone)}")
    return gone


def install(manifest: Manifest, wheel_dir: Path, site: Path, imports: tuple[str, ...] = ()
            ) -> bool:
    """Installs the manifest's wheels into ``site`` (no index, no dependencies), then
    imports ``imports`` from it in a fresh interpreter. False when this bundle is
    installed there already."""
    stamp = site / STAMP
    if stamp.is_file() and stamp.read_text().strip() == manifest.sha256:
        return False
    wheels = [str(wheel_dir / w.name) for w in manifest.wheels]
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                    "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
                    "--target", str(site), *wheels], check=True)
    check_imports(site, imports)
    stamp.write_text(manifest.sha256 + "\n")
    return True


def check_imports(site: Path, imports: tuple[str, ...]) -> None:
    if not imports:
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    done = subprocess.run([sys.executable, "-c", code, *imports], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise BundleError(f"installed into {site}, but an import fails:\n"
                          f"{done.stderr.strip()[-2000:]}")
