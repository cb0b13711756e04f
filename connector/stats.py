"""The connector's stats: NIXL's transfer stats plus the tokens beam fork copied and the
injected faults that took effect."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from connector.params import FAULTS_KEY, FORK_TOKENS_KEY, RUNS_KEY, RUNS_OUT_OF_ORDER_KEY


class ContinuationStats(NixlKVConnectorStats):
    """NIXL's transfer stats plus the tokens beam fork copied on this engine (vLLM counts
    those with the externally loaded tokens; ``engine`` subtracts them) and the injected
    faults that took effect here."""

    def reset(self) -> None:
        super().reset()
        self.data[FORK_TOKENS_KEY] = []
        self.data[FAULTS_KEY] = []
        self.data[RUNS_KEY] = []
        self.data[RUNS_OUT_OF_ORDER_KEY] = []

    def record_fork_tokens(self, num_tokens: int) -> None:
        self.data[FORK_TOKENS_KEY].append(num_tokens)

    def record_fault(self) -> None:
        self.data[FAULTS_KEY].append(1)

    def record_runs(self, num_runs: int, num_out_of_order: int) -> None:
        self.data[RUNS_KEY].append(num_runs)
        self.data[RUNS_OUT_OF_ORDER_KEY].append(num_out_of_order)

    def is_empty(self) -> bool:
        return (super().is_empty() and not self.data.get(FORK_TOKENS_KEY)
                and not self.data.get(FAULTS_KEY) and not self.data.get(RUNS_KEY))

    def aggregate(self, other: Any) -> ContinuationStats:
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self
