"""The application's arguments (``args:`` in ``deploy/config.yaml``), validated up front.

Everything a Serve deployment of kvhandoff can be told is here, checked field by field
and across fields before any replica starts: P and D run the same model and the same
vLLM, their block sizes match (D reads P's blocks as they are), the router's beam width
fits D's ``max_logprobs``, and on GPU nodes each engine replica reserves whole GPUs
(its tensor-parallel size), so a P and a D replica never share one.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from kvhandoff.types import MAX_BEAM_WIDTH


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Autoscaling(_Strict):
    """Ray Serve autoscaling for one role (replaces ``num_replicas``): Serve's own
    ``AutoscalingConfig`` fields, passed as they are. Under the application's policy
    (``deploy.autoscale``) Serve still applies the bounds and the delays; the policy
    replaces ``target_ongoing_requests``."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: PositiveInt = 1
    target_ongoing_requests: float = Field(4.0, gt=0)
    #: How often a replica sends its metrics (its load, and the engine's pool) to Serve's
    #: controller, and the window they are averaged over.
    metrics_interval_s: float = Field(10.0, gt=0)
    look_back_period_s: float = Field(30.0, gt=0)
    #: How long a decision to add (remove) replicas must hold before Serve acts on it.
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling: min_replicas > max_replicas")
        return self


class PDScaling(_Strict):
    """The knobs of the application-level autoscaling policy (``deploy.autoscale.
    PDScalePolicy``), given as its ``policy_kwargs`` in the Serve config and validated
    here when Serve's controller loads the policy. Prefill is sized by its queue, Decode
    by its reserved KV blocks and its requests, both within their ``autoscaling``
    bounds and together within ``max_engine_replicas``."""

    #: Stage 1s (running or waiting in P's engines, or queued in Serve's handles for
    #: Prefill) one P replica should carry: P replicas = ceil(queue / this).
    prefill_queue_per_replica: float = Field(4.0, gt=0)
    #: Share of D's KV pool to keep free: D replicas = ceil(reserved blocks /
    #: ((1 - this) x one replica's blocks)).
    decode_free_fraction: float = Field(0.25, ge=0, lt=1)
    #: Requests (stage 2s running on D or queued for Decode) one D replica should carry.
    decode_requests_per_replica: float = Field(8.0, gt=0)
    #: P + D replicas at most (the engines' shared GPUs or CPUs); None: each role's own
    #: ``max_replicas`` only. Over it, the replicas go to the roles in proportion to
    #: what each asks, each keeping its ``min_replicas``.
    max_engine_replicas: PositiveInt | None = None


class EngineArgs(_Strict):
    """One vLLM engine (see ``engine.EngineConfig``)."""

    kv_cache_mib: PositiveInt = 256
    block_size: PositiveInt = 32
    max_model_len: PositiveInt = 4096
    max_num_seqs: PositiveInt = 128
    max_logprobs: int = Field(2 * MAX_BEAM_WIDTH, ge=2)
    tensor_parallel_size: PositiveInt = 1
    #: "cuda" on GPU nodes (NIXL reads device to device), "cpu" on CPU nodes; None: the
    #: platform default.
    kv_buffer_device: Literal["cuda", "cpu"] | None = None
    dtype: str | None = None
    load_format: str | None = None
    enforce_eager: bool = True
    #: CPU nodes: torch threads per engine.
    cpu_threads: PositiveInt | None = 1
    #: Address D's NIXL side channel connects to P on: the node's IP by default
    #: (``127.0.0.1`` only when everything runs on one node); one interface, never
    #: 0.0.0.0 (it hands out the KV pool's NIXL registration: docs/security.md).
    side_channel_host: str | None = None
    #: 0: each replica binds a free port (unique on its node). Otherwise the first of
    #: a range: replica ``rank`` uses ``side_channel_port + rank``.
    side_channel_port: int = Field(0, ge=0, le=65535)
    #: UCX_NET_DEVICES for NIXL's READs (e.g. "mlx5_0:1", "eth1"); None: UCX's choice,
    #: every interface (what P and D on different nodes need); "lo": one machine only.
    ucx_net_devices: str | None = None
    #: Accept requests that name an injected fault of ``connector.faults`` (the tests'
    #: negative controls only; ``kvhandoff serve --fault-injection``).
    fault_injection: bool = False
    #: LoRA adapters the engine serves: name -> a directory in PEFT's format on every
    #: node a replica may land on (``kvhandoff serve --adapter NAME=PATH``). P and D must
    #: serve the same files under a name: D refuses an import whose digest differs.
    adapters: dict[str, str] = {}
    #: Catalogs beams may be kept in: name -> a file of items on every node, or
    #: "builtin" (the built-in model's shop) (``kvhandoff serve --catalog NAME=PATH``).
    catalogs: dict[str, str] = {}
    #: Publish vLLM's KV events (P's are what the router places stage 1 by). They carry
    #: every prompt's token ids: on loopback (followed by router replicas on the same
    #: node) unless ``kv_events_host`` says otherwise, which needs ``kv_events_key_file``
    #: (CURVE; ``kvhandoff serve --kv-events-key``).
    kv_events: bool = True
    kv_events_host: str = "127.0.0.1"
    kv_events_key_file: str | None = None

    @model_validator(mode="after")
    def _block_size(self) -> EngineArgs:
        if self.block_size % 16:
            raise ValueError(f"block_size must be a multiple of 16, not {self.block_size}")
        from kvhandoff.keys import is_wildcard
        from kvhandoff.ports import is_loopback

        if self.side_channel_host and is_wildcard(self.side_channel_host):
            raise ValueError(f"side_channel_host {self.side_channel_host!r}: the NIXL side "
                             "channel listens on one interface; name the node's address")
        if self.kv_events and not self.kv_events_key_file and not is_loopback(
                self.kv_events_host):
            raise ValueError(f"kv_events_host {self.kv_events_host} needs kv_events_key_file: "
                             "KV events carry every prompt's token ids")
        return self


