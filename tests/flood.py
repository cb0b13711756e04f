"""Floods for the router's fronts (tests/test_front_door.py, tests/test_ray_serve.py):
many requests of mixed kinds sent at once, each one's outcome and time, and a sampler of
the router's requests in flight while they run."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from kvhandoff.v1 import router_pb2
from tools.client import make_request

#: The kinds a flood cycles through.
KINDS = ("completion", "continuation", "beams", "stream")


@dataclass
class Result:
    kind: str
    #: Served (200 / OK).
    ok: bool
    #: The HTTP status or the gRPC status name.
    status: str
    message: str
    seconds: float
    retry_after: str | None = None
    #: A served request whose handoff was recomputed: the router's reason (None: not
    #: recomputed, or nothing handed off).
    recomputed: str | None = None


def _recomputed(stats) -> str | None:
    return (stats.handoff_failure or "recomputed") if stats.recomputed else None


def _prompt(i: int) -> list[int]:
    return [10 + (i * 7 + k) % 900 for k in range(40)]


class InflightSampler:
    """Reads ``read()`` every ``every_s`` in a thread while the block runs; ``peak`` is
    the largest value seen."""

    def __init__(self, read: Callable[[], float], every_s: float = 0.02):
        self.read, self.every_s = read, every_s
        self.peak, self.samples = 0.0, 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, float(self.read()))
                self.samples += 1
            except Exception:  # a scrape that failed says nothing either way
                pass
            self._stop.wait(self.every_s)

    def __enter__(self) -> InflightSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def grpc_flood(stub, n: int, parent_ids: list[str], metadata: tuple = (),
               timeout_s: float = 120.0) -> list[Result]:
    """``n`` requests through a Router stub at once (a barrier): Generate, Continue of one
    of ``parent_ids`` (beams), Generate with its beams over a plain prompt colocated, and
    GenerateStream, in turn."""
    barrier = threading.Barrier(n)

    def one(i: int) -> Result:
        kind = KINDS[i % len(KINDS)]
        barrier.wait()
        t0 = time.monotonic()
        resp = None
        try:
            if kind == "completion":
                resp = stub.Generate(make_request(prompt=_prompt(i), max_tokens=8, seed=i,
                                                  beam_width=2, beam_tokens=2, path="handoff"),
                                     timeout=timeout_s, metadata=metadata)
            elif kind == "continuation":
                req = router_pb2.ContinueRequest(parent_id=parent_ids[i % len(parent_ids)])
                req.beam.beam_width, req.beam.max_tokens = 2, 2
                resp = stub.Continue(req, timeout=timeout_s, metadata=metadata)
            elif kind == "beams":
                resp = stub.Generate(make_request(prompt=_prompt(i), max_tokens=4, seed=i,
                                                  beam_width=4, beam_tokens=2,
                                                  path="colocated"),
                                     timeout=timeout_s, metadata=metadata)
            else:
                for event in stub.GenerateStream(make_request(prompt=_prompt(i), max_tokens=8,
                                                              seed=i, beam_width=2,
                                                              beam_tokens=2, path="handoff"),
                                                 timeout=timeout_s, metadata=metadata):
                    resp = event.result if event.HasField("result") else None
            return Result(kind, True, "OK", "", time.monotonic() - t0,
                          recomputed=_recomputed(resp.stats) if resp is not None else "no result")
        except grpc.RpcError as e:
            return Result(kind, False, e.code().name, e.details() or "",
                          time.monotonic() - t0)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def http_flood(base_url: str, n: int, parent_ids: list[str], model: str = "",
               headers: dict[str, str] | None = None, verify: str | bool = True,
               timeout_s: float = 120.0) -> list[Result]:
    """``n`` requests to ``/v1/completions`` at once: a completion (a parent), a
    continuation of one of ``parent_ids`` (beams), beams over a plain prompt and a
    streamed completion, in turn."""
    import httpx

    def body(i: int, kind: str) -> dict:
        named = {"model": model} if model else {}
        if kind == "continuation":
            return {**named, "continuation_of": parent_ids[i % len(parent_ids)],
                    "use_beam_search": True, "n": 2, "max_tokens": 2}
        if kind == "beams":
            return {**named, "prompt": _prompt(i), "use_beam_search": True, "n": 4,
                    "max_tokens": 2}
        return {**named, "prompt": _prompt(i), "max_tokens": 8, "seed": i,
                "stream": kind == "stream"}

    async def flood() -> list[Result]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(base_url=base_url, headers=headers, verify=verify,
                                     timeout=timeout_s, limits=limits) as client:
            start = asyncio.Event()

            async def one(i: int) -> Result:
                kind = KINDS[i % len(KINDS)]
                await start.wait()
                t0 = time.monotonic()
                resp = await client.post("/v1/completions", json=body(i, kind))
                text = resp.text  # a stream is read to its end
                ok = resp.status_code == 200 and "\"error\"" not in text
                message = "" if ok else text
                info = resp.json().get("kvhandoff") or {} if ok and kind != "stream" else {}
                return Result(kind, ok, str(resp.status_code), message,
                              time.monotonic() - t0, resp.headers.get("retry-after"),
                              recomputed=(info.get("handoff_failure") or "recomputed")
                              if info.get("recomputed") else None)

            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            await asyncio.sleep(0.05)
            start.set()
            return list(await asyncio.gather(*tasks))

    return asyncio.run(flood())
