"""An approximate composition as the router asks for it and P's connector reads it
(``connector.blend`` does the copies): which held chunks, which of their tokens, where
in the prompt, and how many tokens are copied. Light: the router imports it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The fault that copies keys without moving them (``connector.faults``).
UNROTATED_FAULT = "unrotated"


@dataclass(frozen=True, slots=True)
class BlendPart:
    source: str  # the held request's name (a chunk's pin)
    source_start: int  # its first token in the source's tokens
    length: int
    position: int  # its first token in the prompt


@dataclass(frozen=True, slots=True)
class Blend:
    """An approximate composition as P's engine receives it (engine.proto ``Blend``)."""

    parts: tuple[BlendPart, ...]
    num_loaded: int

    def to_params(self) -> dict[str, Any]:
        """Its ``kv_transfer_params[BLEND_KEY]``."""
        return {"parts": [[p.source, p.source_start, p.length, p.position]
                          for p in self.parts], "num_loaded": self.num_loaded}

    def cache_salt(self) -> str:
        """The salt its blocks hash under: one per composition (which chunks, where,
        how much loaded), so two identical ones share their prefix-cache blocks and
        nothing else does."""
        digest = hashlib.sha256(json.dumps(self.to_params()).encode()).hexdigest()
        return f"kvhandoff-blend:{digest[:32]}"


def parse_parts(spec: Mapping[str, Any]) -> tuple[list[BlendPart], int]:
    """The parts and loaded-token count of a ``BLEND_KEY`` spec; ValueError if malformed."""
    parts = [BlendPart(str(s), int(a), int(n), int(p)) for s, a, n, p in spec["parts"]]
    at = 0
    for part in parts:
        if part.position != at or part.length <= 0 or part.source_start < 0:
            raise ValueError(f"parts must tile the prompt from 0: {part} at {at}")
        at += part.length
    num_loaded = int(spec["num_loaded"])
    if not 0 <= num_loaded <= at:
        raise ValueError(f"num_loaded {num_loaded} outside the parts' {at} tokens")
    return parts, num_loaded


