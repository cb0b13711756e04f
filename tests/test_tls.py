"""TLS and mutual TLS on every gRPC hop, with certificates generated here (trustme): the
client to the router and the router to P and D. NIXL's data plane is not gRPC and stays
on UCX (loopback here; RDMA/UCX settings across nodes, see deploy/README.md)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvhandoff.tls import ChannelTLS, ServerTLS, channel_tls, server_tls
from kvhandoff.v1 import engine_pb2, engine_pb2_grpc, router_pb2_grpc
from tests.utils import assert_identical
from tools.client import make_request

pytestmark = [pytest.mark.engines, pytest.mark.security]


@pytest.fixture
def certs(tmp_path):
    import trustme

    ca = trustme.CA()
    paths = {"ca": tmp_path / "ca.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    for name, identity in (("server", "127.0.0.1"), ("client", "router.kvhandoff.test")):
        cert = ca.issue_cert(identity)
        paths[name] = tmp_path / f"{name}.pem"
        paths[f"{name}_key"] = tmp_path / f"{name}.key"
        for i, pem in enumerate(cert.cert_chain_pems):
            pem.write_to_path(str(paths[name]), append=i > 0)
        cert.private_key_pem.write_to_path(str(paths[f"{name}_key"]))
    return {k: str(v) for k, v in paths.items()}


def test_tls_flags_are_checked(certs, tmp_path):
    assert server_tls(None, None, None) is None and channel_tls(None, None, None) is None
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key"):
        server_tls(certs["server"], None, None)
    with pytest.raises(ValueError, match="needs both"):
        channel_tls(certs["ca"], certs["client"], None)
    with pytest.raises(ValueError, match="not found"):
        server_tls(certs["server"], str(tmp_path / "missing.key"), None)


async def _expect_refused(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


def test_mutual_tls_from_client_to_router_to_engines(pair, run, certs, tmp_path,
                                                      assert_pools_clean):
    """Mutual TLS on every hop: a request by handoff through the router equals its
    colocated reference (stage 1, the beams' token ids and cumulative logprobs); a
    client without a certificate, or in plaintext, is refused at the handshake by the
    router, and one without a certificate by D."""
    from kvhandoff.ports import free_port
    from server.engine_service import start_engine_server
    from tools.launch import spawn, stop, wait_serving

    server = ServerTLS(certs["server"], certs["server_key"], client_ca=certs["ca"])
    client = ChannelTLS(certs["ca"], certs["client"], certs["client_key"])
    ca_only = ChannelTLS(certs["ca"])

    async def body():
        p_server, p_port = await start_engine_server(pair.p, "prefill", tls=server)
        d_server, d_port = await start_engine_server(pair.d, "decode", tls=server)
        port = free_port()
        router = spawn("router", port, [
            "--model", pair.p.config.model,
            "--prefill", f"127.0.0.1:{p_port}", "--decode", f"127.0.0.1:{d_port}",
            "--tls-cert", certs["server"], "--tls-key", certs["server_key"],
            "--tls-client-ca", certs["ca"], "--tls-ca", certs["ca"],
            "--tls-client-cert", certs["client"], "--tls-client-key", certs["client_key"],
        ], tmp_path)
        try:
            await asyncio.to_thread(wait_serving, router.address, [router], 120.0,
                                    client.credentials())
            async with grpc.aio.secure_channel(router.address, client.credentials()) as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                kw = dict(prompt=list(range(30, 120)), max_tokens=12, seed=8, beam_width=4)
                got = await stub.Generate(make_request(path="handoff", **kw), timeout=120)
                ref = await stub.Generate(make_request(path="colocated", **kw), timeout=120)
            # D may hold the prompt's first blocks from an earlier test: it reads the rest.
            assert_identical(got, ref, found_on_d=True)
            # Without a client certificate, or in plaintext: refused at the handshake.
            req = make_request(prompt=list(range(30, 60)), max_tokens=2)
            async with grpc.aio.secure_channel(router.address, ca_only.credentials()) as ch:
                code = await _expect_refused(router_pb2_grpc.RouterStub(ch).Generate(
                    req, timeout=10))
                assert code == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.insecure_channel(router.address) as ch:
                code = await _expect_refused(router_pb2_grpc.RouterStub(ch).Generate(
                    req, timeout=10))
                assert code == grpc.StatusCode.UNAVAILABLE
            # The engines too.
            async with grpc.aio.secure_channel(f"127.0.0.1:{d_port}",
                                               ca_only.credentials()) as ch:
                code = await _expect_refused(engine_pb2_grpc.EngineStub(ch).GetCapacity(
                    engine_pb2.CapacityRequest(), timeout=10))
                assert code == grpc.StatusCode.UNAVAILABLE
        finally:
            await asyncio.to_thread(stop, [router])
            await p_server.stop(None)
            await d_server.stop(None)

    run(body(), timeout=400)
    assert_pools_clean()
