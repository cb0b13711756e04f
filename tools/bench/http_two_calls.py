"""``kvhandoff bench --http-two-calls``: the two-call client over the router's
OpenAI-compatible HTTP front, as the clients this project serves run it: stage 1 as a
completion, then stage 2 either

- ``text``: a brand-new beam-search request whose prompt is the text prompt + thinking +
  suffix (re-tokenised and prefilled from scratch on D, nothing imported), or
- ``continuation``: ``continuation_of`` the stage-1 id (D imports the parent's blocks
  from P and computes the suffix),

at a few concurrency levels. P, D and the router run as processes (``local_cluster``);
each request runs both modes back to back, in alternating order, on a fresh prompt (so
neither finds the other's blocks in D's prefix cache except what the parent shares).
Reported per mode and level: stage 2's time to its first beam step (the router's
``stage2_first_step_ms``), stage 2's end-to-end time as the client sees it, both calls
end to end, and tokens imported / computed on D.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvhandoff.ports import free_port
from tools.launch import local_cluster

SUFFIX = "</think>\n<|sid_begin|>"


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _one(base: str, i: int, mode: str, prompt: list[int], prompt_text: str,
         stage1_tokens: int, beam_width: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    s1 = _post(f"{base}/v1/completions", {
        "prompt": prompt, "max_tokens": stage1_tokens, "min_tokens": stage1_tokens,
        "seed": i, "temperature": 1.0})
    t1 = time.perf_counter()
    beam = {"max_tokens": 3, "n": beam_width, "use_beam_search": True}
    if mode == "text":
        s2 = _post(f"{base}/v1/completions", {
            **beam, "prompt": prompt_text + s1["choices"][0]["text"] + SUFFIX})
    else:
        s2 = _post(f"{base}/v1/completions", {
            **beam, "prompt": "", "continuation_of": s1["id"], "continuation_suffix": SUFFIX})
    t2 = time.perf_counter()
    details = s2["usage"]["prompt_tokens_details"]
    return {"mode": mode, "stage2_first_step_ms": s2["kvhandoff"]["stage2_first_step_ms"],
            "stage2_client_ms": (t2 - t1) * 1e3, "two_calls_ms": (t2 - t0) * 1e3,
            "imported_tokens": details["imported_tokens"],
            "computed_tokens": details["computed_tokens"],
            "prompt_tokens": s2["usage"]["prompt_tokens"],
            "recomputed": s2["kvhandoff"]["recomputed"],
            "handoff_failure": s2["kvhandoff"]["handoff_failure"]}


def measure_two_calls_over_http(model: str | None, **kw: Any) -> dict[str, Any]:
    """``run_two_calls`` on P, D and a router with the HTTP front started here."""
    from kvhandoff.model import resolve_model

    port = free_port()
    with local_cluster(model, Path("out") / "bench-http-logs",
                       router_flags=("--http-port", str(port))):
        return run_two_calls(f"http://127.0.0.1:{port}", str(resolve_model(model)), **kw)


def run_two_calls(base: str, model_dir: str, requests: int = 8,
                  concurrency: tuple[int, ...] = (1, 4), prompt_tokens: int = 512,
                  stage1_tokens: int = 64, beam_width: int = 8, seed: int = 0
                  ) -> dict[str, Any]:
    """Both modes against the HTTP front at ``base`` (see the module docstring)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows: list[dict[str, Any]] = []
    for level in concurrency:
        rng = random.Random(f"{seed}/{level}")
        jobs = []
        for i in range(requests):
            for m in ("text", "continuation") if i % 2 == 0 else ("continuation", "text"):
                prompt = [rng.randrange(10, 1000) for _ in range(prompt_tokens)]
                text = tokenizer.decode(prompt, skip_special_tokens=False)
                jobs.append((i, m, prompt, text))
        with ThreadPoolExecutor(level) as pool:
            done = list(pool.map(lambda j: _one(base, j[0], j[1], j[2], j[3],
                                                stage1_tokens, beam_width), jobs))
        rows.extend({**row, "concurrency": level} for row in done)
    summary: dict[str, Any] = {}
    for level in concurrency:
        for mode in ("text", "continuation"):
            sel = [r for r in rows if r["concurrency"] == level and r["mode"] == mode]
            summary[f"{mode}@{level}"] = {
                k: round(statistics.median(r[k] for r in sel), 1)
                for k in ("stage2_first_step_ms", "stage2_client_ms", "two_calls_ms",
                          "imported_tokens", "computed_tokens", "prompt_tokens")}
            summary[f"{mode}@{level}"]["recomputed"] = sum(r["recomputed"] for r in sel)
            summary[f"{mode}@{level}"]["requests"] = len(sel)
    return {"config": {"requests": requests, "concurrency": list(concurrency),
                       "prompt_tokens": prompt_tokens, "stage1_tokens": stage1_tokens,
                       "beam_width": beam_width, "model": model_dir},
            "summary": summary, "rows": rows}


def format_two_calls(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [f"two calls over HTTP: {c['prompt_tokens']}-token prompts, {c['stage1_tokens']} "
             f"stage-1 tokens, beam width {c['beam_width']} x 3 tokens, {c['requests']} "
             "requests per mode and level (medians)",
             f"{'mode':<14}{'conc':>5}{'s2 first step ms':>18}{'s2 client ms':>14}"
             f"{'both calls ms':>15}{'imported':>10}{'computed':>10}"]
    for key, s in result["summary"].items():
        mode, level = key.split("@")
        lines.append(f"{mode:<14}{level:>5}{s['stage2_first_step_ms']:>18.1f}"
                     f"{s['stage2_client_ms']:>14.1f}{s['two_calls_ms']:>15.1f}"
                     f"{s['imported_tokens']:>10.0f}{s['computed_tokens']:>10.0f}")
    return "\n".join(lines)
