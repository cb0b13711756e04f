"""The malformed handoffs of the corpus (``tools.fuzz``): every field of a Handoff (and
the prompt it continues) out of range, negative, huge, of another length or another
model's, an expired or future lease, other ids; and random compositions of those. A case
says whether D must refuse it and whether it points D where no P answers."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvhandoff.v1 import common_pb2

Mutation = Callable[[common_pb2.Handoff, list[int], "Context"], list[int] | None]


@dataclass
class Context:
    """What mutations may use: another model's digest, a port where nobody listens, the
    vocabulary size, another parent's request id."""

    nobody_port: int
    vocab_size: int
    other_request_id: str = "fuzz-no-such-request"


@dataclass(frozen=True)
class HandoffCase:
    """One mutation of the parent's handoff (and possibly of the prompt): ``refuse`` if it
    breaks a rule D enforces, ``unavailable`` if D learns that only from P (no P where
    it points, P's handshake, P's answer that the export is not held): UNAVAILABLE."""

    name: str
    mutate: Mutation
    refuse: bool = True
    unavailable: bool = False

    @property
    def field(self) -> str:
        """What the case changes: its name up to "=", else its first word."""
        return self.name.split("=")[0] if "=" in self.name else self.name.split()[0]


#: The largest value of the Handoff's uint32 fields.
U32 = 2**32 - 1


def _set(name: str, value: Any) -> Mutation:
    """Set field ``name`` to ``value`` (or ``value(h, ctx)``: a value derived from the
    handoff as earlier mutations left it, kept within uint32 where it is an int)."""
    def mutate(h, prompt, ctx):
        v = value(h, ctx) if callable(value) else value
        if callable(value) and isinstance(v, int):
            v = max(0, min(U32, v))
        setattr(h, name, v)
    return mutate


def _blocks(make: Callable[[list[list[int]]], list[list[int]]]) -> Mutation:
    def mutate(h, prompt, ctx):
        groups = make([list(g.ids) for g in h.remote_block_ids])
        del h.remote_block_ids[:]
        for g in groups:
            h.remote_block_ids.add(ids=g)
    return mutate


def _prompt(make: Callable[[list[int], Any, Context], list[int]]) -> Mutation:
    def mutate(h, prompt, ctx):
        return make(prompt, h, ctx)
    return mutate


