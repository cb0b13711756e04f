"""A P and a D engine in this process, on one model: for the harness, tests and demo."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
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
                     **common: Any) -> AsyncIterator[LocalPair]:
    """Start P then D (about 30 s each on CPU), and with ``second_prefill`` a second P
    with P's settings; shut them down on exit."""

    model_dir = resolve_model(model)
    tokens = ModelTokens.load(model_dir)
    p = d = p2 = None
    try:
        prefill = EngineConfig(model=str(model_dir), role="prefill",
                               **{**common, **(prefill_overrides or {})})
        p = PrefillEngine.start(prefill)
        d = DecodeEngine.start(EngineConfig(model=str(model_dir), role="decode",
                                            **{**common, **(decode_overrides or {})}))
        if second_prefill:
            p2 = PrefillEngine.start(prefill)
        await asyncio.gather(*(e.warmup() for e in (p, d, p2) if e is not None))
        yield LocalPair(model_dir, p, d, tokens, p2)
    finally:
        shutdown_all([e for e in (p2, d, p) if e is not None])
        # Let the engines' cancelled output-handler tasks finish, so nothing keeps an
        # AsyncLLM alive until interpreter teardown.
        await asyncio.sleep(0.1)
        gc.collect()
