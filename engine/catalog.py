"""Catalogs: the valid item IDs a constrained beam search may return, as a compact trie.

A catalog file lists one item per line: its token ids, separated by spaces (blank lines
and lines starting with ``#`` are skipped). D loads its catalogs at start
(``--catalog NAME=PATH``, ``EngineConfig.catalogs``): the front end to check them (a
token outside the vocabulary, or EOS inside an item, refuses the start with the file and
line) and to answer which it has, each worker to constrain the beams
(``decode_engine.beam_processor``). Loaded once, shared by every request that names it.

The trie is a transition table in flat arrays (no Python object per node): node ``k``'s
children are ``tokens[offsets[k]:offsets[k+1]]`` (ascending) leading to
``targets[...]``; node 0 is the root (no token yet); ``is_item[k]``: the path to ``k``
is a whole item. Edges are also keyed ``node * vocab + token`` (ascending), so a batch
of transitions is one ``searchsorted``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class CatalogError(ValueError):
    """A catalog that cannot be loaded (the message names the file and line)."""


@dataclass(frozen=True, eq=False)
class Catalog:
    name: str
    vocab_size: int
    num_items: int
    offsets: np.ndarray  # int64 [nodes + 1]
    tokens: np.ndarray  # int64 [edges], ascending within a node
    targets: np.ndarray  # int64 [edges]
    is_item: np.ndarray  # bool [nodes]
    depth: np.ndarray  # int64 [nodes]: tokens from the root
    keys: np.ndarray  # int64 [edges]: node * vocab_size + token, ascending
    #: sha256 of the items (in file order), to say which list an engine loaded.
    digest: str

    @property
    def num_nodes(self) -> int:
        return len(self.is_item)

    @property
    def min_item_len(self) -> int:
        return int(self.depth[self.is_item].min(initial=self.depth.max(initial=0)))

    @property
    def max_item_len(self) -> int:
        return int(self.depth[self.is_item].max(initial=0))

    def nodes_at_depth(self) -> list[int]:
        """``[i]``: the distinct prefixes of ``i + 1`` tokens (trie nodes at that depth);
        what ``GetCapacity`` tells the router (``Capacity.catalog_widths``)."""
        return [int(n) for n in np.bincount(self.depth)[1:]]

    def max_live(self, steps: int) -> int:
        """The most beams a search of ``steps`` tokens can have alive at once: distinct
        live beams sit at distinct nodes of one depth (``kvhandoff.budget.live_slots``)."""
        return max(self.nodes_at_depth()[:steps], default=0)

    def ends_here(self, nodes: np.ndarray) -> np.ndarray:
        """Per beam: at a whole item that no item continues (a leaf)."""
        nodes = np.asarray(nodes, dtype=np.int64)
        safe = np.maximum(nodes, 0)
        return (nodes >= 0) & self.is_item[safe] & (np.diff(self.offsets)[safe] == 0)

    def allowed(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every (row, token) a beam at ``nodes[row]`` may take next, row by row, each
        row's tokens ascending (a dead node, -1, allows nothing)."""
        nodes = np.asarray(nodes, dtype=np.int64)
        live = nodes >= 0
        start = np.where(live, self.offsets[np.maximum(nodes, 0)], 0)
        counts = np.where(live, self.offsets[np.maximum(nodes, 0) + 1] - start, 0)
        rows = np.repeat(np.arange(len(nodes)), counts)
        first = np.cumsum(counts) - counts
        edges = start[rows] + np.arange(len(rows)) - first[rows]
        return rows, self.tokens[edges]

    def step(self, nodes: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The node each beam reaches by taking ``tokens`` (-1 where that leaves the
        catalog, or the beam was already out)."""
        nodes = np.asarray(nodes, dtype=np.int64)
        tokens = np.asarray(tokens, dtype=np.int64)
        key = nodes * self.vocab_size + tokens
        at = np.minimum(np.searchsorted(self.keys, key), max(len(self.keys) - 1, 0))
        found = (nodes >= 0) & (tokens >= 0) & (tokens < self.vocab_size)
        if len(self.keys):
            found &= self.keys[at] == key
        else:
            found &= False
        return np.where(found, self.targets[at] if len(self.keys) else -1, -1)

    def walk(self, tokens: list[int]) -> int:
        """The node ``tokens`` lead to from the root (-1: not a prefix of any item)."""
        node = np.zeros(1, dtype=np.int64)
        for token in tokens:
            node = self.step(node, np.array([token]))
        return int(node[0])

    def holds(self, tokens: list[int]) -> bool:
        """Whether ``tokens`` are one whole item."""
        node = self.walk(tokens)
        return node >= 0 and bool(self.is_item[node])


def build(name: str, items: list[list[int]], vocab_size: int) -> Catalog:
    """The trie of ``items`` (already checked against the vocabulary)."""
    digest = hashlib.sha256()
    children: list[dict[int, int]] = [{}]
    ends = [False]
    for item in items:
        digest.update((" ".join(map(str, item)) + "\n").encode())
        node = 0
        for token in item:
            nxt = children[node].get(token)
            if nxt is None:
                nxt = children[node][token] = len(children)
                children.append({})
                ends.append(False)
            node = nxt
        ends[node] = True
    # Renumber breadth-first with each node's children by token: every node's edges
    # then sit together and in order, and a child comes after its parent.
    order, number, depth = [0], {0: 0}, [0]
    for old in order:
        for token in sorted(children[old]):
            number[children[old][token]] = len(order)
            depth.append(depth[number[old]] + 1)
            order.append(children[old][token])
    counts = np.array([len(children[old]) for old in order], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(counts)))
    tokens = np.array([t for old in order for t in sorted(children[old])], dtype=np.int64)
    targets = np.array([number[children[old][t]] for old in order
                        for t in sorted(children[old])], dtype=np.int64)
    parents = np.repeat(np.arange(len(order)), counts)
    return Catalog(name=name, vocab_size=vocab_size,
                   num_items=sum(ends), offsets=offsets, tokens=tokens, targets=targets,
                   is_item=np.array([ends[old] for old in order], dtype=bool),
                   depth=np.array(depth, dtype=np.int64),
                   keys=parents * vocab_size + tokens, digest=digest.hexdigest()[:16])


def load(name: str, path: str | Path, vocab_size: int, eos_token_id: int | None) -> Catalog:
    """Read and check a catalog file (module docstring); :class:`CatalogError` names the
    first bad line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise CatalogError(f"catalog {name!r}: cannot read {path}: {e.strerror}") from None
    items: list[list[int]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"catalog {name!r}: {path}, line {number}"
        try:
            item = [int(word) for word in line.split()]
        except ValueError:
            raise CatalogError(f"{where}: not token ids: {line[:80]!r}") from None
        bad = [t for t in item if not 0 <= t < vocab_size]
        if bad:
            raise CatalogError(f"{where}: token id {bad[0]} is outside the vocabulary "
                               f"(0..{vocab_size - 1})")
        if eos_token_id is not None and eos_token_id in item:
            raise CatalogError(f"{where}: EOS ({eos_token_id}) inside an item (an item "
                               "ends by itself; the search adds EOS where the model ends it)")
        items.append(item)
    if not items:
        raise CatalogError(f"catalog {name!r}: {path} lists no items")
    return build(name, items, vocab_size)


def parse_spec(spec: str, option: str = "--catalog") -> tuple[str, str]:
    """``NAME=PATH`` (the ``--catalog`` and ``--adapter`` options) as (name, path)."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise CatalogError(f"{option} wants NAME=PATH, not {spec!r}")
    return name, path