class RoleArgs(_Strict):
    """The prefill (P) or decode (D) deployment."""

    num_replicas: PositiveInt = 1
    autoscaling: Autoscaling | None = None
    #: Ray resources per replica. ``num_gpus`` defaults to the tensor-parallel size on
    #: GPU nodes and 0 on CPU nodes.
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float | None = Field(None, ge=0)
    #: Custom Ray resources per replica, e.g. ``{"prefill_node": 1}`` with nodes started
    #: as ``ray start --resources='{"prefill_node": 8}'``: places the role on those nodes.
    resources: dict[str, float] = Field(default_factory=dict)
    engine: EngineArgs = EngineArgs()
    #: Must be the application's model when set (kept for configs that name it per role).
    model: str | None = None
    #: Ray runtime environment of this role's replicas (e.g. ``pip``); P's and D's must
    #: pin the same vLLM.
    runtime_env: dict[str, Any] | None = None
    #: When Serve stops a replica (a scale-down, a redeploy), its engine waits, after
    #: Serve's own wait for the calls running there, until nothing holds its KV (P: the
    #: exports D has not read yet and the parents held for continuations, until their
    #: leases end; D: what its requests hold), at most ``drain_s`` seconds (None: the
    #: application's ``lease_s`` + 15 for an autoscaled role, else 0). 0 stops the engine
    #: at once (what a killed replica does: a held parent is lost and its continuation
    #: recomputed).
    drain_s: int | None = Field(None, ge=0)


class RouterArgs(_Strict):
    #: Parents and running requests live in the replica that took them; Serve routes
    #: each call naming one to the replica owning its id (deploy.affinity). Drain needs
    #: one replica (rotation is per replica).
    num_replicas: PositiveInt = 1
    num_cpus: float = Field(0.5, ge=0)
    #: Custom Ray resources per replica (see ``RoleArgs.resources``).
    resources: dict[str, float] = Field(default_factory=dict)
    #: PATH_AUTO runs requests whose parent can be at most this long colocated on P.
    colocated_below_tokens: int = Field(0, ge=0)
    #: Largest beam width the router accepts; D's ``max_logprobs`` must cover 2x.
    max_beam_width: int = Field(64, ge=1, le=MAX_BEAM_WIDTH)
    #: Requests one router replica runs at once; beyond it, RESOURCE_EXHAUSTED at once
    #: (the standalone router's ``--max-inflight``).
    max_inflight: PositiveInt = 256
    #: Where stage 1 runs among P replicas: "cache", the replica whose prefix cache
    #: holds most of the prompt against its queue (deploy.request_router.PrefillRouter,
    #: following P's KV events); "load", Serve's own choice.
    placement: Literal["cache", "load"] = "cache"
    #: The CURVE key of P's KV events when they are not on loopback (the engines'
    #: ``kv_events_key_file``).
    kv_events_key_file: str | None = None


_VLLM_PIN = re.compile(r"^\s*(vllm(?:-cpu)?)\s*(==.*)?$", re.IGNORECASE)


def _vllm_pins(runtime_env: dict[str, Any] | None) -> set[str]:
    pip = (runtime_env or {}).get("pip") or []
    if isinstance(pip, dict):
        pip = pip.get("packages", [])
    out = set()
    for req in pip:
        m = _VLLM_PIN.match(str(req))
        if m:
            out.add((m.group(2) or "").replace(" ", ""))
    return out


