"""``kvhandoff bench --hosts-link``: what the link between two hosts (tools.netns) carries.

On two hosts ``p`` and ``d`` of this machine, per size: a plain TCP copy from P's host to
D's (the link's limit), a raw NIXL READ from P's host to D's over TCP (``UCX_TLS=tcp``, how
the hosts mode runs engines), the same READ when UCX chooses (``cma``: the hosts share a
kernel) and a READ between two processes on loopback in this namespace (``cma``, the
single-host path). Each figure is the best of ``repeats`` after one untimed warm-up; the
transport of every READ is read from UCX's own tables. Order: sizes ascending, and for
each size the four in the order above.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

DEFAULT_SIZES = (16 << 20, 64 << 20, 256 << 20)


def measure_link(sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 3) -> dict[str, Any]:
    from tools.netns import hosts, tcp_copy
    from tools.nixl_probe import _read_gbps, measure_across_hosts

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
                         "nixl_loopback_cma_gbps": round(_read_gbps(size, repeats), 3)})
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
