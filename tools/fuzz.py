"""A malformed-input corpus thrown at a running P and D over their gRPC ports.

``Corpus.run`` takes a real parent from P (a stage 1 exported for D and held there),
then sends D and P ``n`` bad calls made from it: every field of the Handoff out of range,
negative, huge, of another length, another model's, an expired or future lease, other
ids, and (with the handoff secret) each one both as tampered and re-signed, as a buggy P
would sign it; random compositions of those; bad prompts and beam settings; stage 1s,
Release, Stop and Abort calls with bad fields; a stage 1 on D and a stage 2 import on P.

Each call must end with a clear status: a refusal (:data:`REFUSED`) where the case breaks
a rule, UNAVAILABLE only where D can learn it only from P (nobody where it points, P's
handshake, P's answer that the export is not held), and OK only
where the field changed is one D does not use for the READ (then its beams must be the
good request's). Never UNKNOWN or INTERNAL, never a traceback, and both engines keep
answering. After the corpus the parents are released and both pools must be back where
they were, and the good request gives the colocated reference's beams.

A handoff that names other blocks inside P's pool, re-signed as a P wrong about its own
blocks would sign it, passes every check D can make alone; P's answer after the READ
(``connector.liveness``) refuses it, and the corpus has it.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvhandoff.v1 import common_pb2, engine_pb2
from tools.fuzz_cases import Context, HandoffCase, compose, handoff_cases

#: The statuses of a refusal.
REFUSED = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION", "PERMISSION_DENIED",
                     "NOT_FOUND", "RESOURCE_EXHAUSTED", "OUT_OF_RANGE"})
#: A parent is made anew this long before its lease ends.
RENEW_MARGIN_S = 4.0
BEAM = common_pb2.BeamSearch(beam_width=2, max_tokens=2)

@dataclass
class Parent:
    handoff: common_pb2.Handoff
    prompt: list[int]  # the parent's tokens plus the suffix: what a stage 2 sends
    ends: float


@dataclass
class Report:
    """What the corpus saw: calls by status, the failures (rule broken, engine gone)."""

    sent: int = 0
    by_code: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    #: Each call's status by its name (the last, where a name repeats).
    codes: dict[str, str] = field(default_factory=dict)
    ok_beams: list[tuple[str, list[tuple[int, ...]]]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"sent": self.sent, "by_code": dict(self.by_code),
                "by_kind": dict(self.by_kind), "failures": self.failures,
                "codes": self.codes}


class Corpus:
    """Throws the corpus at P and D (``p`` and ``d`` are Engine stubs; ``metadata`` goes
    with every call, e.g. the engines' key); see the module docstring."""

    def __init__(self, p: Any, d: Any, *, prompt: list[int], suffix: list[int],
                 ctx: Context, secret: bytes | None = None,
                 metadata: tuple[tuple[str, str], ...] = (), timeout_s: float = 60.0,
                 raw: Callable[[str, str, bytes], Any] | None = None):
        """``raw(engine, method, data)``: ``data`` sent as they are to method (a
        gRPC path) of engine "p" or "d" (the corpus's truncated messages; None: none)."""
        self.p, self.d, self.ctx, self.secret, self.raw = p, d, ctx, secret, raw
        self.metadata, self.timeout_s = metadata, timeout_s
        self.prompt, self.suffix = prompt, suffix
        self.target = d.GetCapacity(engine_pb2.CapacityRequest(), timeout=10,
                                    metadata=metadata).handoff_target
        self.report = Report()
        self._parent: Parent | None = None
        self._held: list[str] = []
        self._seq = 0

    # ---- parents -------------------------------------------------------------------
    def _held_parent(self, name: str, seed: int) -> Parent:
        """A stage 1 of the corpus's prompt exported for D and held on P."""
        self._seq += 1
        events = list(self.p.Stage1(engine_pb2.Stage1Request(
            request_id=f"fuzz-{name}-{self._seq}", prompt_token_ids=self.prompt,
            export=True, hold=True, target_engine_id=self.target,
            sampling=common_pb2.Stage1Sampling(max_tokens=6, seed=seed)),
            timeout=self.timeout_s, metadata=self.metadata))
        h = events[-1].handoff
        thinking = [t for e in events for t in e.new_token_ids]
        return Parent(h, [*self.prompt, *thinking, *self.suffix], h.lease_expires_at)

    def parent(self) -> Parent:
        """A parent held on P for D, made anew when its lease nears its end."""
        if self._parent is None or self._parent.ends - time.time() < RENEW_MARGIN_S:
            self._parent = self._held_parent("parent", 3)
            self._held.append(self._parent.handoff.request_id)
        return self._parent

    def release(self) -> None:
        """Give back every parent made (P frees them now, not at their leases' end)."""
        held, self._held = self._held, []
        if held:
            self.p.Release(engine_pb2.ReleaseRequest(request_ids=held),
                           timeout=10, metadata=self.metadata)
        self._parent = None

    def good(self, request_id: str) -> list[tuple[int, ...]]:
        """The good request's beams: the parent imported as it was exported."""
        parent = self.parent()
        resp = self.d.Stage2(engine_pb2.Stage2Request(
            request_id=request_id, prompt_token_ids=parent.prompt, handoff=parent.handoff,
            beam=BEAM), timeout=self.timeout_s, metadata=self.metadata)
        return [tuple(b.token_ids) for b in resp.beams]

    # ---- the calls -----------------------------------------------------------------
    def _sign(self, h: common_pb2.Handoff) -> None:
        from connector.signing import sign
        from server.convert import handoff_from_pb

        h.signature = ""
        h.signature = sign(handoff_from_pb(h), self.secret)

    def _call(self, kind: str, name: str, call: Callable[[], Any], allowed: set[str],
              ) -> Any:
        self.report.sent += 1
        self.report.by_kind[kind] += 1
        try:
            result = call()
            code, details = "OK", ""
        except grpc.RpcError as e:
            result, code, details = None, e.code().name, e.details() or ""
        self.report.by_code[code] += 1
        self.report.codes[f"{kind} {name}"] = code
        if code not in allowed:
            self.report.failures.append(f"{kind} {name}: {code} {details[:300]}")
        elif "Traceback" in details or (code != "OK" and not details):
            self.report.failures.append(f"{kind} {name}: {code} without a clear message")
        return result

    def handoff_case(self, case: HandoffCase, signing: str) -> None:
        """One Stage2 with the parent's handoff mutated; ``signing`` is "as sent" (the
        mutation breaks P's signature, where there is one) or "re-signed"."""
        parent = self.parent()
        h = common_pb2.Handoff()
        h.CopyFrom(parent.handoff)
        prompt = case.mutate(h, list(parent.prompt), self.ctx)
        prompt = list(parent.prompt) if prompt is None else prompt
        if signing == "re-signed":
            self._sign(h)
        allowed = set(REFUSED) | ({"UNAVAILABLE"} if case.unavailable else set())
        if not case.refuse:
            allowed.add("OK")
        self._seq += 1
        name = f"{case.name} ({signing})"
        resp = self._call("handoff", name, lambda: self.d.Stage2(engine_pb2.Stage2Request(
            request_id=f"fuzz-{self._seq}", prompt_token_ids=prompt, handoff=h, beam=BEAM),
            timeout=self.timeout_s, metadata=self.metadata), allowed)
        if resp is not None:
            self.report.ok_beams.append((name, [tuple(b.token_ids) for b in resp.beams]))

    def engine_calls(self) -> Iterator[tuple[str, str, Callable[[], Any], set[str]]]:
        """Bad calls of every other kind: (kind, name, call, allowed statuses)."""
        p, d, md, t = self.p, self.d, self.metadata, self.timeout_s
        parent = self.parent()
        ok_or_refused = {"OK", *REFUSED}

        def stage1(**kw):
            def call():
                fields = {"request_id": "fuzz-s1", "prompt_token_ids": self.prompt,
                          "sampling": common_pb2.Stage1Sampling(max_tokens=2), **kw}
                events = list(p.Stage1(engine_pb2.Stage1Request(**fields), timeout=t,
                                       metadata=md))
                if events and events[-1].handoff.request_id:  # held: given back at the end
                    self._held.append(events[-1].handoff.request_id)
                return events
            return call

        def stage2(**kw):
            fields = {"request_id": "fuzz-s2", "prompt_token_ids": parent.prompt,
                      "beam": BEAM, **kw}
            return lambda: d.Stage2(engine_pb2.Stage2Request(**fields), timeout=t, metadata=md)

        big = 2**32 - 1
        yield "stage1", "empty prompt", stage1(prompt_token_ids=[]), set(REFUSED)
        yield "stage1", "token outside the vocabulary", stage1(
            prompt_token_ids=[*self.prompt, self.ctx.vocab_size]), set(REFUSED)
        yield "stage1", "empty request id", stage1(request_id=""), set(REFUSED)
        yield "stage1", "max_tokens huge", stage1(
            sampling=common_pb2.Stage1Sampling(max_tokens=big)), set(REFUSED)
        yield "stage1", "temperature nan", stage1(
            sampling=common_pb2.Stage1Sampling(max_tokens=2, temperature=float("nan"))), \
            set(REFUSED)
        yield "stage1", "top_p 7", stage1(
            sampling=common_pb2.Stage1Sampling(max_tokens=2, top_p=7.0)), set(REFUSED)
        yield "stage1", "logprobs huge", stage1(
            sampling=common_pb2.Stage1Sampling(max_tokens=2, logprobs=big)), set(REFUSED)
        for hold_s in (float("nan"), -1.0, 1e30):
            yield "stage1", f"hold_s={hold_s}", stage1(
                export=True, hold=True, hold_s=hold_s, request_id=f"fuzz-hold-{hold_s}"), \
                ok_or_refused
        yield "stage1", "unknown adapter", stage1(adapter="no-such-adapter"), set(REFUSED)
        # A composition P cannot make is refused and the prompt computed (flagged).
        yield "stage1", "blend from an unknown chunk", stage1(blend=engine_pb2.Blend(
            parts=[engine_pb2.BlendPart(source="nope", length=5)], num_loaded=5)), ok_or_refused
        yield "stage1", "blend beyond its source", stage1(blend=engine_pb2.Blend(
            parts=[engine_pb2.BlendPart(source=parent.handoff.request_id,
                                        source_start=big, length=big, position=big)],
            num_loaded=big)), ok_or_refused
        bad = common_pb2.Handoff()
        bad.CopyFrom(parent.handoff)
        bad.remote_block_ids[0].ids[0] = 1_000_000
        yield "stage1", "moved stage 1 with a bad handoff", stage1(handoff=bad), set(REFUSED)
        yield "stage1", "stage 1 on D", lambda: list(d.Stage1(engine_pb2.Stage1Request(
            request_id="fuzz-s1d", prompt_token_ids=self.prompt), timeout=t, metadata=md)), \
            set(REFUSED)
        yield "stage2", "import on P", lambda: p.Stage2(engine_pb2.Stage2Request(
            request_id="fuzz-s2p", prompt_token_ids=parent.prompt, handoff=parent.handoff,
            beam=BEAM), timeout=t, metadata=md), set(REFUSED)
        yield "stage2", "beam width 0", stage2(beam=common_pb2.BeamSearch(beam_width=0)), \
            set(REFUSED)
        yield "stage2", "beam width huge", stage2(
            beam=common_pb2.BeamSearch(beam_width=big, max_tokens=2)), set(REFUSED)
        yield "stage2", "beam max_tokens huge", stage2(
            beam=common_pb2.BeamSearch(beam_width=2, max_tokens=big)), set(REFUSED)
        yield "stage2", "length penalty nan", stage2(beam=common_pb2.BeamSearch(
            beam_width=2, max_tokens=2, length_penalty=float("nan"))), set(REFUSED)
        yield "stage2", "unknown catalog", stage2(beam=common_pb2.BeamSearch(
            beam_width=2, max_tokens=2, catalog="no-such-catalog")), set(REFUSED)
        # A parent no longer held here: the stage 2 computes its prompt.
        yield "stage2", "unknown held parent", stage2(held_parent="no-such-parent"), \
            ok_or_refused
        yield "stage2", "empty request id", stage2(request_id=""), set(REFUSED)
        yield "stage2", "unknown adapter", stage2(adapter="no-such-adapter"), set(REFUSED)
        yield "stage2", "empty prompt", stage2(prompt_token_ids=[]), set(REFUSED)
        yield "release", "unknown ids", lambda: p.Release(engine_pb2.ReleaseRequest(
            request_ids=[f"nope-{i}" for i in range(2000)]), timeout=t, metadata=md), \
            ok_or_refused
        yield "release", "on D", lambda: d.Release(engine_pb2.ReleaseRequest(
            request_ids=["x"]), timeout=t, metadata=md), set(REFUSED)
        yield "stop", "unknown ids", lambda: p.Stop(engine_pb2.StopRequest(
            request_ids=["nope", ""], target_engine_id="x" * 5000), timeout=t, metadata=md), \
            ok_or_refused
        yield "abort", "unknown id", lambda: d.Abort(engine_pb2.AbortRequest(
            request_id="nope"), timeout=t, metadata=md), ok_or_refused
        yield "abort", "empty id", lambda: p.Abort(engine_pb2.AbortRequest(request_id=""),
                                                    timeout=t, metadata=md), ok_or_refused
        # Read by D, then refused on P's answer (or its lease): UNAVAILABLE at most.
        yield "handoff", "replayed after its parent was released", self._replay, {
            *REFUSED, "UNAVAILABLE"}
        yield from self.raw_calls()

    def _replay(self) -> Any:
        """A parent made and released, then its handoff (lease still running) sent to
        D: P no longer holds it (vllm#52234's replay)."""
        replayed = self._held_parent("replayed", 5)
        self.p.Release(engine_pb2.ReleaseRequest(
            request_ids=[replayed.handoff.request_id]), timeout=10, metadata=self.metadata)
        return self.d.Stage2(engine_pb2.Stage2Request(
            request_id=f"fuzz-replay-{self._seq}", prompt_token_ids=replayed.prompt,
            handoff=replayed.handoff, beam=BEAM),
            timeout=self.timeout_s, metadata=self.metadata)

    def raw_calls(self) -> Iterator[tuple[str, str, Callable[[], Any], set[str]]]:
        """A good stage 2 and stage 1, cut short at several points or with a byte
        corrupted, as bytes: refused as not well-formed, or (a cut between fields)
        taken for the shorter message it is; never UNKNOWN."""
        if self.raw is None:
            return
        parent = self.parent()
        stage2 = engine_pb2.Stage2Request(request_id="fuzz-raw", beam=BEAM,
                                          prompt_token_ids=parent.prompt,
                                          handoff=parent.handoff).SerializeToString()
        stage1 = engine_pb2.Stage1Request(request_id="fuzz-raw-1",
                                          prompt_token_ids=self.prompt).SerializeToString()
        corrupt = bytearray(stage2)
        corrupt[len(corrupt) // 2] ^= 0xFF
        ok_or_refused = {"OK", *REFUSED}
        for engine, method, data in (
                *(("d", "/kvhandoff.v1.Engine/Stage2", stage2[:k])
                  for k in (1, 3, len(stage2) // 3, len(stage2) // 2, len(stage2) - 1)),
                ("d", "/kvhandoff.v1.Engine/Stage2", bytes(corrupt)),
                ("d", "/kvhandoff.v1.Engine/Stage2", b"\xff" * 64),
                *(("p", "/kvhandoff.v1.Engine/Stage1", stage1[:k])
                  for k in (2, len(stage1) // 2))):
            yield "raw", f"{method} {len(data)} bytes", (
                lambda e=engine, m=method, b=data: self.raw(e, m, b)), ok_or_refused

    def alive(self) -> None:
        """Both engines still answer (a dead one fails the corpus at once)."""
        for name, stub in (("P", self.p), ("D", self.d)):
            try:
                stub.GetCapacity(engine_pb2.CapacityRequest(), timeout=10,
                                 metadata=self.metadata)
            except grpc.RpcError as e:
                raise AssertionError(f"{name} stopped answering: {e.code().name} "
                                     f"{e.details()}") from e

    def run(self, n: int, seed: int) -> Report:
        """Send ``n`` calls: the single-field handoff cases (as sent and, with a secret,
        re-signed), the other calls, then random compositions until ``n``."""
        rng = random.Random(seed)
        singles = handoff_cases()
        signings = ["as sent", "re-signed"] if self.secret is not None else ["as sent"]
        plan: list[Callable[[], None]] = []
        for case in singles:
            for signing in signings:
                plan.append(lambda c=case, s=signing: self.handoff_case(c, s))
        for kind, name, call, allowed in self.engine_calls():
            plan.append(lambda k=kind, m=name, c=call, a=allowed: self._call(k, m, c, a))
        while len(plan) < n:
            case = compose(rng, singles, rng.choice((2, 3)))
            signing = rng.choice(signings)
            plan.append(lambda c=case, s=signing: self.handoff_case(c, s))
        for i, step in enumerate(plan[:n] if n else plan):
            step()
            if i % 10 == 9:
                self.alive()
        self.alive()
        return self.report
