"""The digest of some files of a directory (a model's weights, config and tokenizer; an
adapter's), computed once and cached by each file's ``stat``.

A digest is SHA-256 over a tag and, for each file in name order, its name, its size and
its own SHA-256: a file's content changes the digest, and so does a file added or taken
away. Each file's SHA-256 is cached, keyed by (path, size, ``st_mtime_ns``,
``st_ctime_ns``): in this process (:class:`FileDigests` keeps a dict) and in one JSON
file per directory under the cache directory (:func:`cache_dir`), so a restart, or the
engine core after its server, reads no weights. ctime is in the key because nothing sets
it back: a copy that keeps the size and the mtime (``cp -p``, ``rsync -t``) still misses.
An entry whose times are within :data:`RACY_S` of the hash is not kept (a file written
again within the file system's time granularity would keep its key).

The cache is trusted as the model directory is: whoever can write it can name a digest.
A cache that is missing, corrupt, of another version or unwritable is never an error:
the files are hashed again (one warning per process when it cannot be written).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)

#: Environment: the cache directory (overrides the defaults; "off": no on-disk cache).
ENV_CACHE = "KVHANDOFF_DIGEST_CACHE"
#: Version of the on-disk format; a file of another is ignored (and replaced).
_VERSION = 1
#: Seconds: a file changed this recently before it was hashed is not cached (module
#: docstring). Two covers file systems of one- and two-second times.
RACY_S = 2.0
#: Files hashed at once (hashlib releases the GIL: shards hash in parallel).
_MAX_THREADS = 8
#: Key of one file in the caches: (size, st_mtime_ns, st_ctime_ns).
_Key = tuple[int, int, int]


def cache_dir() -> Path | None:
    """Where digests are cached on disk: ``$KVHANDOFF_DIGEST_CACHE``, else
    ``$KVHANDOFF_CACHE/digests``, ``$XDG_CACHE_HOME/kvhandoff/digests``,
    ``~/.cache/kvhandoff/digests``; None for "off". Never inside a model directory,
    which may be read-only."""
    explicit = os.environ.get(ENV_CACHE)
    if explicit:
        return None if explicit == "off" else Path(explicit).expanduser()
    root = os.environ.get("KVHANDOFF_CACHE")
    if root:
        return Path(root).expanduser() / "digests"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvhandoff" / "digests"


class FileDigests:
    """Digests of files under directories, each file hashed at most once per key (see
    the module docstring); ``directory`` None caches in this process only."""

    def __init__(self, directory: Path | None):
        self.directory = directory
        #: (absolute path of the file, key) -> its SHA-256, hex.
        self._memo: dict[tuple[str, _Key], str] = {}
        self._warned = False
        #: Files hashed (read whole) by this object: what a cache hit saves.
        self.num_hashed = 0

    def digest(self, root: str | Path, names: Iterable[str], tag: str) -> str:
        """SHA-256 (hex) over ``tag`` and the files of ``root`` named in ``names`` that
        exist (regular files; others are left out, which the digest shows)."""
        root = Path(root).resolve()
        started = time.time()
        keys = _keys(root, names)
        stored = self._load(root)
        hexes: dict[str, str] = {}
        missing = []
        for name, key in keys.items():
            found = self._memo.get((str(root / name), key))
            if found is None and stored.get(name, [None])[:3] == list(key):
                found = stored[name][3]
            if found is None:
                missing.append(name)
            else:
                hexes[name] = found
        if missing:
            threads = min(len(missing), os.cpu_count() or 1, _MAX_THREADS)
            with ThreadPoolExecutor(threads) as pool:
                for name, hex_ in zip(missing, pool.map(lambda n: _sha256_of(root / n),
                                                        missing)):
                    hexes[name] = hex_
            self.num_hashed += len(missing)
        settled = {n: k for n, k in keys.items()
                   if max(k[1], k[2]) < (started - RACY_S) * 1e9}
        for name, key in settled.items():
            self._memo[(str(root / name), key)] = hexes[name]
        if any(stored.get(n, [None])[:3] != list(k) for n, k in settled.items()):
            self._store(root, {**stored, **{n: [*k, hexes[n]] for n, k in settled.items()}})
        h = hashlib.sha256(f"{tag}\0".encode())
        for name, (size, _, _) in keys.items():
            h.update(f"{name}\0{size}\0{hexes[name]}\n".encode())
        return h.hexdigest()

    # ---- the on-disk cache -------------------------------------------------------------
    def _file(self, root: Path) -> Path | None:
        if self.directory is None:
            return None
        return self.directory / (hashlib.sha256(str(root).encode()).hexdigest()[:32] + ".json")

    def _load(self, root: Path) -> dict[str, list]:
        """The stored entries of ``root``: name -> [size, mtime_ns, ctime_ns, hex];
        {} when there are none or they cannot be read (never an error)."""
        path = self._file(root)
        if path is None:
            return {}
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            logger.info("digest cache %s unreadable (%s): hashing again", path, e)
            return {}
        if not (isinstance(data, dict) and data.get("version") == _VERSION
                and data.get("root") == str(root) and isinstance(data.get("files"), dict)):
            return {}
        return {name: entry for name, entry in data["files"].items()
                if isinstance(entry, list) and len(entry) == 4
                and all(isinstance(x, int) for x in entry[:3]) and _is_hex(entry[3])}

    def _store(self, root: Path, files: dict[str, list]) -> None:
        """Replace ``root``'s entries (written whole, then renamed: a reader sees the old
        file or the new one); a failure is logged once, never raised."""
        path = self._file(root)
        if path is None:
            return
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".digest-")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"version": _VERSION, "root": str(root), "files": files}, f)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            if not self._warned:
                self._warned = True
                logger.warning("digest cache %s not writable (%s): digests are computed "
                               "again at every start", path.parent, e)


def _keys(root: Path, names: Iterable[str]) -> dict[str, _Key]:
    """The cache key of each regular file of ``root`` in ``names``, by name, sorted."""
    keys = {}
    for name in sorted(set(names)):
        try:
            st = (root / name).stat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            keys[name] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return keys


def _sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _is_hex(value: object) -> bool:
    return (isinstance(value, str) and len(value) == 64
            and all(c in "0123456789abcdef" for c in value))


_DEFAULTS: dict[Path | None, FileDigests] = {}


def file_digests() -> FileDigests:
    """This process's :class:`FileDigests` for the cache directory the environment
    names now."""
    where = cache_dir()
    if where not in _DEFAULTS:
        _DEFAULTS[where] = FileDigests(where)
    return _DEFAULTS[where]
