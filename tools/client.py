"""A small synchronous client for the router (``kvhandoff client``, the demo, tests)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import grpc

from kvhandoff.tls import ChannelTLS, channel_tls
from kvhandoff.v1 import common_pb2, router_pb2, router_pb2_grpc

PATHS = {"auto": common_pb2.PATH_AUTO, "handoff": common_pb2.PATH_HANDOFF,
         "colocated": common_pb2.PATH_COLOCATED}


def make_request(*, prompt: str | list[int], max_tokens: int = 64, temperature: float = 1.0,
                 seed: int | None = None, beam_width: int = 4, beam_tokens: int = 3,
                 path: str = "auto", request_id: str = "",
                 suffix: str | list[int] | None = None,
                 catalog: str | None = None,
                 chunk_ids: list[str] | None = None,
                 recompute_share: float | None = None) -> router_pb2.GenerateRequest:
    """A Generate request; with ``chunk_ids``, ``prompt`` is what follows those chunks
    (with ``recompute_share``, composed approximately unless they are a chain)."""
    req = router_pb2.GenerateRequest(request_id=request_id, path=PATHS[path],
                                     chunk_ids=chunk_ids or [])
    if isinstance(prompt, str):
        req.prompt_text = prompt
    else:
        req.prompt_token_ids.ids.extend(prompt)
    if isinstance(suffix, str):
        req.suffix_text = suffix
    elif suffix is not None:
        req.suffix_token_ids.ids.extend(suffix)
    req.stage1.max_tokens = max_tokens
    req.stage1.temperature = temperature
    if seed is not None:
        req.stage1.seed = seed
    req.beam.beam_width = beam_width
    req.beam.max_tokens = beam_tokens
    if catalog:
        req.beam.catalog = catalog
    if recompute_share is not None:
        req.recompute_share = recompute_share
    return req


def bearer(key: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying ``key`` as the router wants it (``router.auth``)."""
    return (("authorization", f"Bearer {key}"),) if key else ()


