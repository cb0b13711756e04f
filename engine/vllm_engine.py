"""One vLLM engine (AsyncLLM) configured for kvhandoff, shared by the P and D wrappers.

Both roles load the same connector so either can export or import; the decode role also
installs the admission-checking scheduler. Each engine gets its own NIXL side-channel
port, set in the environment the engine-core process is started with.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from connector.adapters import Adapter
from connector.adapters import load_all as load_adapters
from connector.faults import FAULTS
from engine.catalog import Catalog, load
from engine.config import EngineConfig, engine_env, environment
from engine.kv_events import EventEndpoints, EventRelay
from engine.stats import EngineCounters, PoolSnapshot, stats_logger_factory
from kvhandoff.event_keys import EventKeys
from kvhandoff.ports import check_listenable, free_port
from kvhandoff.types import StageError

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

def load_catalogs(config: EngineConfig) -> dict[str, Catalog]:
    """The configuration's catalogs, checked against the model's vocabulary and EOS (read
    from its ``config.json``, as vLLM does)."""
    if not config.catalogs:
        return {}
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(config.model)
    vocab = hf.vocab_size
    eos = getattr(hf, "eos_token_id", None)
    catalogs = {name: load(name, path, vocab, eos) for name, path in config.catalogs}
    for c in catalogs.values():
        logger.info("Catalog %r: %d items, %d trie nodes, items of %d-%d tokens (%s)",
                    c.name, c.num_items, c.num_nodes, c.min_item_len, c.max_item_len,
                    c.digest)
    return catalogs


class VllmEngine:
    """An AsyncLLM with the kvhandoff connector; base of PrefillEngine/DecodeEngine."""

    def __init__(self, config: EngineConfig, llm: AsyncLLM, engine_id: str,
                 stats: dict[str, Any], catalogs: dict[str, Catalog] | None = None,
                 adapters: dict[str, Adapter] | None = None):
        self.config = config
        #: Catalogs beams may be constrained to, by name (loaded by ``start``).
        self.catalogs: dict[str, Catalog] = catalogs or {}
        #: LoRA adapters requests may run under, by name (loaded by ``start``).
        self.adapters: dict[str, Adapter] = adapters or {}
        #: Where its KV events are read (None: not published); set by ``start``.
        self.kv_events: EventEndpoints | None = None
        self._relay: EventRelay | None = None
        self.llm = llm
        self.engine_id = engine_id
        #: What P addresses (and signs) handoffs for this engine with.
        self.handoff_target = config.handoff_group or engine_id
        self._stats = stats
        cache = llm.vllm_config.cache_config
        self.block_size: int = cache.block_size
        # vLLM reserves one block as the null block.
        self.num_total_blocks: int = (cache.num_gpu_blocks or 1) - 1
        #: Peak blocks of the stage 2s running here (see run_beam_stage).
        self.num_reserved_blocks: int = 0
        self._steps_run = 0  # run_one_step's request ids
        model_config = llm.vllm_config.model_config
        self.vocab_size: int = model_config.get_vocab_size()
        self.max_model_len: int = model_config.max_model_len
        self.eos_token_id: int | None = getattr(model_config.hf_config, "eos_token_id", None)
        #: The widest beam search here: the configuration's, and 2W logprobs within the
        #: vocabulary.
        self.max_beam_width: int = min(config.max_beam_width, self.vocab_size // 2)

    @classmethod
    def start(cls, config: EngineConfig, **kwargs: Any):
        """Start the engine (blocks until its engine core is up: ~30 s on CPU)."""
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_id = config.engine_id or f"{config.role}-{uuid.uuid4().hex[:8]}"
        if config.side_channel_port:
            # A port asked for and taken fails here, in a second, not after the ~30 s
            # start (the connector's own check stays: the port may be taken in between).
            check_listenable(config.side_channel_host, config.side_channel_port,
                             "the NIXL side channel")
        port = config.side_channel_port or free_port(config.side_channel_host)
        # A bad catalog fails the start here, with its file and line, before vLLM starts.
        catalogs = load_catalogs(config)
        adapters = load_adapters(config.adapters)
        for a in adapters.values():
            logger.info("Adapter %r: rank %d, %s (%s)", a.name, a.rank, a.path, a.digest[:12])
        keys = (EventKeys.from_file(config.kv_events_key_file)
                if config.kv_events and config.kv_events_key_file else None)
        events = (EventEndpoints.pick(engine_id, config.kv_events_host, keyed=keys is not None)
                  if config.kv_events else None)
        env = engine_env(config, port)
        stats: dict[str, Any] = {}
        t0 = time.perf_counter()
        with environment(env):
            # No local for the AsyncLLM: vLLM keeps this frame alive, and a local here
            # would keep the engine from being collected after shutdown().
            engine = cls(
                config,
                AsyncLLM.from_engine_args(
                    config.engine_args(engine_id, events, adapters),
                    stat_loggers=[stats_logger_factory(stats)]
                ),
                engine_id,
                stats,
                catalogs,
                adapters,
                **kwargs,
            )
        if events is not None:
            engine.kv_events, engine._relay = events, EventRelay(events, keys)
        logger.info("Engine %s (%s) up in %.1fs, NIXL side channel %s:%d%s",
                    engine_id, config.role, time.perf_counter() - t0,
                    config.side_channel_host, port,
                    f", KV events {events.endpoint} (replay {events.replay_endpoint})"
                    if events is not None else "")
        return engine

    def lora_request(self, adapter: str) -> LoRARequest | None:
        """vLLM's request for the adapter named ``adapter`` ("": none); a
        :class:`StageError` ("no_adapter": NOT_FOUND) when this engine lacks it."""
        if not adapter:
            return None
        found = self.adapters.get(adapter)
        if found is None:
            raise StageError("request", "no_adapter",
                             f"no adapter {adapter!r} on this engine (it serves "
                             f"{sorted(self.adapters) or 'none'})")
        return found.lora_request()

    async def stream(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str, adapter: str = "", cache_salt: str | None = None
                     ) -> AsyncIterator[RequestOutput]:
        """Run one request (under ``adapter``, "": none; ``cache_salt``: its blocks hash
        apart from every request without the same salt), yielding each output delta (new
        tokens only). Cancelling the consumer aborts the request in the engine."""
        from vllm.sampling_params import RequestOutputKind

        if self.llm is None:
            raise RuntimeError(f"engine {self.engine_id} is shut down")
        lora = self.lora_request(adapter)
        params.output_kind = RequestOutputKind.DELTA
        async for out in self.llm.generate(_prompt(prompt_token_ids, cache_salt), params,
                                           request_id, lora_request=lora):
            yield out

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, adapter: str = "", cache_salt: str | None = None
                       ) -> RequestOutput:
        """Run one request (under ``adapter``, "": none; ``cache_salt`` as in
        :meth:`stream`) to completion and return its final output."""
        from vllm.sampling_params import RequestOutputKind

        if self.llm is None:
            raise RuntimeError(f"engine {self.engine_id} is shut down")
        lora = self.lora_request(adapter)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        final = None
        async for out in self.llm.generate(_prompt(prompt_token_ids, cache_salt), params,
                                           request_id, lora_request=lora):
            final = out
        assert final is not None and final.finished, f"{request_id}: no final output"
        return final

    async def warmup(self) -> None:
        """Run the first logprobs requests now. vLLM compiles its logprobs gather on
        first use (seconds on CPU); during that the engine does not step, so a KV READ
        in flight would look seconds slow and could outlive P's lease."""
        from vllm import SamplingParams

        for k in (2, 8):
            await self.generate([1, 2, 3], SamplingParams(max_tokens=1, temperature=0.0,
                                                          logprobs=k, detokenize=False),
                                f"warmup-{self.engine_id}-{k}")

    async def run_one_step(self) -> None:
        """Return once the engine has run a step begun after this call: whatever its
        scheduler side handed the workers before (an injected ``stale`` fault's overwrite
        of exported blocks, which rides on the next step's connector metadata) has been
        applied. A one-token request is such a step."""
        from vllm import SamplingParams

        self._steps_run += 1
        await self.generate([1, 2, 3], SamplingParams(max_tokens=1, temperature=0.0,
                                                      detokenize=False),
                            f"step-{self.engine_id}-{self._steps_run}")

    def check_fault(self, fault: str) -> None:
        """Raise ``ValueError`` unless this engine may inject ``fault``."""

        if not self.config.fault_injection:
            raise ValueError(f"fault {fault!r}: engine {self.engine_id} was not started "
                             "with fault_injection")
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    @property
    def counters(self) -> EngineCounters:
        return self._stats["counters"]

    def pool(self) -> PoolSnapshot:
        s = self._stats.get("scheduler")
        used = round(s.kv_cache_usage * self.num_total_blocks) if s else 0
        return PoolSnapshot(
            num_total_blocks=self.num_total_blocks,
            num_used_blocks=used,
            num_running_reqs=s.num_running_reqs if s else 0,
            num_waiting_reqs=(s.num_waiting_reqs + s.num_skipped_waiting_reqs) if s else 0,
            block_size=self.block_size,
        )

    async def wait_pool_clean(self, timeout_s: float = 10.0) -> PoolSnapshot:
        """Wait until no block is held (exports are released when D has read them)."""
        deadline = time.monotonic() + timeout_s
        while True:
            snap = self.pool()
            if snap.is_clean or time.monotonic() >= deadline:
                return snap
            await asyncio.sleep(0.05)

    async def empty_prefix_cache(self, timeout_s: float = 10.0) -> None:
        """Empty the prefix cache of an engine that is about to be idle: vLLM refuses the
        reset while any block is held (an export until D has read it, a kept beam step
        until it is released), so wait for a clean pool and retry; raise if it never is."""
        deadline = time.monotonic() + timeout_s
        while True:
            await self.wait_pool_clean(max(0.0, deadline - time.monotonic()))
            if await self.llm.reset_prefix_cache():
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{self.engine_id}: prefix cache not emptied within "
                                   f"{timeout_s:.0f}s, blocks still held: {self.pool()}")
            await asyncio.sleep(0.05)

    def shutdown(self) -> None:
        """Stop the engine-core and worker processes. Idempotent."""
        relay, self._relay = self._relay, None
        if relay is not None:
            relay.close()
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()
            # AsyncLLM.__del__ shuts down again; let that happen now, not during
            # interpreter teardown when the modules it calls are already gone.
            del llm
            gc.collect()


def shutdown_all(engines: list[VllmEngine | None]) -> None:
    """Shut engines down in parallel (each waits up to ~5 s for its processes)."""
    live = [e for e in engines if e is not None]
    threads = [threading.Thread(target=e.shutdown, name=f"shutdown-{e.engine_id}") for e in live]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _prompt(prompt_token_ids: list[int], cache_salt: str | None) -> Any:
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=prompt_token_ids)
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt
