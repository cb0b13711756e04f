"""``kvhandoff bench --moves``: what moving a running request costs, and what a drain
saves.

P, P', D and the router run as processes (``local_cluster``). Two measurements:

- **Move cost by parent length.** For each length L, a request with a prompt of
  ``L - MOVE_AT`` tokens samples stage 1 positionally on P; after ``MOVE_AT`` streamed
  tokens the client calls ``Router.Move`` and D imports the parent (L tokens, the partial
  last block included) and samples the rest; then the same with ``Router.Move`` to P'
  (a second sampling engine), which imports, samples the rest and exports to D.
  Reported from the response's ``Move``: the pause (from P's last token to the
  destination's first: the router's hop, the READ, the tail's compute), bytes read,
  tokens imported and computed; and whether stage 1 and the beams equal the same request
  never moved. P' is drained (takes no new work) while the twin and each moved request
  start, and taken back just before the move to it, so both start on P. Cache state: the
  unmoved twin runs first, colocated on P, so P's prefix cache holds the prompt and D's
  and P''s hold nothing of it (the P -> D move runs before the P -> P' one).
- **Drain of N running requests.** N requests with fresh prompts stream stage 1 on P; once
  each has streamed a few tokens, either ``Router.Drain`` moves them to D, or nothing is
  done (the baseline, run first); P' is drained meanwhile, so all N run on P. Reported:
  seconds from that moment until P runs no request (``GetCapacity`` polled every 20
  ms), and until every request is answered.
- **Drain of a D running N beam searches** (stage 2, issue 59). N two-stage requests
  (fresh prompts, a short stage 1, beam search of ``SEARCH_W`` beams and ``SEARCH_T``
  tokens) all run their searches on D (D' drained while they start, put back once
  every search runs on D: each request's stage 1 streamed and D's running slots reach N
  x ``SEARCH_W``); then either nothing is done (``wait``, run first) or
  ``Router.Drain(D)`` moves them to D' (``drain``). The same prompts and seeds both
  times: the drained requests' beams are compared with the waited ones'. Reported:
  seconds until D runs no request, the Drain call's own seconds, until every request
  is answered, and how many moved.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from kvhandoff.v1 import engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from tools.client import make_request
from tools.launch import local_cluster

#: Stage-1 tokens streamed on P before the move.
MOVE_AT = 32
#: The stage-2 drain's beam searches: width and tokens (a few seconds each here).
SEARCH_W, SEARCH_T = 32, 192
#: Their stage 1: this many tokens, then the search.
SEARCH_STAGE1 = 4

#: Parent lengths at the move (the model's max_model_len is 4096: stage 1's rest, the
#: suffix and the beams must fit after the longest).
LENGTHS = (256, 1024, 2048, 3968)


def _request(prompt: list[int], request_id: str, stage1_tokens: int, *, seed: int,
             path: str = "handoff") -> router_pb2.GenerateRequest:
    req = make_request(prompt=prompt, max_tokens=stage1_tokens, seed=seed, beam_width=4,
                       request_id=request_id, path=path)
    req.stage1.min_tokens = stage1_tokens
    req.stage1.positional = True
    return req


def _stream(stub, req, started: threading.Event | None = None, at: int = 4,
            on_tokens=None, arrivals: list[float] | None = None
            ) -> tuple[list[int], router_pb2.GenerateResponse]:
    streamed, result = [], None
    for event in stub.GenerateStream(req, timeout=600):
        if event.HasField("stage1_tokens"):
            if arrivals is not None:
                arrivals.append(time.perf_counter())
            streamed.extend(event.stage1_tokens.ids)
            if on_tokens is not None:
                on_tokens(len(streamed))
            if started is not None and len(streamed) >= at:
                started.set()
        else:
            result = event.result
    return streamed, result


def measure_move_cost(stub, lengths: tuple[int, ...], stage1_tokens: int, rng: random.Random,
                      p2_address: str | None = None) -> list[dict[str, Any]]:
    rows = []
    for n, length in enumerate(lengths):
        prompt = [rng.randrange(10, 1000) for _ in range(length - MOVE_AT)]
        # P' drained while the twin and each moved request start: both run on P.
        _drain(stub, p2_address)
        twin = stub.Generate(_request(prompt, f"bm-twin-{n}", stage1_tokens, seed=n,
                                      path="colocated"), timeout=600)
        for to in ("", p2_address) if p2_address else ("",):
            rows.append(_moved_row(stub, prompt, twin, f"bm-move-{n}{'-p' if to else ''}",
                                   stage1_tokens, n, to))
            _drain(stub, p2_address)
        _drain(stub, p2_address, undo=True)
    return rows


def _drain(stub, address: str | None, undo: bool = False) -> None:
    if address:
        stub.Drain(router_pb2.DrainRequest(endpoint=address, undo=undo), timeout=60)


def _moved_row(stub, prompt: list[int], twin, rid: str, stage1_tokens: int, seed: int,
               to: str) -> dict[str, Any]:
    """One request moved after ``MOVE_AT`` tokens to ``to`` (a P; "": its D)."""
    moved = []

    def maybe_move(count: int) -> None:
        if count >= MOVE_AT and not moved:
            _drain(stub, to, undo=True)  # P' takes work again: the move's destination
            moved.append(stub.Move(router_pb2.MoveRequest(request_id=rid, to_endpoint=to),
                                   timeout=60))

    arrivals: list[float] = []
    streamed, result = _stream(stub, _request(prompt, rid, stage1_tokens, seed=seed),
                               on_tokens=maybe_move, arrivals=arrivals)
    move = result.moves[0] if result.moves else None
    gaps = [b - a for a, b in zip(arrivals[1:MOVE_AT], arrivals[2:MOVE_AT])]
    return {
        "to": "P'" if to else "D",
        "parent_tokens": len(prompt) + (move.at_token if move else 0),
        "at_token": move.at_token if move else None,
        "pause_ms": round(move.pause_ms, 1) if move else None,
        # The client's median gap between stream events before the move (the first left out).
        "token_gap_ms": round(statistics.median(gaps) * 1e3, 1) if gaps else None,
        "bytes_moved": move.num_bytes_moved if move else 0,
        "tokens_imported": move.num_imported_tokens if move else 0,
        "tokens_computed": move.num_computed_tokens if move else 0,
        "identical": (streamed == list(result.thinking_token_ids)
                      == list(twin.thinking_token_ids)
                      and [list(b.token_ids) for b in result.beams]
                      == [list(b.token_ids) for b in twin.beams]),
    }


def measure_drain(stub, p_address: str, *, requests: int, prompt_tokens: int,
                  stage1_tokens: int, rng: random.Random, drain: bool) -> dict[str, Any]:
    p_stub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(p_address))
    prompts = [[rng.randrange(10, 1000) for _ in range(prompt_tokens)]
               for _ in range(requests)]
    started = [threading.Event() for _ in range(requests)]
    tag = "drain" if drain else "wait"
    with ThreadPoolExecutor(requests) as pool:
        futures = [pool.submit(_stream, stub, _request(prompt, f"bm-{tag}-{i}", stage1_tokens,
                                                       seed=100 + i), started[i])
                   for i, prompt in enumerate(prompts)]
        for event in started:
            event.wait(600)
        t0 = time.perf_counter()
        summary = None
        if drain:
            summary = stub.Drain(router_pb2.DrainRequest(endpoint=p_address), timeout=600)
        while p_stub.GetCapacity(engine_pb2.CapacityRequest(), timeout=10).num_running_reqs:
            time.sleep(0.02)
        empty_s = time.perf_counter() - t0
        results = [f.result()[1] for f in futures]
        answered_s = time.perf_counter() - t0
    if drain:
        stub.Drain(router_pb2.DrainRequest(endpoint=p_address, undo=True), timeout=60)
    return {"mode": tag, "p_empty_s": round(empty_s, 2), "all_answered_s": round(answered_s, 2),
            "moved": sum(1 for r in results if r.moves),
            "drain_call_s": round(summary.seconds, 2) if summary else None}


def _search_request(prompt: list[int], request_id: str, seed: int, width: int,
                    tokens: int) -> router_pb2.GenerateRequest:
    req = _request(prompt, request_id, SEARCH_STAGE1, seed=seed)
    req.beam.beam_width, req.beam.max_tokens = width, tokens
    return req


def measure_search_drain(stub, d_address: str, d2_address: str, prompts: list[list[int]], *,
                         drain: bool, width: int = SEARCH_W, tokens: int = SEARCH_T
                         ) -> dict[str, Any]:
    """N = len(prompts) beam searches running on D, drained to D' or waited for (see the
    module docstring); ``beams``: each request's beams, for the identity check."""
    d_stub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(d_address))

    def running() -> int:
        return d_stub.GetCapacity(engine_pb2.CapacityRequest(), timeout=10).num_running_reqs

    tag = "drain" if drain else "wait"
    started = [threading.Event() for _ in prompts]
    _drain(stub, d2_address)  # every search starts on D
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_stream, stub, _search_request(
            prompt, f"bm-s2{tag}-{i}", 200 + i, width, tokens), started[i], SEARCH_STAGE1)
            for i, prompt in enumerate(prompts)]
        for event in started:
            event.wait(600)
        deadline = time.monotonic() + 60
        while running() < len(prompts) * width and time.monotonic() < deadline:
            time.sleep(0.01)
        _drain(stub, d2_address, undo=True)  # D' takes work: the drain's destination
        t0 = time.perf_counter()
        call = stub.Drain.future(router_pb2.DrainRequest(endpoint=d_address),
                                 timeout=600) if drain else None
        while running():  # D polled while the Drain runs
            time.sleep(0.02)
        empty_s = time.perf_counter() - t0
        summary = call.result() if call is not None else None
        results = [f.result()[1] for f in futures]
        answered_s = time.perf_counter() - t0
    if drain:
        stub.Drain(router_pb2.DrainRequest(endpoint=d_address, undo=True), timeout=60)
    return {"mode": tag, "d_empty_s": round(empty_s, 2), "all_answered_s": round(answered_s, 2),
            "drain_call_s": round(summary.seconds, 2) if summary else None,
            "moved": sum(1 for r in results if r.moves),
            "recomputed": sum(1 for r in results if r.stats.recomputed),
            "stage2_s": [round(r.timings.stage2_ms / 1e3, 2) for r in results],
            "at_beam_steps": [m.at_beam_step for r in results for m in r.moves],
            "pause_ms": [round(m.pause_ms, 1) for r in results for m in r.moves],
            "beams": [[list(b.token_ids) for b in r.beams] for r in results]}