class AppArgs(_Strict):
    """The whole application."""

    #: A Hugging Face model directory on every node, or "builtin" / "bench" (generated
    #: locally, identical on every node).
    model: str = "builtin"
    device: Literal["cuda", "cpu"] = "cuda"
    #: Seconds P holds an exported parent's blocks for D to read.
    lease_s: PositiveInt = 30
    #: Signed handoffs: a file with the shared secret (>= 16 bytes), at this path on
    #: every node. None: the replicas' ``KVHANDOFF_HANDOFF_SECRET(_FILE)`` if set.
    handoff_secret_file: str | None = None
    prefill: RoleArgs = RoleArgs()
    decode: RoleArgs = RoleArgs()
    router: RouterArgs = RouterArgs()

    @model_validator(mode="after")
    def _cross_checks(self) -> AppArgs:
        p, d = self.prefill, self.decode
        for name, role in (("prefill", p), ("decode", d)):
            if role.model is not None and role.model != self.model:
                raise ValueError(f"{name}.model {role.model!r} differs from model "
                                 f"{self.model!r}: P and D must run the same model")
            e = role.engine
            if self.device == "cpu":
                if role.num_gpus:
                    raise ValueError(f"{name}.num_gpus must be 0 on device cpu")
                if e.tensor_parallel_size != 1:
                    raise ValueError(f"{name}.engine.tensor_parallel_size must be 1 on cpu")
                if e.kv_buffer_device == "cuda":
                    raise ValueError(f"{name}.engine.kv_buffer_device cuda needs device cuda")
            else:
                gpus = self.gpus(role)
                if gpus != int(gpus) or gpus < e.tensor_parallel_size:
                    raise ValueError(
                        f"{name}.num_gpus must be a whole number >= tensor_parallel_size "
                        f"({e.tensor_parallel_size}): fractional GPUs would let P and D "
                        "replicas share a GPU")
        if p.engine.block_size != d.engine.block_size:
            raise ValueError(f"block sizes differ (prefill {p.engine.block_size}, decode "
                             f"{d.engine.block_size}): D reads P's blocks as they are")
        if d.engine.max_model_len < p.engine.max_model_len:
            raise ValueError("decode.engine.max_model_len must be >= prefill's: D continues "
                             "P's longest parent")
        for name, role in (("decode", d), ("prefill", p)):
            # The colocated path runs beam search on P.
            if 2 * self.router.max_beam_width > role.engine.max_logprobs:
                raise ValueError(
                    f"router.max_beam_width {self.router.max_beam_width} needs "
                    f"{name}.engine.max_logprobs >= {2 * self.router.max_beam_width} "
                    f"(is {role.engine.max_logprobs})")
        if self.router.max_beam_width > d.engine.max_num_seqs:
            raise ValueError(
                f"router.max_beam_width {self.router.max_beam_width} needs "
                f"decode.engine.max_num_seqs >= {self.router.max_beam_width} (is "
                f"{d.engine.max_num_seqs}): a search's beams run as one batch on D")
        if (self.router.placement == "cache" and p.engine.kv_events_key_file
                and not self.router.kv_events_key_file):
            raise ValueError("prefill.engine.kv_events_key_file is set: placement by cache "
                             "needs router.kv_events_key_file (the same key) to read P's "
                             "events, or router.placement: load")
        p_pins, d_pins = _vllm_pins(p.runtime_env), _vllm_pins(d.runtime_env)
        if p_pins != d_pins:
            raise ValueError(f"P and D must run the same vLLM: prefill pins {sorted(p_pins)}, "
                             f"decode pins {sorted(d_pins)}")
        return self

    def drain_s(self, role: RoleArgs) -> int:
        """Seconds a stopping engine replica of ``role`` waits for its KV to be let go.
        Unset, only an autoscaled role drains: a fixed one stops on a redeploy or a
        shutdown only, and ``serve.shutdown`` waits 30 s for every replica by default."""
        if role.drain_s is not None:
            return role.drain_s
        return self.lease_s + 15 if role.autoscaling is not None else 0

    def gpus(self, role: RoleArgs) -> float:
        if self.device == "cpu":
            return 0.0
        return role.engine.tensor_parallel_size if role.num_gpus is None else role.num_gpus

    def engine_kwargs(self, role: RoleArgs) -> dict[str, Any]:
        """``EngineConfig`` keyword arguments for one role (without role, model, ports)."""
        e = role.engine
        kw: dict[str, Any] = {
            "lease_s": self.lease_s,
            "handoff_secret_file": self.handoff_secret_file,
            "block_size": e.block_size,
            "kv_cache_memory_bytes": e.kv_cache_mib << 20,
            "max_model_len": e.max_model_len,
            "max_num_seqs": e.max_num_seqs,
            "max_logprobs": e.max_logprobs,
            "tensor_parallel_size": e.tensor_parallel_size,
            "enforce_eager": e.enforce_eager,
        }
        for name in ("kv_buffer_device", "dtype", "load_format"):
            if getattr(e, name) is not None:
                kw[name] = getattr(e, name)
        if self.model == "bench" and e.load_format is None:
            kw["load_format"] = "dummy"
        kw["cpu_threads"] = e.cpu_threads if self.device == "cpu" else None
        # Replicas may land on different nodes: UCX gets every interface unless told.
        kw["ucx_net_devices"] = e.ucx_net_devices
        if e.fault_injection:
            kw["fault_injection"] = True
        if e.adapters:
            kw["adapters"] = tuple(e.adapters.items())
        if e.catalogs:
            kw["catalogs"] = tuple(e.catalogs.items())  # "builtin" resolved per replica
        kw["kv_events"] = e.kv_events
        kw["kv_events_host"] = e.kv_events_host
        kw["kv_events_key_file"] = e.kv_events_key_file
        return kw
