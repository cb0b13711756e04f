"""The KV connector vLLM loads by module path (``connector.nixl_continuation``) in every
engine process, and the handoff it speaks: the typed, versioned :class:`Handoff` and D's
checks (``handoff``), every key and report it hands through vLLM (``params``), signing
(``signing``), beam fork (``beam_fork``), the runtime adjustments to NIXL and vLLM
(``runtime``), stats and the harness's injected faults.
Importing this package does not import vLLM; ``nixl_continuation`` does."""

from __future__ import annotations

from connector.handoff import PROTOCOL_VERSION, Handoff
from connector.params import KEY

__all__ = ["KEY", "PROTOCOL_VERSION", "Handoff"]