def run_search_drains(router: str, d_address: str, d2_address: str, *, requests: int = 4,
                      prompt_tokens: int = 256, rng: random.Random,
                      width: int = SEARCH_W, tokens: int = SEARCH_T) -> dict[str, Any]:
    """The stage-2 drain against waiting, the same N prompts both times."""
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(router))
    prompts = [[rng.randrange(10, 1000) for _ in range(prompt_tokens)]
               for _ in range(requests)]
    wait, drain = (measure_search_drain(stub, d_address, d2_address, prompts, drain=mode,
                                        width=width, tokens=tokens) for mode in (False, True))
    identical = wait.pop("beams") == drain.pop("beams")
    return {"rows": [wait, drain], "identical": identical,
            "config": {"requests": requests, "prompt_tokens": prompt_tokens,
                       "beam_width": width, "beam_tokens": tokens,
                       "stage1_tokens": SEARCH_STAGE1}}


def run_moves(router: str, p_address: str, *, p2_address: str | None = None,
              lengths: tuple[int, ...] = LENGTHS,
              stage1_tokens: int = 96, drain_requests: int = 8, drain_prompt_tokens: int = 256,
              drain_stage1_tokens: int = 256, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(router))
    moves = measure_move_cost(stub, lengths, stage1_tokens, rng, p2_address)
    kw = {"requests": drain_requests, "prompt_tokens": drain_prompt_tokens,
          "stage1_tokens": drain_stage1_tokens, "rng": rng}
    _drain(stub, p2_address)  # every drained request on P
    drains = [measure_drain(stub, p_address, drain=False, **kw),
              measure_drain(stub, p_address, drain=True, **kw)]
    return {"moves": moves, "drain": drains,
            "config": {"move_at": MOVE_AT, "stage1_tokens": stage1_tokens,
                       "drain_requests": drain_requests,
                       "drain_prompt_tokens": drain_prompt_tokens,
                       "drain_stage1_tokens": drain_stage1_tokens, "seed": seed}}


