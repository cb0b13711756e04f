"""``kvhandoff bench --serve-scale``: the Ray Serve application autoscaled by its own
policy (``deploy.autoscale``) under a load that ramps up and down.

A local Ray instance (logical CPUs above the machine's: the engines share its cores),
the application deployed from a Serve config that names the policy (Serve's application
policy is set there, not in ``serve.run``), Prefill and Decode each 1 to 2 replicas with
short delays. Sessions arrive through Serve's gRPC proxy at the rate ``PHASES`` sets
(Poisson arrivals, each session in its own thread): ``StartParent`` (a fresh prompt, ``STAGE1_TOKENS``
sampled on P), then ``CONTINUATIONS`` continuations ``THINK_S`` apart (each a beam search
on D reading the parent P holds). Sessions begun before the load falls go on after it,
so parents are still held, and continued, while Serve removes P replicas.

Recorded each second: the running (and starting, stopping) replicas of Prefill and
Decode. Per call: served, lost (any error), recomputed (``stats.recomputed``: the
parent was gone and D computed it again), imported tokens. ``drain=False`` is the
control: engines stop at once (``drain_s: 0``), dropping what they hold.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from kvhandoff.ports import free_port
from kvhandoff.v1 import router_pb2, router_pb2_grpc
from tools.serve_local import ray_init

APP = "kvhandoff"
METADATA = (("application", APP),)
#: (seconds, sessions begun per second): low, high, low, idle.
PHASES = ((40, 0.2), (100, 1.0), (90, 0.2), (60, 0.0))
THINK_S = 6.0
CONTINUATIONS = 3
PROMPT_TOKENS = 256
STAGE1_TOKENS = 128
#: Sessions in flight at most (threads); more wait for one to end.
MAX_SESSIONS = 64

#: Autoscaling of each role: Serve's fields (``deploy.args.Autoscaling``), short enough
#: for a run of minutes.
SCALING = {"min_replicas": 1, "max_replicas": 2, "metrics_interval_s": 0.5,
           "look_back_period_s": 10.0, "upscale_delay_s": 3.0, "downscale_delay_s": 5.0}
#: The policy's knobs (``deploy.args.PDScaling``), for this load on 2 shared cores: a
#: stage 1 takes about 0.65 s alone here, so P's engines run about 0.13 on average at
#: the low rate and 0.65 or more at the high one; D's continuations about 0.1 s each,
#: 3 a second at the high rate. D's 64 MiB pool stays mostly free, so D scales by its
#: requests. The P threshold sits about 2x from both rates.
POLICY = {"prefill_queue_per_replica": 0.3, "decode_free_fraction": 0.5,
          "decode_requests_per_replica": 0.4, "max_engine_replicas": 4}


def app_args(drain: bool, lease_s: int = 30) -> dict[str, Any]:
    engine = {"kv_cache_mib": 64, "max_model_len": 2048, "side_channel_host": "127.0.0.1"}
    role = {"num_cpus": 1, "autoscaling": SCALING, "engine": engine,
            **({} if drain else {"drain_s": 0})}
    # P's pool holds a lease's worth of parents within the router's share for them
    # (a quarter of P's blocks); at 64 MiB the share was spent within seconds.
    prefill = {**role, "engine": {**engine, "kv_cache_mib": 512}}
    return {"model": "builtin", "device": "cpu", "lease_s": lease_s, "prefill": prefill,
            "decode": role, "router": {"num_cpus": 0.5}}


def _deploy(grpc_port: int, drain: bool, lease_s: int) -> None:
    """What ``serve run CONFIG`` does: Serve started, then the config applied (the
    application policy is a config field only)."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from deploy.app import GRPC_SERVICER_FUNCTIONS

    options = {"proxy_location": "HeadOnly",
               "http_options": {"host": "127.0.0.1", "port": free_port()},
               "grpc_options": {"port": grpc_port,
                                "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS}}
    serve.start(**options)
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({**options,
        "applications": [{
            "name": APP, "route_prefix": "/kvhandoff", "import_path": "deploy.app:build_app",
            "args": app_args(drain, lease_s),
            "autoscaling_policy": {"policy_function": "deploy.autoscale:PDScalePolicy",
                                   "policy_kwargs": POLICY}}]}))


def _replicas(serve) -> dict[str, dict[str, int]]:
    app = serve.status().applications.get(APP)
    out = {}
    for name in ("Prefill", "Decode"):
        dep = app.deployments.get(name) if app else None
        states = {str(getattr(k, "value", k)): v for k, v in (dep.replica_states if dep
                                                               else {}).items()}
        out[name] = states
    return out


def _wait_ready(serve, stub, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = _replicas(serve)
        if all(states[n].get("RUNNING", 0) >= 1 for n in states):
            calls: list[dict] = []
            _session(stub, random.Random(0), calls, 0.0, continuations=1, think_s=0.0)
            if all(c["ok"] for c in calls) and len(calls) == 2:
                return
        time.sleep(2)
    raise TimeoutError(f"the application did not come up: {_replicas(serve)}")


def _session(stub, rng: random.Random, calls: list[dict], t0: float, *,
             continuations: int = CONTINUATIONS, think_s: float = THINK_S) -> None:
    """One parent and its continuations; each call's outcome appended to ``calls``."""
    req = router_pb2.ParentRequest()
    # Fresh token ids (the built-in model's vocabulary has 1024): no prefix-cache hits.
    req.prompt_token_ids.ids.extend(rng.randrange(10, 1000) for _ in range(PROMPT_TOKENS))
    req.stage1.max_tokens = req.stage1.min_tokens = STAGE1_TOKENS
    req.stage1.temperature = 1.0
    req.stage1.seed = rng.randrange(1 << 30)
    start = time.monotonic()
    parent = None
    try:
        for event in stub.StartParent(req, metadata=METADATA, timeout=120):
            if event.HasField("parent"):
                parent = event.parent
        calls.append({"call": "StartParent", "t": start - t0, "ok": True,
                      "s": time.monotonic() - start, "held": bool(parent and parent.held)})
    except grpc.RpcError as e:
        calls.append({"call": "StartParent", "t": start - t0, "ok": False,
                      "error": f"{e.code().name}: {e.details()}"})
        return
    for _ in range(continuations):
        time.sleep(think_s)
        cont = router_pb2.ContinueRequest(parent_id=parent.parent_id)
        cont.beam.beam_width, cont.beam.max_tokens = 4, 4
        start = time.monotonic()
        try:
            resp = stub.Continue(cont, metadata=METADATA, timeout=120)
            calls.append({"call": "Continue", "t": start - t0, "ok": True,
                          "s": time.monotonic() - start, "recomputed": resp.stats.recomputed,
                          "failure": resp.stats.handoff_failure,
                          "imported": resp.stats.num_imported_tokens,
                          "found_on_d": resp.stats.num_found_on_d_tokens})
        except grpc.RpcError as e:
            calls.append({"call": "Continue", "t": start - t0, "ok": False,
                          "error": f"{e.code().name}: {e.details()}"})


def _sampler(serve, stop: threading.Event, timeline: list[dict], rate: list[float],
             t0: float) -> None:
    while not stop.is_set():
        try:
            states = _replicas(serve)
        except Exception as e:  # noqa: BLE001 - a status call during a change: skip it
            timeline.append({"t": time.monotonic() - t0, "error": repr(e)})
        else:
            timeline.append({"t": time.monotonic() - t0, "rate": rate[0],
                             **{f"{n}_{s}": v for n, st in states.items()
                                for s, v in st.items()}})
        stop.wait(1.0)


def run_serve_scale(*, drain: bool = True, phases=PHASES, lease_s: int = 30
                    ) -> dict[str, Any]:
    """Deploy, ramp the load through ``phases``, record, tear down; the result."""
    import ray
    from ray import serve

    ray_init(ray)
    grpc_port = free_port()
    try:
        _deploy(grpc_port, drain, lease_s)
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = router_pb2_grpc.RouterStub(channel)
        _wait_ready(serve, stub)
        calls: list[dict] = []
        timeline: list[dict] = []
        rate, stop, rng = [0.0], threading.Event(), random.Random(1)
        t0 = time.monotonic()
        with ThreadPoolExecutor(MAX_SESSIONS) as sessions, ThreadPoolExecutor(1) as sampler:
            sampler.submit(_sampler, serve, stop, timeline, rate, t0)
            begun = []
            try:
                for seconds, per_s in phases:
                    rate[0], end = per_s, time.monotonic() + seconds
                    while time.monotonic() < end:
                        if per_s:
                            begun.append(sessions.submit(_session, stub, random.Random(
                                rng.randrange(1 << 30)), calls, t0))
                        # Poisson arrivals: evenly spaced ones, in step with the
                        # replicas' once-a-second samples, read the same phase each time.
                        time.sleep(min(rng.expovariate(per_s) if per_s else 1.0,
                                       max(0.0, end - time.monotonic())))
                for b in begun:
                    b.result()
            finally:
                stop.set()  # the sampler ends, also on an interrupt
        channel.close()
    finally:
        serve.shutdown()
        ray.shutdown()
    return summarize(calls, timeline, drain, phases)


def summarize(calls: list[dict], timeline: list[dict], drain: bool,
              phases=PHASES) -> dict[str, Any]:
    conts = [c for c in calls if c["call"] == "Continue"]
    peak = {n: max((s.get(f"{n}_RUNNING", 0) for s in timeline), default=0)
            for n in ("Prefill", "Decode")}
    return {
        "drain": drain, "phases": [list(p) for p in phases], "think_s": THINK_S,
        "continuations_per_parent": CONTINUATIONS, "scaling": SCALING, "policy": POLICY,
        "num_calls": len(calls), "num_served": sum(c["ok"] for c in calls),
        "num_lost": sum(not c["ok"] for c in calls),
        "num_continuations": len(conts),
        "num_recomputed": sum(bool(c.get("recomputed")) for c in conts),
        "failures": dict(Counter((c.get("failure") or c.get("error"))[:120] for c in calls
                                 if c.get("failure") or c.get("error")).most_common(8)),
        "peak_replicas": peak,
        "final_replicas": {n: timeline[-1].get(f"{n}_RUNNING", 0) if timeline else 0
                           for n in ("Prefill", "Decode")},
        "timeline": timeline, "calls": calls,
    }


def format_serve_scale(r: dict[str, Any]) -> str:
    return (f"serve-scale (drain {'on' if r['drain'] else 'off'}): {r['num_calls']} calls, "
            f"{r['num_served']} served, {r['num_lost']} lost, {r['num_recomputed']} of "
            f"{r['num_continuations']} continuations recomputed; replicas at peak "
            f"P {r['peak_replicas']['Prefill']} D {r['peak_replicas']['Decode']}, at the "
            f"end P {r['final_replicas']['Prefill']} D {r['final_replicas']['Decode']}"
            + (f"; failures: {r['failures']}" if r["failures"] else ""))


def plot_serve_scale(r: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = [s for s in r["timeline"] if "rate" in s]
    t = [s["t"] for s in tl]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                 gridspec_kw={"height_ratios": [2, 1]})
    ax.step(t, [s["rate"] for s in tl], where="post", color="grey",
            label="sessions begun / s")
    ax.step(t, [s.get("Prefill_RUNNING", 0) for s in tl], where="post", label="P running")
    ax.step(t, [s.get("Decode_RUNNING", 0) + 0.05 for s in tl], where="post",
            label="D running")
    for role, color in (("Prefill", "C0"), ("Decode", "C1")):
        ax.step(t, [s.get(f"{role}_STARTING", 0) for s in tl], where="post", ls="--",
                color=color, lw=0.8, label=f"{role[0]} starting")
        ax.step(t, [s.get(f"{role}_STOPPING", 0) for s in tl], where="post", ls=":",
                color=color, label=f"{role[0]} stopping (draining)")
    ax.set_ylabel("count")
    ax.legend(loc="upper right", fontsize=7)
    ax.set_title(f"P:D autoscaling ({'drain on' if r['drain'] else 'control: drain off'}): "
                 f"{r['num_served']} served, {r['num_lost']} lost, "
                 f"{r['num_recomputed']} recomputed")
    for kind, marker in (("StartParent", "o"), ("Continue", "x")):
        pts = [c for c in r["calls"] if c["call"] == kind and c["ok"]
               and not c.get("recomputed")]
        bx.plot([c["t"] for c in pts], [kind] * len(pts), marker, ms=3, ls="",
                label=f"{kind} served")
    bad = [c for c in r["calls"] if not c["ok"] or c.get("recomputed")]
    bx.plot([c["t"] for c in bad], [c["call"] for c in bad], "r*", ms=9, ls="",
            label="lost or recomputed")
    bx.set_xlabel("seconds")
    bx.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
