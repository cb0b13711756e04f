"""A P and a D engine in this process, on one model: for the harness, tests and demo.

With ``on_hosts`` (tools.netns hosts ``p`` and ``d``) each engine's processes run on its
own network host: the engine is started from a thread that entered that host, so the
engine core and its workers (spawned from that thread) open their sockets there, NIXL's
side channel and UCX included, while this process drives them over ZMQ's ipc sockets
(files, which a network namespace does not separate)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decode_engine.engine import DecodeEngine
from engine import EngineConfig, shutdown_all
from kvhandoff.model import ModelTokens, resolve_model
from prefill_engine.engine import PrefillEngine

logger = logging.getLogger(__name__)


@dataclass
class LocalPair:
    model_dir: Path
    p: Any  # PrefillEngine
    d: Any  # DecodeEngine
    tokens: ModelTokens
    #: A second P (``second_prefill``): moves between Ps.
    p2: Any = None
    #: A second D (``second_decode``): beam searches moved between Ds.
    d2: Any = None

    @property
    def tokenizer(self) -> Any:
        return self.tokens.tokenizer

    @property
    def think_end_id(self) -> int | None:
        return self.tokens.think_end_id

    @property
    def eos_id(self) -> int | None:
        return self.tokens.eos_id

    @property
    def default_suffix_ids(self) -> list[int]:
        return self.tokens.default_suffix_ids


@contextlib.asynccontextmanager
async def local_pair(model: str | None = None, *, prefill_overrides: dict[str, Any] | None = None,
                     decode_overrides: dict[str, Any] | None = None,
                     second_prefill: bool = False,
                     second_decode: bool = False,
                     on_hosts: dict[str, Any] | None = None,
                     ucx_log_dir: Path | None = None,
                     **common: Any) -> AsyncIterator[LocalPair]:
    """Start P then D (about 30 s each on CPU), and with ``second_prefill`` a second P
    with P's settings, with ``second_decode`` a second D with D's; shut them down on
    exit. ``on_hosts``: P (and the second P) on host ``p``, D (and the second D) on host
    ``d`` (see the module docstring), UCX limited to TCP over the
    hosts' interfaces, its protocol tables in ``ucx_log_dir/<role>.<pid>.ucx.log``."""

    model_dir = resolve_model(model)
    tokens = ModelTokens.load(model_dir)
    p = d = p2 = d2 = None
    try:
        prefill = EngineConfig(model=str(model_dir), role="prefill",
                               **{**common, **(prefill_overrides or {}),
                                  **_host_settings(on_hosts, "p", "prefill", ucx_log_dir)})
        decode = EngineConfig(model=str(model_dir), role="decode",
                              **{**common, **(decode_overrides or {}),
                                 **_host_settings(on_hosts, "d", "decode", ucx_log_dir)})
        hosts = on_hosts or {}
        p = _start_on(hosts.get("p"), lambda: PrefillEngine.start(prefill))
        d = _start_on(hosts.get("d"), lambda: DecodeEngine.start(decode))
        if second_prefill:
            p2 = _start_on(hosts.get("p"), lambda: PrefillEngine.start(prefill))
        if second_decode:
            d2 = _start_on(hosts.get("d"), lambda: DecodeEngine.start(decode))
        await asyncio.gather(*(e.warmup() for e in (p, d, p2, d2) if e is not None))
        yield LocalPair(model_dir, p, d, tokens, p2, d2)
    finally:
        shutdown_all([e for e in (d2, p2, d, p) if e is not None])
        # Let the engines' cancelled output-handler tasks finish, so nothing keeps an
        # AsyncLLM alive until interpreter teardown.
        await asyncio.sleep(0.1)
        gc.collect()


def _host_settings(on_hosts: dict[str, Any] | None, name: str, role: str,
                   ucx_log_dir: Path | None) -> dict[str, Any]:
    """EngineConfig fields of an engine on host ``name``: its address for NIXL's side
    channel, its interface and TCP for UCX (as ``tools.launch`` runs engines on hosts)."""
    if not on_hosts:
        return {}
    from tools.launch import HOSTS_UCX_TLS
    from tools.ucx_report import ucx_env

    host = on_hosts[name]
    env = {"UCX_TLS": HOSTS_UCX_TLS}
    if ucx_log_dir is not None:
        ucx_log_dir.mkdir(parents=True, exist_ok=True)
        env.update(ucx_env(str(ucx_log_dir / f"{role}.%p.ucx.log")))
    return {"side_channel_host": host.address, "ucx_net_devices": host.interface,
            "extra_env": env}


def _start_on(host: Any, start: Callable[[], Any]) -> Any:
    """``start()``, from a thread on ``host`` (``tools.netns.enter``) when one is given:
    the processes it spawns live on that host. Engines start one at a time (``start``
    sets the environment the engine core copies)."""
    if host is None:
        return start()
    from tools.netns import enter

    box: dict[str, Any] = {}

    def body() -> None:
        try:
            enter(host)
            box["engine"] = start()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=body, name=f"start-on-{host.name}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["engine"]
