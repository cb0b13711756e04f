"""``kvhandoff bench --hosts-link``: what the link between two hosts (tools.netns) carries,
and what a first handoff costs across it.

On two hosts ``p`` and ``d`` of this machine, per size: a plain TCP copy from P's host to
D's (the link's limit), a raw NIXL READ from P's host to D's over TCP (``UCX_TLS=tcp``, how
the hosts mode runs engines), the same READ when UCX chooses (``cma``: the hosts share a
kernel) and a READ between two processes on loopback in this namespace (``cma``, the
single-host path). Each figure is the best of ``repeats`` after one untimed warm-up; the
transport of every READ is read from UCX's own tables. Order: sizes ascending, and for
each size the four in the order above.

First handoff (``measure_first_handoff``): P, D and a router without warm-up, on loopback
and then on three hosts; ``requests`` handoffs one after another, each with a fresh prompt
(nothing of it in D's prefix cache); the first includes D's NIXL handshake with P (adding
P as a remote agent), the rest do not. Reported per request: stage 2 until its first beam
step (the READ included) and the bytes read.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

DEFAULT_SIZES = (16 << 20, 64 << 20, 256 << 20)


def measure_link(sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 3) -> dict[str, Any]:
    from tools.bench.nixl_probe import measure_across_hosts, read_gbps
    from tools.netns import hosts, tcp_copy

    rows = []
    with hosts(("p", "d")) as h, tempfile.TemporaryDirectory() as logs:
        p, d = h["p"], h["d"]
        for size in sizes:
            tcp = max(size / tcp_copy(p, d, size)[2] for _ in range(repeats)) / 1e9
            over_tcp = measure_across_hosts(p, d, size, Path(logs), "tcp", repeats)
            chosen = measure_across_hosts(p, d, size, Path(logs), None, repeats)
            rows.append({"bytes": size, "tcp_copy_gbps": round(tcp, 3),
                         "nixl_tcp_gbps": over_tcp["gbps"],
                         "nixl_tcp_transports": over_tcp["read_transports"],
                         "nixl_chosen_gbps": chosen["gbps"],
                         "nixl_chosen_transports": chosen["read_transports"],
                         "nixl_loopback_cma_gbps": round(read_gbps(size, repeats), 3)})
    return {"repeats": repeats, "sizes": rows}


def format_link(result: dict[str, Any]) -> str:
    lines = [f"{'MiB':>6}{'TCP copy':>10}{'NIXL tcp':>10}{'x copy':>8}{'NIXL chosen':>13}"
             f"{'loopback cma':>14}   (GB/s, best of {result['repeats']})"]
    for r in result["sizes"]:
        lines.append(
            f"{r['bytes'] >> 20:>6}{r['tcp_copy_gbps']:>10.2f}{r['nixl_tcp_gbps']:>10.2f}"
            f"{r['nixl_tcp_gbps'] / r['tcp_copy_gbps']:>8.2f}{r['nixl_chosen_gbps']:>13.2f}"
            f"{r['nixl_loopback_cma_gbps']:>14.2f}   "
            f"({'/'.join(r['nixl_tcp_transports'])} vs {'/'.join(r['nixl_chosen_transports'])})")
    return "\n".join(lines)


def _handoffs(router: str, n: int, prompt_tokens: int, stage1_tokens: int) -> list[dict]:
    """``n`` handoffs in turn through ``router``, each with its own prompt (runs where the
    router is reachable: on its host across hosts)."""
    from tools.client import RouterClient, make_request

    rows = []
    with RouterClient(router) as client:
        for i in range(n):
            prompt = [10 + (7 * i + j) % 200 for j in range(prompt_tokens)]
            req = make_request(prompt=prompt, max_tokens=stage1_tokens, seed=i, beam_width=4,
                               path="handoff", request_id=f"first-{i}")
            req.stage1.min_tokens = stage1_tokens
            got = client.generate(req, timeout=300)
            rows.append({"stage2_first_step_ms": round(got.timings.stage2_first_step_ms, 1),
                         "bytes": got.stats.num_bytes_moved,
                         "recomputed": got.stats.recomputed})
    return rows


def measure_first_handoff(model: str | None, log_dir: Path, requests: int = 4,
                          prompt_tokens: int = 560, stage1_tokens: int = 40) -> dict[str, Any]:
    import contextlib

    from tools.launch import local_cluster
    from tools.netns import call, hosts

    out: dict[str, Any] = {"requests": requests,
                           "parent_tokens": prompt_tokens + stage1_tokens}
    for mode in ("loopback", "hosts"):
        with contextlib.ExitStack() as stack:
            on_hosts = stack.enter_context(hosts(("p", "d", "r"))) if mode == "hosts" else None
            cluster = stack.enter_context(local_cluster(
                model, log_dir / mode, router_flags=("--no-warm-up",), on_hosts=on_hosts))
            args = (cluster["router"], requests, prompt_tokens, stage1_tokens)
            out[mode] = (call(on_hosts["r"], _handoffs, *args) if on_hosts
                         else _handoffs(*args))
    return out


def format_first_handoff(result: dict[str, Any]) -> str:
    lines = [f"first handoffs, parent {result['parent_tokens']} tokens, no warm-up "
             "(stage 2 until its first beam step, ms; request 1 includes the handshake):"]
    for mode in ("loopback", "hosts"):
        rows = result[mode]
        lines.append(f"  {mode:<9}" + "".join(
            f"{r['stage2_first_step_ms']:>9.1f}{'(R)' if r['recomputed'] else ''}"
            for r in rows) + f"   ({rows[0]['bytes'] >> 10} KiB each)")
    return "\n".join(lines)
