"""LoRA adapters an engine serves, and an adapter's identity in a handoff.

KV computed under an adapter is valid only for that adapter (its q/k/v projections made
it), and vLLM's NIXL connector does not say which adapter computed the blocks it moves
(docs/decisions.md, "Adapters: what vLLM 0.32 offers"). So P signs the adapter's name and
a digest of its weights into every export (``Handoff.adapter``, ``adapter_digest``), and
D's admission refuses, before any READ, an import whose adapter is not the one its
request runs under, or whose weights differ from D's adapter of that name
(:func:`check_import_adapter`).

An engine loads its adapters at start (``EngineConfig.adapters``: name, directory in
PEFT's format); each gets a vLLM ``LoRARequest`` with a fixed id and absolute path, and
the engine's scheduler side reads the digests from ``additional_config[ADAPTERS_KEY]``.
"" names the base model (no adapter) everywhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from connector.params import ADAPTERS_KEY
from kvhandoff.digests import file_digests
from kvhandoff.types import HandoffError

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

#: The weight files a digest covers, with the config (PEFT's names).
_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
#: vLLM 0.32's ``max_lora_rank`` choices (``LoRAConfig``).
_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class AdapterError(ValueError):
    """An adapter directory vLLM could not serve (read at start, before vLLM starts)."""


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: str  # absolute
    digest: str  # SHA-256 over adapter_config.json and the weights, hex
    rank: int
    lora_id: int  # vLLM's id on this engine, >= 1

    def lora_request(self) -> LoRARequest:
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.name, self.lora_id, self.path)


def digest_of(path: Path) -> str:
    """SHA-256 over the adapter's config and weight files, each hashed whole, cached by
    (path, size, mtime, ctime) as the base model's are (``kvhandoff.digests``)."""
    return file_digests().digest(path, ("adapter_config.json", *_WEIGHTS),
                                 "kvhandoff adapter v1")


def load(name: str, path: str | Path, lora_id: int) -> Adapter:
    """The adapter in ``path`` (PEFT's ``adapter_config.json`` and weights), checked."""
    if not name or "=" in name:
        raise AdapterError(f"adapter name {name!r}: non-empty, without '='")
    where = Path(path).resolve()
    config = where / "adapter_config.json"
    if not config.is_file():
        raise AdapterError(f"adapter {name!r}: no adapter_config.json in {where}")
    if not any((where / w).is_file() for w in _WEIGHTS):
        raise AdapterError(f"adapter {name!r}: no {' or '.join(_WEIGHTS)} in {where}")
    try:
        rank = int(json.loads(config.read_text())["r"])
    except (ValueError, KeyError, TypeError) as e:
        raise AdapterError(f"adapter {name!r}: {config} has no rank 'r' ({e})") from e
    if rank > _RANKS[-1]:
        raise AdapterError(f"adapter {name!r}: rank {rank} above vLLM's {_RANKS[-1]}")
    return Adapter(name, str(where), digest_of(where), rank, lora_id)


def load_all(pairs: tuple[tuple[str, str], ...]) -> dict[str, Adapter]:
    """The configuration's adapters by name, ids 1, 2, ... in its order."""
    return {name: load(name, path, i) for i, (name, path) in enumerate(pairs, start=1)}


def max_lora_rank(adapters: dict[str, Adapter]) -> int:
    """The smallest of vLLM's ``max_lora_rank`` choices that holds every adapter."""
    widest = max(a.rank for a in adapters.values())
    return next(r for r in _RANKS if r >= widest)


def digests_of(vllm_config: Any) -> dict[str, str]:
    """Scheduler side: the engine's adapters' digests, by name."""
    extra = getattr(vllm_config, "additional_config", None)
    return dict((extra or {}).get(ADAPTERS_KEY) or {}) if isinstance(extra, dict) else {}


def adapter_of(request: Any) -> str:
    """The adapter a vLLM request runs under ("" for none)."""
    lora = getattr(request, "lora_request", None)
    return lora.lora_name if lora is not None else ""


def check_import_adapter(exported: str, exported_digest: str, wanted: str,
                         digests: dict[str, str]) -> None:
    """D's admission: the parent's KV was computed under ``exported`` (P's weights of
    ``exported_digest``); the request runs under ``wanted``. Raise :class:`HandoffError`
    ("adapter") unless they are the same adapter with the same weights."""
    if exported != wanted:
        raise HandoffError(
            "adapter",
            f"the parent was computed under {_named(exported)} and this request runs "
            f"under {_named(wanted)}: its KV is valid only for the adapter that computed it")
    if wanted and digests.get(wanted) != exported_digest:
        raise HandoffError(
            "adapter",
            f"adapter {wanted!r} differs between the engines: P's weights have digest "
            f"{exported_digest[:12] or 'none'}, this engine's "
            f"{(digests.get(wanted) or 'none')[:12]}")


def _named(adapter: str) -> str:
    return f"adapter {adapter!r}" if adapter else "no adapter (the base model)"
