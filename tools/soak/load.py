"""The soak's load: client threads that send a steady mixed load to the router and count,
per sampling interval, what happened (``Soak.take``).

The mix: prompts of 16-600 tokens, stage 1 of 4-64 tokens, beam widths 1-32, unary and
streaming calls, and a share of requests that are meant to fail: cancelled by the client
after their first stage-1 tokens, deadlines too short to make, and bad input. Those fail
with their own status (CANCELLED, DEADLINE_EXCEEDED, INVALID_ARGUMENT) and are counted as
intended; any other failure is an error. A served request whose handoff the router
recomputed (``stats.recomputed``) is counted as served and as recomputed.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from dataclasses import dataclass, field

import grpc

from kvhandoff.v1 import router_pb2
from tools.client import RouterClient, make_request

BEAM_WIDTHS = (1, 2, 4, 8, 16, 32)
#: The status each deliberate failure must get (else it counts as an error).
INTENDED = {"cancel": "CANCELLED", "deadline": "DEADLINE_EXCEEDED", "bad": "INVALID_ARGUMENT"}
#: Shares of the mix (the rest are unary calls).
SHARES = {"stream": 0.2, "cancel": 0.05, "deadline": 0.05, "bad": 0.05}


@dataclass(slots=True)
class Interval:
    """What happened in one sampling interval."""

    outcomes: collections.Counter = field(default_factory=collections.Counter)
    #: End-to-end seconds of each served request.
    latencies: list[float] = field(default_factory=list)
    #: "request id: outcome" of each unintended failure.
    errors: list[str] = field(default_factory=list)
    #: "request id: why the handoff failed" of each served request that was recomputed.
    recomputed: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request: ``outcome`` is "ok", "intended" or "error: CODE details";
    ``recomputed`` is why its handoff was recomputed, None when it was not (or when
    nothing was served)."""

    kind: str
    outcome: str
    seconds: float
    recomputed: str | None = None


class Soak:
    """``concurrency`` client threads, each sending one request after another until
    ``stop`` is set; ``take`` hands over the interval so far and starts a new one."""

    def __init__(self, address: str, concurrency: int, seed: int):
        self.address, self.concurrency, self.seed = address, concurrency, seed
        self.current = Interval()
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def _request(self, rng: random.Random, i: int, kind: str) -> router_pb2.GenerateRequest:
        prompt = [rng.randrange(10, 1000) for _ in range(rng.randint(16, 600))]
        req = make_request(prompt=prompt, max_tokens=rng.randint(4, 64), seed=i,
                           beam_width=rng.choice(BEAM_WIDTHS), beam_tokens=rng.randint(2, 3),
                           path="handoff", request_id=f"soak-{kind}-{i}")
        if kind == "bad":
            # One field wrong at a time, each a documented INVALID_ARGUMENT.
            which = rng.randrange(3)
            if which == 0:
                req.beam.beam_width = 0
            elif which == 1:
                req.prompt_token_ids.ids[0] = 10**9  # outside the vocabulary
            else:
                req.stage1.temperature = -1.0
        return req

    def _one(self, client: RouterClient, rng: random.Random, i: int) -> Outcome:
        x, kind = rng.random(), "unary"
        for name, share in SHARES.items():
            if x < share:
                kind = name
                break
            x -= share
        req = self._request(rng, i, kind)
        resp: router_pb2.GenerateResponse | None = None
        t0 = time.perf_counter()
        try:
            if kind == "unary" or kind == "bad":
                resp = client.generate(req, timeout=300)
            elif kind == "deadline":
                resp = client.generate(req, timeout=rng.uniform(0.02, 0.3))
            else:
                call = client.generate_stream(req, timeout=300)
                for event in call:
                    if kind == "cancel" and event.HasField("stage1_tokens"):
                        call.cancel()
                    elif event.HasField("result"):
                        resp = event.result
        except grpc.RpcError as e:
            seconds = time.perf_counter() - t0
            if INTENDED.get(kind) == e.code().name:
                return Outcome(kind, "intended", seconds)
            return Outcome(kind, f"error: {e.code().name} {e.details()}", seconds)
        seconds = time.perf_counter() - t0
        if kind == "bad":
            return Outcome(kind, "error: a bad request was served", seconds)
        if resp is None:
            return Outcome(kind, "error: the stream ended without a result", seconds)
        why = (resp.stats.handoff_failure or "no reason given") if resp.stats.recomputed else None
        return Outcome(kind, "ok", seconds, why)

    def _worker(self, w: int) -> None:
        rng = random.Random(self.seed * 1000 + w)
        i = w
        with RouterClient(self.address) as client:
            while not self.stop.is_set():
                got = self._one(client, rng, i)
                req_id = f"soak-{got.kind}-{i}"
                i += self.concurrency
                with self.lock:
                    cur = self.current
                    cur.outcomes[f"{got.kind}:{got.outcome.split(':')[0]}"] += 1
                    if got.outcome == "ok":
                        cur.latencies.append(got.seconds)
                    elif got.outcome.startswith("error"):
                        cur.errors.append(f"{req_id}: {got.outcome}")
                    if got.recomputed is not None:
                        cur.recomputed.append(f"{req_id}: {got.recomputed}")

    def take(self) -> Interval:
        with self.lock:
            done, self.current = self.current, Interval()
        return done

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._worker, args=(w,), daemon=True)
                   for w in range(self.concurrency)]
        for t in threads:
            t.start()
        return threads