class RouterClient:
    """``key``: sent with every call (the router's client key, or its operator key for
    drain and release)."""

    def __init__(self, address: str, tls: ChannelTLS | None = None, key: str | None = None):
        self.channel = (grpc.insecure_channel(address) if tls is None
                        else grpc.secure_channel(address, tls.credentials()))
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.metadata = bearer(key)

    def generate(self, req: router_pb2.GenerateRequest, timeout: float | None = 120.0):
        return self.stub.Generate(req, timeout=timeout, metadata=self.metadata)

    def generate_stream(self, req: router_pb2.GenerateRequest, timeout: float | None = 120.0):
        return self.stub.GenerateStream(req, timeout=timeout, metadata=self.metadata)

    def release_parent(self, parent_id: str, timeout: float = 30.0
                       ) -> router_pb2.ReleaseParentResponse:
        return self.stub.ReleaseParent(router_pb2.ReleaseParentRequest(parent_id=parent_id),
                                       timeout=timeout, metadata=self.metadata)

    def register_chunk(self, tokens: str | list[int], chunk_id: str = "", under: str = "",
                       adapter: str = "", fault: str = "", timeout: float = 120.0
                       ) -> router_pb2.Chunk:
        req = router_pb2.ChunkRequest(chunk_id=chunk_id, under=under, adapter=adapter,
                                      fault=fault)
        if isinstance(tokens, str):
            req.text = tokens
        else:
            req.token_ids.ids.extend(tokens)
        return self.stub.RegisterChunk(req, timeout=timeout, metadata=self.metadata)

    def list_chunks(self, timeout: float = 30.0) -> router_pb2.ListChunksResponse:
        return self.stub.ListChunks(router_pb2.ListChunksRequest(), timeout=timeout,
                                    metadata=self.metadata)

    def delete_chunk(self, chunk_id: str, timeout: float = 30.0) -> list[str]:
        return list(self.stub.DeleteChunk(router_pb2.DeleteChunkRequest(chunk_id=chunk_id),
                                          timeout=timeout, metadata=self.metadata).deleted)

    def drain(self, endpoint: str, *, undo: bool = False, timeout_s: float = 300.0
              ) -> router_pb2.DrainResponse:
        return self.stub.Drain(router_pb2.DrainRequest(
            endpoint=endpoint, undo=undo, timeout_ms=int(timeout_s * 1e3)),
            timeout=timeout_s + 30, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def format_response(resp: router_pb2.GenerateResponse) -> str:
    s, t = resp.stats, resp.timings
    lines = [
        f"request {resp.request_id}: path {common_pb2.Path.Name(s.path)}, "
        f"P {s.prefill_endpoint}, D {s.decode_endpoint or '-'}",
        f"thinking ({len(resp.thinking_token_ids)} tokens, {resp.stage1_finish_reason}): "
        f"{resp.thinking_text!r}",
        f"parent {s.num_parent_tokens} tokens; imported {s.num_imported_tokens} "
        f"({s.num_bytes_moved / 1024:.0f} KiB); stage-2 engine computed "
        f"{s.num_computed_tokens_first_step} for the first step, {s.num_computed_tokens_total} in all",
        f"stage 1 {t.stage1_ms:.1f} ms, stage 2 first step {t.stage2_first_step_ms:.1f} ms, "
        f"stage 2 {t.stage2_ms:.1f} ms, total {t.total_ms:.1f} ms",
    ]
    for i, b in enumerate(resp.beams):
        lines.append(f"  beam {i}: {list(b.token_ids)} {b.text!r} logp={b.cum_logprob:.4f}")
    if resp.num_beams_short or resp.num_dropped_beams:
        lines.append(f"  the catalog filled {len(resp.beams)} beams ({resp.num_beams_short} "
                     f"short of the width; {resp.num_dropped_beams} left out for not being "
                     "whole items)")
    return "\n".join(lines)


def main_client(args: argparse.Namespace) -> int:
    if args.prompt_ids:
        prompt: str | list[int] = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        print("kvhandoff client: give --prompt or --prompt-ids", file=sys.stderr)
        return 2
    req = make_request(prompt=prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                       seed=args.seed, beam_width=args.beam_width, beam_tokens=args.beam_tokens,
                       path=args.path, catalog=args.catalog,
                       chunk_ids=[c for c in (args.chunks or "").split(",") if c],
                       recompute_share=args.recompute_share)
    tls = channel_tls(args.tls_ca, args.tls_client_cert, args.tls_client_key)
    with RouterClient(args.router, tls, args.api_key) as client:
        try:
            if args.stream:
                resp = None
                for event in client.generate_stream(req, timeout=args.timeout):
                    if event.HasField("stage1_tokens"):
                        print(f"stage-1 tokens: {list(event.stage1_tokens.ids)}", flush=True)
                    else:
                        resp = event.result
            else:
                resp = client.generate(req, timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"kvhandoff client: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(format_response(resp))
    return 0


def main_drain(args: argparse.Namespace) -> int:
    """``kvhandoff drain``: drain an engine through the router (or undo a drain)."""
    tls = channel_tls(args.tls_ca, args.tls_client_cert, args.tls_client_key)
    with RouterClient(args.router, tls, args.operator_key) as client:
        try:
            resp = client.drain(args.engine, undo=args.undo, timeout_s=args.timeout)
        except grpc.RpcError as e:
            print(f"kvhandoff drain: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if args.undo:
        print(f"{resp.endpoint} takes new work again")
        return 0
    print(f"drained {resp.endpoint} in {resp.seconds:.2f} s: {resp.moved} moved, "
          f"{resp.finished_in_place} finished in place, {resp.failed} failed"
          + ("" if resp.empty else "; NOT empty at the timeout"))
    return 0 if resp.empty else 1