def handoff_cases() -> list[HandoffCase]:
    """Every single-field mutation of a Handoff (and of the prompt it continues)."""
    C = HandoffCase
    now = time.time
    cases = [
        *(C(f"protocol_version={v}", _set("protocol_version", v)) for v in (0, 2, 99, 2**32 - 1)),
        *(C(f"model_fingerprint={n}", _set("model_fingerprint", v)) for n, v in (
            ("empty", ""), ("another model", "0123456789abcdef"), ("huge", "f" * 5000))),
        C("engine_id=empty", _set("engine_id", "")),
        C("engine_id=huge", _set("engine_id", "p" * 5000)),
        C("engine_id=unknown", _set("engine_id", "prefill-nobody"), refuse=False,
          unavailable=True),
        C("request_id=empty", _set("request_id", "")),
        C("request_id=huge", _set("request_id", "r" * 5000)),
        # P's READ of the blocks works; P's answer that no such export is held fails it.
        C("request_id=unknown", _set("request_id", "fuzz-no-such-request"),
          unavailable=True),
        *(C(f"num_parent_tokens={n}", _set("num_parent_tokens", v)) for n, v in (
            ("0", lambda h, c: 0), ("1", lambda h, c: 1), ("-1 of it", lambda h, c:
                                                           h.num_parent_tokens - 1),
            ("+1 of it", lambda h, c: h.num_parent_tokens + 1), ("max", lambda h, c: 2**32 - 1))),
        *(C(f"num_computed_tokens={n}", _set("num_computed_tokens", v)) for n, v in (
            ("0", lambda h, c: 0), ("parent", lambda h, c: h.num_parent_tokens),
            ("max", lambda h, c: 2**32 - 1))),
        C("both token counts -1", _counts(-1)),
        C("both token counts +40", _counts(40)),
        *(C(f"token_digest={n}", _set("token_digest", v)) for n, v in (
            ("empty", ""), ("zeros", "0" * 64), ("huge", "a" * 100000))),
        *(C(f"block_size={v}", _set("block_size", v)) for v in (0, 1, 2**32 - 1)),
        C("block_size=half", _set("block_size", lambda h, c: max(1, h.block_size // 2))),
        *(C(f"num_blocks={n}", _set("num_blocks", v)) for n, v in (
            ("0", lambda h, c: 0), ("+2", lambda h, c: h.num_blocks + 2),
            ("max", lambda h, c: 2**32 - 1))),
        C("kv_bytes_per_block=0", _set("kv_bytes_per_block", 0)),
        C("kv_bytes_per_block=max", _set("kv_bytes_per_block", 2**64 - 1), refuse=False),
        C("exported_at=an hour ahead", _set("exported_at", lambda h, c: now() + 3600)),
        C("exported_at=nan", _set("exported_at", float("nan"))),
        C("exported_at=-1", _set("exported_at", -1.0)),
        C("exported_at=0", _set("exported_at", 0.0), refuse=False),
        C("lease_expires_at=past", _set("lease_expires_at", lambda h, c: now() - 1)),
        C("lease_expires_at=in a year", _set("lease_expires_at", lambda h, c: now() + 3e7)),
        *(C(f"lease_expires_at={v}", _set("lease_expires_at", v)) for v in (
            float("nan"), float("inf"), float("-inf"), 0.0)),
        C("remote_host=empty", _set("remote_host", "")),
        C("remote_host=huge", _set("remote_host", "h" * 300)),
        C("remote_host=nul", _set("remote_host", "127.0.0.1\x00")),
        C("remote_port=0", _set("remote_port", 0)),
        C("remote_port=70000", _set("remote_port", 70000)),
        # D may still hold a connection to P's engine id: then it reads P's blocks.
        C("remote_port=nobody", _set("remote_port", lambda h, c: c.nobody_port),
          refuse=False, unavailable=True),
        C("block ids out of P's pool", _blocks(lambda g: [[1_000_000 + i for i in range(
            len(x))] for x in g])),
        C("block id 2**31-1", _blocks(lambda g: [[*x[:-1], 2**31 - 1] for x in g])),
        C("block ids negative", _blocks(lambda g: [[-1 - b for b in x] for x in g])),
        C("block ids duplicated", _blocks(lambda g: [[x[0]] * len(x) for x in g])),
        # In P's pool and well-formed, but not the export's: only P can tell (its
        # answer after the READ, connector.liveness).
        C("block ids shifted within P's pool", _blocks(lambda g: [[b + 1 for b in x]
                                                                 for x in g]),
          unavailable=True),
        C("block ids one short", _blocks(lambda g: [x[:-1] for x in g])),
        C("block ids one more", _blocks(lambda g: [[*x, max(x) + 1] for x in g])),
        C("block ids: no group", _blocks(lambda g: [])),
        C("block ids: a group more", _blocks(lambda g: [*g, g[0]])),
        C("block ids: empty group", _blocks(lambda g: [[] for _ in g])),
        C("block ids: 5000", _blocks(lambda g: [list(range(1, 5001)) for _ in g])),
        *(C(f"tp_size={v}", _set("tp_size", v)) for v in (0, 2**32 - 1)),
        *(C(f"dcp_size={v}", _set("dcp_size", v)) for v in (2**32 - 1,)),
        *(C(f"pp_size={v}", _set("pp_size", v)) for v in (2**32 - 1,)),
        C("remote_blocks_expiry_time=nan", _set("remote_blocks_expiry_time", float("nan"))),
        C("remote_blocks_expiry_time=inf", _set("remote_blocks_expiry_time", float("inf"))),
        # P's monotonic clock, which only the worker's fence can read: UNAVAILABLE.
        C("remote_blocks_expiry_time=past", _set("remote_blocks_expiry_time", -1e9),
          unavailable=True),
        C("num_pool_blocks=0", _set("num_pool_blocks", 0)),
        C("num_pool_blocks=max", _set("num_pool_blocks", 2**32 - 1)),
        C("num_pool_blocks below the ids", _set("num_pool_blocks",
                                                lambda h, c: max(_ids(h), default=1))),
        # P's pool overstated, ids beyond the real one: past the admission, the worker
        # refuses the READ against P's handshake (UNAVAILABLE; vLLM would index past its
        # descriptor table inside D's engine core).
        C(WORKER_CASE, _beyond_real_pool, unavailable=True),
        C("adapter=unknown", _set("adapter", "no-such-adapter")),
        C("adapter_digest=other", _set("adapter_digest", "0" * 16), refuse=False),
        # D imports under the handoff's salt: the same KV, hashed apart.
        C("cache_salt=other", _set("cache_salt", "another-salt"), refuse=False),
        C("prompt one token short", _prompt(lambda p, h, c: p[:h.num_parent_tokens - 1])),
        C("prompt token changed", _prompt(lambda p, h, c: [(p[0] + 1) % c.vocab_size, *p[1:]])),
        C("prompt empty", _prompt(lambda p, h, c: [])),
        C("prompt outside the vocabulary", _prompt(lambda p, h, c: [*p, c.vocab_size + 7])),
        C("prompt negative token", _prompt(lambda p, h, c: [*p, -5])),
    ]
    return cases


#: The case only D's worker can refuse (the tests check it reached the worker).
WORKER_CASE = "num_pool_blocks overstated, ids beyond P's real pool"


def _beyond_real_pool(h, prompt, ctx):
    h.num_pool_blocks = 1 << 24
    groups = [[(1 << 23) + i for i in range(len(g.ids))] for g in h.remote_block_ids]
    del h.remote_block_ids[:]
    for g in groups:
        h.remote_block_ids.add(ids=g)


def _counts(delta: int) -> Mutation:
    def mutate(h, prompt, ctx):
        h.num_parent_tokens = max(0, min(U32, h.num_parent_tokens + delta))
        h.num_computed_tokens = max(0, min(U32, h.num_computed_tokens + delta))
    return mutate


def _ids(h: common_pb2.Handoff) -> list[int]:
    return [b for g in h.remote_block_ids for b in g.ids]


def compose(rng: random.Random, cases: list[HandoffCase], k: int) -> HandoffCase:
    """``k`` mutations at once; refused if any one is."""
    parts: list[HandoffCase] = []
    while len(parts) < k:  # one mutation a field: a later one would undo an earlier
        case = rng.choice(cases)
        if all(case.field != p.field for p in parts):
            parts.append(case)

    def mutate(h, prompt, ctx):
        for part in parts:
            changed = part.mutate(h, prompt, ctx)
            prompt = prompt if changed is None else changed
        return prompt

    refuse = any(p.refuse for p in parts)
    return HandoffCase(" + ".join(p.name for p in parts), mutate, refuse=refuse,
                       unavailable=any(p.unavailable for p in parts))