def measure_moves(model: str | None, *, search_requests: int = 4, **kw: Any) -> dict[str, Any]:
    """``run_moves`` on P, P' (256 MiB pools), D, D' (256 MiB) and a router started here,
    then ``run_search_drains`` (D drained to D'), once the router warmed both Ds up (no
    warm-up runs beside the measurements)."""
    with local_cluster(model, Path("out") / "bench-moves-logs", prefill_mib=256,
                       decode_mib=256, extra_prefill=1, extra_decode=1) as cluster:
        d, d2 = (server.address for server in cluster["decode"])
        wait_warmed(cluster["router_metrics"], [d, d2])
        result = run_moves(cluster["router"], cluster["prefill"].address,
                           p2_address=cluster["prefills"][1].address, **kw)
        result["search_drain"] = run_search_drains(
            cluster["router"], d, d2, requests=search_requests,
            rng=random.Random(result["config"]["seed"]))
        return result


def wait_warmed(metrics_url: str, addresses: list[str], timeout_s: float = 120) -> None:
    """Until the router counts a warm-up of each D (one that came up after the router
    takes no work before it)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        warmed = {s.labels.get("dest") for f in text_string_to_metric_families(text)
                  for s in f.samples if s.name == "kvhandoff_router_warmups_total" and s.value}
        if set(addresses) <= warmed:
            time.sleep(0.5)  # the warm-up's end puts the D back to work just after its count
            return
        time.sleep(0.2)
    raise TimeoutError(f"the router did not warm up {addresses} in {timeout_s:g} s")


def format_moves(result: dict[str, Any]) -> str:
    lines = [f"move after {result['config']['move_at']} stage-1 tokens (P -> D, P -> P'):",
             f"{'to':>3} {'parent':>7} {'pause ms':>9} {'gap ms':>10} {'KiB read':>9} "
             f"{'imported':>9} {'computed':>9}  identical"]
    for row in result["moves"]:
        lines.append(f"{row.get('to', 'D'):>3} {row['parent_tokens']:>7} {row['pause_ms']!s:>9} "
                     f"{row['token_gap_ms']!s:>10} {row['bytes_moved'] / 1024:>9.0f} "
                     f"{row['tokens_imported']:>9} "
                     f"{row['tokens_computed']:>9}  {row['identical']}")
    cfg = result["config"]
    lines.append(f"{cfg['drain_requests']} running requests ({cfg['drain_prompt_tokens']}-token "
                 f"prompts, {cfg['drain_stage1_tokens']} stage-1 tokens) on P:")
    for row in result["drain"]:
        lines.append(f"  {row['mode']:>5}: P empty after {row['p_empty_s']} s, all answered "
                     f"after {row['all_answered_s']} s, {row['moved']} moved")
    if "search_drain" in result:
        lines.append(format_search_drains(result["search_drain"]))
    return "\n".join(lines)


def format_search_drains(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"{cfg['requests']} beam searches (W={cfg['beam_width']}, T={cfg['beam_tokens']}, "
             f"{cfg['prompt_tokens']}-token prompts) on D:"]
    for row in result["rows"]:
        lines.append(f"  {row['mode']:>5}: D empty after {row['d_empty_s']} s (Drain call "
                     f"{row['drain_call_s']} s), all answered after {row['all_answered_s']} s, "
                     f"{row['moved']} moved, {row['recomputed']} recomputed, stage 2 s "
                     f"{row['stage2_s']}, moved at beam steps {row['at_beam_steps']} "
                     f"(paused ms {row['pause_ms']})")
    lines.append(f"  drained beams equal the waited ones: {result['identical']}")
    return "\n".join(lines)
