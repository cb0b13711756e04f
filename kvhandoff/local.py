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

from kvhandoff.model import DEFAULT_SUFFIX_TEXT, THINK_END, resolve_model

logger = logging.getLogger(__name__)


@dataclass
class ModelTokens:
    """Token ids of the model's special tokens and the default continuation suffix."""

    tokenizer: Any
    think_end_id: int | None
    eos_id: int | None
    default_suffix_ids: list[int]

    @classmethod
    def load(cls, model_dir: Path) -> ModelTokens:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        think_end = tok.convert_tokens_to_ids(THINK_END)
        if think_end is None or think_end == tok.unk_token_id:
            think_end = None
        return cls(
            tokenizer=tok,
            think_end_id=think_end,
            eos_id=tok.eos_token_id,
            default_suffix_ids=tok.encode(DEFAULT_SUFFIX_TEXT, add_special_tokens=False),
        )


@dataclass
class LocalPair:
    model_dir: Path
    p: Any  # PrefillEngine
    d: Any  # DecodeEngine
    tokens: ModelTokens

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
                     **common: Any) -> AsyncIterator[LocalPair]:
    """Start P then D (about 30 s each on CPU); shut both down on exit."""
    from decode_engine.engine import DecodeEngine
    from kvhandoff.engine import EngineConfig, shutdown_all
    from prefill_engine.engine import PrefillEngine

    model_dir = resolve_model(model)
    tokens = ModelTokens.load(model_dir)
    p = d = None
    try:
        p = PrefillEngine.start(EngineConfig(model=str(model_dir), role="prefill",
                                             **{**common, **(prefill_overrides or {})}))
        d = DecodeEngine.start(EngineConfig(model=str(model_dir), role="decode",
                                            **{**common, **(decode_overrides or {})}))
        await asyncio.gather(p.warmup(), d.warmup())
        yield LocalPair(model_dir, p, d, tokens)
    finally:
        shutdown_all([d, p])
        # Let the engines' cancelled output-handler tasks finish, so nothing keeps an
        # AsyncLLM alive until interpreter teardown.
        await asyncio.sleep(0.1)
        gc.collect()
