"""Positional sampling: a sampled token that depends only on (seed, position, logits).

vLLM draws a seeded request's randomness from a per-request ``torch.Generator`` whose
state advances with every step on that engine, so no other engine can continue the same
random sequence. Here a token is drawn by Gumbel-max: the logits, shaped as vLLM shapes
them (temperature, then min-p, then vLLM's own top-k/top-p), plus Gumbel noise whose
uniforms come from a counter-based hash of (seed, absolute position, token id). The
request itself runs greedy (temperature 0), so vLLM's sampler takes the argmax of these
logits: a draw from softmax(logits / T) truncated as vLLM truncates, the same on any engine,
in any batch, and after any move (the position is absolute: prompt plus output).

Loaded by vLLM as a logits processor (``logits_processors=["engine.sampling:PositionalSampler"]``,
``engine.config``) in each worker. A request opts in with
``SamplingParams(temperature=0, extra_args={SAMPLE_KEY: spec})``, ``spec`` from :func:`spec_of`;
every other request is left as it is. Stop tokens, ``min_tokens`` (vLLM masks them to
-inf, which stays -inf here) and ``max_tokens`` keep vLLM's meaning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from connector.params import SAMPLE_KEY

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

    from kvhandoff.types import Stage1Params

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def spec_of(*, seed: int, temperature: float, top_k: int = 0, top_p: float = 1.0,
            min_p: float = 0.0) -> dict[str, Any]:
    """A request's positional-sampling parameters (``extra_args[SAMPLE_KEY]``)."""
    if seed is None:
        raise ValueError("positional sampling needs a seed")
    return {"seed": int(seed) & _MASK64, "temperature": float(temperature),
            "top_k": int(top_k), "top_p": float(top_p), "min_p": float(min_p)}


def sampling_params(params: Stage1Params, extra_args: dict[str, Any] | None = None,
                    logprobs: int | None = None) -> SamplingParams:
    """vLLM sampling parameters for ``params`` (stage 1, or a sampled stage 2), with
    ``extra_args`` (e.g. ``kv_transfer_params``) and ``logprobs`` (default: the
    params'). Positional ones run greedy with their spec under :data:`SAMPLE_KEY`; the others
    are vLLM's own seeded sampling."""
    from vllm import SamplingParams

    if logprobs is None:
        logprobs = params.logprobs
    extra = dict(extra_args or {})
    if params.positional and params.temperature > 0:  # greedy is positional already
        extra[SAMPLE_KEY] = spec_of(seed=params.seed, temperature=params.temperature,
                             top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
        return SamplingParams(
            max_tokens=params.max_tokens, temperature=0.0,
            stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
            min_tokens=params.min_tokens, logprobs=logprobs, detokenize=False,
            extra_args=extra)
    return SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, min_p=params.min_p, seed=params.seed,
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens, logprobs=logprobs, detokenize=False,
        extra_args=extra or None)


def _mix64(x: int) -> int:
    """SplitMix64's finaliser on a Python int (exact, unsigned 64-bit)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 lanes (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def uniforms(seed: int, position: int, n: int, device: torch.device | str = "cpu"
             ) -> torch.Tensor:
    """``n`` uniforms in (0, 1), float64, one per token id: a pure function of (seed,
    position). Token ``t``'s is SplitMix64 of ``key(seed, position) + (t + 1) * golden``
    in wrapping 64-bit arithmetic (int64 lanes wrap like the unsigned ones)."""
    key = _mix64(_mix64(seed) ^ (position & _MASK64))
    x = torch.arange(1, n + 1, dtype=torch.int64, device=device)
    x = x * _signed(_GOLDEN) + _signed(key)
    x = (x ^ _srl(x, 30)) * _signed(_MIX1)
    x = (x ^ _srl(x, 27)) * _signed(_MIX2)
    x = x ^ _srl(x, 31)
    return (_srl(x, 11).to(torch.float64) + 0.5) / float(1 << 53)


def uniform_reference(seed: int, position: int, token: int) -> float:
    """:func:`uniforms` for one token, in exact integer arithmetic (tests compare)."""
    key = _mix64(_mix64(seed) ^ (position & _MASK64))
    x = _mix64((key + (token + 1) * _GOLDEN) & _MASK64)
    return ((x >> 11) + 0.5) / float(1 << 53)


def shaped_logits(logits: torch.Tensor, spec: dict[str, Any]) -> torch.Tensor:
    """One row's logits as vLLM shapes them before sampling: divided by the temperature,
    then min-p, then vLLM's own top-k/top-p (masked tokens are -inf). float32."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    out = logits.to(torch.float32) / max(spec["temperature"], 1e-5)
    if spec["min_p"] > 0:
        probs = torch.softmax(out, dim=-1)
        out = out.masked_fill(probs < spec["min_p"] * probs.max(), -math.inf)
    k = spec["top_k"] if 0 < spec["top_k"] < out.shape[-1] else None
    p = spec["top_p"] if spec["top_p"] < 1.0 else None
    if k is not None or p is not None:
        out = apply_top_k_top_p_pytorch(
            out.unsqueeze(0),
            None if k is None else torch.tensor([k], device=out.device),
            None if p is None else torch.tensor([p], device=out.device),
        ).squeeze(0)
    return out


def perturbed(logits: torch.Tensor, spec: dict[str, Any], position: int) -> torch.Tensor:
    """Shaped logits plus Gumbel noise for ``position``: their argmax is the token."""
    u = uniforms(spec["seed"], position, logits.shape[-1], logits.device)
    gumbel = -torch.log(-torch.log(u))
    return shaped_logits(logits, spec) + gumbel.to(torch.float32)


@dataclass(slots=True)
class _Row:
    spec: dict[str, Any]
    num_prompt_tokens: int
    output_token_ids: list[int]  # vLLM's live list: grows as the request decodes

    @property
    def position(self) -> int:
        """The absolute position of the token about to be sampled."""
        return self.num_prompt_tokens + len(self.output_token_ids)


class PositionalSampler(LogitsProcessor):
    """Replaces the logits of each opted-in row by :func:`perturbed` (see the module
    docstring); rows of other requests are untouched."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        spec = (sampling_params.extra_args or {}).get(SAMPLE_KEY)
        if spec is None:
            return
        if sampling_params.temperature != 0.0:
            raise ValueError(f"{SAMPLE_KEY}: the request must be greedy (temperature 0); the "
                             "temperature goes in its positional parameters")
        for name in ("seed", "temperature", "top_k", "top_p", "min_p"):
            if name not in spec:
                raise ValueError(f"{SAMPLE_KEY}: missing {name!r}")

    def __init__(self, vllm_config: VllmConfig, device: torch.device,
                 is_pin_memory: bool) -> None:
        self._rows: dict[int, _Row] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, _row_of)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, row in self._rows.items():
            logits[index] = perturbed(logits[index], row.spec, row.position)
        return logits


def _row_of(params: SamplingParams | None, prompt_token_ids: list[int] | None,
            output_token_ids: list[int]) -> _Row | None:
    spec = ((params.extra_args or {}) if params is not None else {}).get(SAMPLE_KEY)
    if spec is None:
        return None
    return _Row(spec, len(prompt_token_ids or ()), output_token_ids)
