"""A request gRPC cannot parse is INVALID_ARGUMENT on every kvhandoff server
(``wire.undecodable``), not UNKNOWN, and the server answers the next call. The control:
the same server without the interceptor answers UNKNOWN."""

from __future__ import annotations

import asyncio

import grpc

from kvhandoff.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from server.engine_service import EngineServicer


async def _codes(interceptors: list) -> dict[str, int]:
    servicer = EngineServicer("decode", "fingerprint", None)  # no engine: UNAVAILABLE
    server = grpc.aio.server(interceptors=interceptors)
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    raw = engine_pb2.Stage2Request(request_id="x", prompt_token_ids=list(range(100)),
                                   handoff=common_pb2.Handoff(engine_id="e")
                                   ).SerializeToString()
    codes: dict[str, int] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/kvhandoff.v1.Engine/Stage2")
            for data in (raw[:5], raw[:40], raw[:-1], b"\xff" * 16, raw):
                try:
                    await call(data, timeout=10)
                    code = "OK"
                except grpc.aio.AioRpcError as e:
                    code = e.code().name
                codes[code] = codes.get(code, 0) + 1
    finally:
        await server.stop(0)
    return codes


def test_a_truncated_or_corrupted_request_is_invalid_argument():
    from wire.undecodable import RefuseUndecodable

    codes = asyncio.run(_codes([RefuseUndecodable()]))
    # Four undecodable, then the whole message parses (the engine is not up yet).
    assert codes == {"INVALID_ARGUMENT": 4, "UNAVAILABLE": 1}, codes


def test_control_without_the_interceptor_grpc_answers_unknown():
    codes = asyncio.run(_codes([]))
    assert codes.get("UNKNOWN", 0) == 4, codes
