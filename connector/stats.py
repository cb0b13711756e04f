"""The connector's stats: NIXL's transfer stats plus the tokens beam fork copied."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from connector.handoff import FORK_TOKENS_KEY


class ContinuationStats(NixlKVConnectorStats):
    """NIXL's transfer stats plus the tokens beam fork copied on this engine (vLLM counts
    those with the externally loaded tokens; ``engine`` subtracts them)."""

    def reset(self) -> None:
        super().reset()
        self.data[FORK_TOKENS_KEY] = []

    def is_empty(self) -> bool:
        return super().is_empty() and not self.data.get(FORK_TOKENS_KEY)

    def aggregate(self, other: Any) -> ContinuationStats:
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self
