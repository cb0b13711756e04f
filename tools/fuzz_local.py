"""The malformed-input corpus (``tools.fuzz``) run against engines: over the gRPC ports of
an in-process P and D (``fuzz_pair``: ``kvhandoff verify --fuzz N``, and the tests), or of
engine servers already running (``throw``: the tests' process cluster).

``throw`` runs the corpus, gives back its parents, then checks what must hold after it:
the good request (the parent imported as exported) gives the beams of the colocated
reference (the same prompt's beam search on P, no handoff), and every call the corpus
allowed to succeed gave those beams too. The caller checks the pools (they must be back
where they were)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

import grpc

from kvhandoff.ports import free_port
from kvhandoff.v1 import engine_pb2, engine_pb2_grpc
from tools.fuzz import BEAM, Context, Corpus

logger = logging.getLogger(__name__)


def throw(p_address: str, d_address: str, *, n: int, seed: int, prompt: list[int],
          suffix: list[int], vocab_size: int, secret: bytes | None = None,
          metadata: tuple[tuple[str, str], ...] = (),
          channel: Any = grpc.insecure_channel) -> dict[str, Any]:
    """The corpus's report (``tools.fuzz.Report.to_dict``) plus ``identical`` (the good
    request's beams are the reference's) and ``failures`` (every rule broken)."""
    with channel(p_address) as pc, channel(d_address) as dc:
        p, d = engine_pb2_grpc.EngineStub(pc), engine_pb2_grpc.EngineStub(dc)

        def raw(engine: str, method: str, data: bytes) -> Any:
            ch = pc if engine == "p" else dc
            if method.endswith("/Stage1"):  # server-streaming
                return list(ch.unary_stream(method)(data, timeout=60, metadata=metadata))
            return ch.unary_unary(method)(data, timeout=60, metadata=metadata)

        corpus = Corpus(p, d, prompt=prompt, suffix=suffix, secret=secret, metadata=metadata,
                        ctx=Context(nobody_port=free_port(), vocab_size=vocab_size), raw=raw)
        try:
            report = corpus.run(n, seed)
            good = corpus.good("fuzz-good-after")
            parent = corpus.parent()
            reference = [tuple(b.token_ids) for b in p.Stage2(engine_pb2.Stage2Request(
                request_id="fuzz-reference", prompt_token_ids=parent.prompt, beam=BEAM),
                timeout=120, metadata=metadata).beams]
        finally:
            corpus.release()
    failures = list(report.failures)
    if good != reference:
        failures.append(f"the good request after the corpus gave {good}, the colocated "
                        f"reference {reference}")
    for name, beams in report.ok_beams:
        if beams != reference:
            failures.append(f"{name}: succeeded with beams {beams}, not the reference's")
    return {**report.to_dict(), "failures": failures, "identical": good == reference,
            "succeeded_with_reference_beams": len(report.ok_beams)}


async def fuzz_pair(pair: Any, *, n: int, seed: int, secret: bytes | None = None
                    ) -> dict[str, Any]:
    """``throw`` at an in-process pair (``tools.local.LocalPair``) through gRPC servers
    started here over its engines, stopped after."""
    from server.engine_service import start_engine_server

    servers = []
    try:
        addresses = []
        for engine, role in ((pair.p, "prefill"), (pair.d, "decode")):
            server, port = await start_engine_server(engine, role, port=free_port())
            servers.append(server)
            addresses.append(f"127.0.0.1:{port}")
        rng = random.Random(seed)
        prompt = [rng.randrange(6, pair.p.vocab_size) for _ in range(70)]
        return await asyncio.to_thread(
            throw, *addresses, n=n, seed=seed, prompt=prompt,
            suffix=list(pair.default_suffix_ids), vocab_size=pair.p.vocab_size,
            secret=secret)
    finally:
        for server in servers:
            await server.stop(grace=1.0)


async def _one_pair(model: str | None, n: int, seed: int, signed: bool) -> dict[str, Any]:
    from tools.local import local_pair

    with tempfile.TemporaryDirectory() as tmp:
        secret = None
        common: dict[str, Any] = {}
        if signed:
            secret_file = Path(tmp) / "handoff.secret"
            secret_file.touch(0o600)
            secret_file.write_text(secrets.token_hex(32))
            common["handoff_secret_file"] = str(secret_file)
            from connector.signing import load_secret

            secret = load_secret(str(secret_file))
        async with local_pair(model, lease_s=30, **common,
                              prefill_overrides={"kv_cache_memory_bytes": 32 << 20},
                              decode_overrides={"kv_cache_memory_bytes": 32 << 20}) as pair:
            before = (pair.p.pool(), pair.d.pool())
            result = await fuzz_pair(pair, n=n, seed=seed, secret=secret)
            pools = {}
            for name, engine in (("P", pair.p), ("D", pair.d)):
                snap = await engine.wait_pool_clean(35.0)
                pools[name] = {"clean": snap.is_clean, "now": str(snap)}
                if not snap.is_clean:
                    result["failures"].append(f"{name}'s pool not back: {snap}")
            result["pools"] = pools
            result["pools_before"] = [str(s) for s in before]
            return result


def main_fuzz(model: str | None, n: int, seed: int | None, json_path: str | None) -> int:
    """``kvhandoff verify --fuzz N``: the corpus at a pair without a handoff secret, then
    at a pair with one; exit 0 only if neither broke a rule."""
    seed = random.SystemRandom().randrange(2**32) if seed is None else seed
    results = {}
    for signed in (False, True):
        label = "signed" if signed else "unsigned"
        print(f"fuzz ({label}): {n} calls, seed {seed}", flush=True)
        results[label] = asyncio.run(_one_pair(model, n, seed, signed))
        r = results[label]
        codes = ", ".join(f"{k} {v}" for k, v in sorted(r["by_code"].items()))
        print(f"  sent {r['sent']}: {codes}; identical after: {r['identical']}; "
              f"failures: {len(r['failures'])}", flush=True)
        for failure in r["failures"][:20]:
            print(f"  FAIL {failure}", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps({"seed": seed, **results}, indent=2))
    return 0 if not any(r["failures"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main_fuzz(None, int(sys.argv[1]) if len(sys.argv) > 1 else 0, 1, None))
