"""``kvhandoff demo``: P, D and the router as separate processes on loopback, a batch of
two-stage requests through the router over gRPC, each checked against the colocated
reference; then the same requests with their beams kept in the built-in shop
(``--catalog shop=builtin``: every beam an item, identical to colocated, and how many
beams the open search returned outside it); then everything shut down. Exit code 0
only if every request verified.

``--hosts netns``: P, D and the router each on its own network host (tools.netns), the
client on the router's host, the KV read over the link by TCP; the demo also reports the
transport UCX chose and fails unless it is a network one."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from kvhandoff.builtin.corpus import Example, make_example, semantic_id, shop_items
from kvhandoff.model import resolve_model
from kvhandoff.v1 import common_pb2
from tools.client import RouterClient, make_request
from tools.harness import LOGPROB_TOLERANCE
from tools.launch import local_cluster
from tools.netns import call, hosts

#: Seed of the demo's histories: not the training corpus's, so the model has not seen them.
DEMO_SEED = 7


def demo_examples(n: int) -> list[Example]:
    """``n`` users' histories (40-160 items) in the corpus's form, unseen in training."""
    rng = random.Random(DEMO_SEED)
    return [make_example(rng, min_items=40, max_items=160) for _ in range(n)]


def _sid_tokens(tokenizer, token_ids) -> list[str]:
    return tokenizer.convert_ids_to_tokens(list(token_ids)) if tokenizer else []


def _send_all(router: str, prompts: list[str], beam_width: int) -> list:
    """Each prompt by handoff, then on the colocated path (4 at a time); a failed pair
    is its status as text."""
    from tqdm import tqdm

    with RouterClient(router) as client:
        def both(i: int):
            kw = dict(prompt=prompts[i], max_tokens=96, seed=i, beam_width=beam_width)
            try:
                got = client.generate(make_request(path="handoff", request_id=f"demo-{i}", **kw))
                ref = client.generate(make_request(path="colocated", request_id=f"ref-{i}", **kw))
            except grpc.RpcError as e:
                return f"{e.code().name}: {e.details()}"
            return got, ref

        with ThreadPoolExecutor(4) as pool:
            return list(tqdm(pool.map(both, range(len(prompts))), total=len(prompts),
                             desc="two-stage requests", unit="req"))


def _send_in_catalog(router: str, prompts: list[str], beam_width: int) -> list:
    """Each prompt again with its beams kept in the built-in shop, by handoff and on the
    colocated path (same seeds: the same thinking); a failed pair is its status."""
    with RouterClient(router) as client:
        def both(i: int):
            kw = dict(prompt=prompts[i], max_tokens=96, seed=i, beam_width=beam_width,
                      catalog="shop")
            try:
                got = client.generate(make_request(path="handoff", request_id=f"shop-{i}",
                                                   **kw))
                ref = client.generate(make_request(path="colocated",
                                                   request_id=f"shop-ref-{i}", **kw))
            except grpc.RpcError as e:
                return f"{e.code().name}: {e.details()}"
            return got, ref

        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(both, range(len(prompts))))


def _catalog_summary(results: list, in_catalog: list, shop: set[tuple[int, ...]]) -> dict:
    """How many beams the open search returned outside the shop, and whether every
    constrained beam is an item and equals the colocated reference; printed."""
    free = [list(b.token_ids) for r in results if not isinstance(r, str) for b in r[0].beams]
    free_top = [list(r[0].beams[0].token_ids) for r in results
                if not isinstance(r, str) and r[0].beams]
    done = [r for r in in_catalog if not isinstance(r, str)]
    kept = [list(b.token_ids) for got, _ in done for b in got.beams]
    identical = sum(_same_beams(got, ref) for got, ref in done)
    summary = {
        "catalog": "shop", "num_items": len(shop),
        "open_beams": len(free), "open_beams_outside": sum(tuple(b) not in shop for b in free),
        "open_top_outside": sum(tuple(b) not in shop for b in free_top),
        "requests": len(in_catalog), "failed": [r for r in in_catalog if isinstance(r, str)],
        "beams": len(kept), "beams_outside": sum(tuple(b) not in shop for b in kept),
        "identical_to_colocated": identical,
        "beams_short": sum(got.num_beams_short for got, _ in done)}
    print(f"\ncatalog 'shop' ({len(shop)} items): the open search returned "
          f"{summary['open_beams_outside']} of {len(free)} beams outside it (top beam outside "
          f"in {summary['open_top_outside']}/{len(free_top)}); kept in it, "
          f"{len(kept) - summary['beams_outside']}/{len(kept)} beams are items, "
          f"{identical}/{len(in_catalog)} requests identical to the colocated reference"
          + (f", {len(summary['failed'])} failed: {summary['failed'][0]}"
             if summary["failed"] else ""))
    summary["ok"] = (not summary["failed"] and summary["beams_outside"] == 0
                     and identical == len(in_catalog) and len(kept) > 0)
    return summary


def _same_beams(got, ref) -> bool:
    """``got`` equals ``ref``, a run that really was colocated: stage 1, beams and their
    cumulative logprobs within the harness's bound."""
    return (ref.stats.path == common_pb2.PATH_COLOCATED and not ref.stats.decode_endpoint
            and list(got.thinking_token_ids) == list(ref.thinking_token_ids)
            and [list(b.token_ids) for b in got.beams] == [list(b.token_ids) for b in ref.beams]
            and all(abs(a.cum_logprob - b.cum_logprob) <= LOGPROB_TOLERANCE
                    for a, b in zip(got.beams, ref.beams)))


def _post(url: str, body: dict) -> dict:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"error": json.loads(e.read()).get("error", {"message": str(e)})}


def _two_calls(base: str, prompt: str, beam_width: int, first) -> dict:
    """The two-call flow through the HTTP front, as an OpenAI-style client does it: stage
    1 as a completion, then stage 2 as a continuation naming it, checked against the
    first request's colocated reference (same prompt and seed): stage 1's tokens, the
    beams' token ids and their cumulative logprobs within ``LOGPROB_TOLERANCE``."""
    s1 = _post(f"{base}/v1/completions", {"prompt": prompt, "max_tokens": 96, "seed": 0,
                                          "temperature": 1.0})
    if "error" in s1:
        print(f"\ntwo calls over HTTP: stage 1 FAILED: {s1['error']['message']}")
        return {"verified": False, "error": s1["error"]["message"]}
    s2 = _post(f"{base}/v1/completions", {
        "prompt": "", "max_tokens": 3, "n": beam_width, "use_beam_search": True,
        "continuation_of": s1["id"], "continuation_suffix": "</think>\n<|sid_begin|>"})
    if "error" in s2:
        print(f"\ntwo calls over HTTP: the continuation FAILED: {s2['error']['message']}")
        return {"verified": False, "error": s2["error"]["message"]}
    thinking = s1["choices"][0]["token_ids"]
    beams = [c["token_ids"] for c in s2["choices"]]
    cums = [c["cumulative_logprob"] for c in s2["choices"]]
    details = s2["usage"]["prompt_tokens_details"]
    info = s2["kvhandoff"]
    same = (not isinstance(first, str) and first[1].stats.path == common_pb2.PATH_COLOCATED
            and thinking == list(first[1].thinking_token_ids)
            and beams == [list(b.token_ids) for b in first[1].beams]
            and all(abs(c - b.cum_logprob) <= LOGPROB_TOLERANCE
                    for c, b in zip(cums, first[1].beams)))
    verified = same and not info["recomputed"] and details["imported_tokens"] > 0
    print(f"\ntwo calls over HTTP (OpenAI-style): parent {s1['id']} ({len(thinking)} "
          f"thinking tokens, held by P: {s1['kvhandoff']['held']}), then a continuation "
          f"with continuation_of={s1['id']}: {len(beams)} beams; D imported "
          f"{details['imported_tokens']} parent tokens and computed "
          f"{details['computed_tokens']}; identical to the colocated reference: "
          f"{'yes' if same else 'NO'}")
    return {"verified": verified, "parent_id": s1["id"], "num_thinking_tokens": len(thinking),
            "num_imported_tokens": details["imported_tokens"],
            "num_computed_tokens_d": details["computed_tokens"],
            "recomputed": info["recomputed"], "identical": same}


def _row(i: int, got, ref, example: Example, tokenizer, think_end: int) -> dict:
    """One request's line of the table (printed) and of the JSON report."""
    # A handoff the router had to recompute (flagged) must be identical too, but only
    # the others demonstrate the handoff.
    same = _same_beams(got, ref)
    s = got.stats
    top = _sid_tokens(tokenizer, got.beams[0].token_ids) if got.beams else []
    rule = semantic_id(example.history)
    logp = got.beams[0].cum_logprob if got.beams else float("nan")
    print(f"demo-{i:<3}{len(got.thinking_token_ids):>7}{s.num_parent_tokens:>7}"
          f"{s.num_imported_tokens:>9}{s.num_computed_tokens_first_step:>7}"
          f"{s.num_bytes_moved / 1024:>6.0f}{got.timings.stage2_first_step_ms:>14.1f}  "
          f"{''.join(top):<16}{''.join(rule):<16}{logp:>8.3f}  {'yes' if same else 'NO'}"
          f"{' (recomputed: ' + s.handoff_failure + ')' if s.recomputed else ''}")
    return {"request_id": got.request_id, "verified": same,
            "top_beam": top, "rule": rule, "matches_rule": top == rule,
            "stage1_ended_by_think": bool(got.thinking_token_ids)
            and got.thinking_token_ids[-1] == think_end,
            "recomputed": s.recomputed, "handoff_failure": s.handoff_failure,
            "num_parent_tokens": s.num_parent_tokens,
            "num_imported_tokens": s.num_imported_tokens,
            "num_computed_tokens_d": s.num_computed_tokens_first_step,
            "num_bytes_moved": s.num_bytes_moved,
            "stage2_first_step_ms": got.timings.stage2_first_step_ms,
            "colocated_stage2_first_step_ms": ref.timings.stage2_first_step_ms}


def _print_summary(rows: list[dict], handed: list[dict]) -> None:
    done = [r for r in rows if "error" not in r]
    imp = sum(r["num_imported_tokens"] for r in handed)
    comp = sum(r["num_computed_tokens_d"] for r in handed)
    print(f"\n{sum(r['verified'] for r in rows)}/{len(rows)} requests identical to the "
          f"colocated reference; {len(handed)} by handoff, {len(done) - len(handed)} "
          f"recomputed after a failed handoff; D imported {imp} tokens and computed {comp} "
          "for the import steps.")
    if not done:
        return
    first = sorted(r["stage2_first_step_ms"] for r in done)
    ref_first = sorted(r["colocated_stage2_first_step_ms"] for r in done)
    distinct = len({tuple(r["top_beam"]) for r in done})
    print(f"the model reads its context: {distinct} distinct top beams for {len(done)} "
          f"histories; {sum(r['matches_rule'] for r in done)}/{len(done)} top beams "
          f"equal the corpus rule's semantic id; stage 1 ended by </think> in "
          f"{sum(r['stage1_ended_by_think'] for r in done)}/{len(done)}.")
    print(f"stage-2 first beam step p50: handoff {first[len(first) // 2]:.1f} ms, "
          f"colocated {ref_first[len(ref_first) // 2]:.1f} ms (P, D, the router and this "
          f"client share this machine's cores)")


def _transport_line(log_dir: Path) -> dict:
    """What UCX chose for D's READs from P (its protocol tables), printed and returned."""
    from tools.ucx_report import all_network, read_transports_in

    chosen = sorted(read_transports_in(sorted(log_dir.glob("decode.*.ucx.log"))))
    network = all_network(chosen)
    print(f"\nD read the KV from P by: {', '.join(chosen) or 'nothing (no READ seen)'} "
          f"({'a network transport' if network else 'NOT a network transport'}; UCX's "
          "protocol tables in out/demo-logs/decode.*.ucx.log)")
    return {"read_transports": chosen, "network": network}


def main_demo(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer


    if args.hosts == "netns":
        from tools.netns import can_create

        why = can_create()
        if why:
            print(f"kvhandoff demo --hosts netns: cannot make the hosts here: {why}")
            return 2
    examples = demo_examples(args.requests)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(args.model)))
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    # The built-in shop needs the built-in tokenizer's semantic-id tokens.
    shop = {tuple(tokenizer.convert_tokens_to_ids(item)) for item in shop_items()}
    if any(tokenizer.unk_token_id in item or None in item for item in shop):
        shop = set()
        print("(this model's tokenizer lacks the built-in semantic ids: no catalog part)")
    from kvhandoff.ports import free_port

    http_port = free_port()
    log_dir = Path("out") / "demo-logs"
    with contextlib.ExitStack() as stack:
        on_hosts = stack.enter_context(hosts(("p", "d", "r"))) if args.hosts == "netns" else None
        cluster = stack.enter_context(local_cluster(
            args.model, log_dir, router_flags=("--http-port", str(http_port)),
            engine_flags=("--catalog", "shop=builtin") if shop else (), on_hosts=on_hosts))
        http_host = on_hosts["r"].address if on_hosts else "127.0.0.1"
        where = (f"P on {on_hosts['p'].address}, D on {on_hosts['d'].address}, router on "
                 f"{http_host} (separate network namespaces)" if on_hosts else
                 "P, D and router up")
        print(f"{where}; router at {cluster['router']} (gRPC) and "
              f"http://{http_host}:{http_port} (OpenAI-compatible)", flush=True)
        base = f"http://{http_host}:{http_port}"
        prompts = [ex.prompt for ex in examples]
        in_catalog: list = []
        if on_hosts:  # this process cannot reach the router's host: the client runs there
            results = call(on_hosts["r"], _send_all, cluster["router"], prompts, args.beam_width)
            two_calls = call(on_hosts["r"], _two_calls, base, examples[0].prompt,
                             args.beam_width, results[0])
            if shop:
                in_catalog = call(on_hosts["r"], _send_in_catalog, cluster["router"], prompts,
                                  args.beam_width)
        else:
            results = _send_all(cluster["router"], prompts, args.beam_width)
            two_calls = _two_calls(base, examples[0].prompt, args.beam_width, results[0])
            if shop:
                in_catalog = _send_in_catalog(cluster["router"], prompts, args.beam_width)
    transport = _transport_line(log_dir) if on_hosts else None
    print(f"\n{'req':<8}{'stage1':>7}{'parent':>7}{'imported':>9}{'D comp':>7}{'KiB':>6}"
          f"{'first beam ms':>14}  {'top beam':<16}{'rule':<16}{'logp':>8}  verified")
    rows = []
    for i, result in enumerate(results):
        if isinstance(result, str):
            print(f"demo-{i:<3} FAILED: {result}")
            rows.append({"request_id": f"demo-{i}", "verified": False, "error": result})
        else:
            rows.append(_row(i, *result, examples[i], tokenizer, think_end))
    handed = [r for r in rows if "error" not in r and not r["recomputed"]]
    _print_summary(rows, handed)
    catalog = _catalog_summary(results, in_catalog, shop) if shop else None
    # Every request identical, and the handoff itself, not its fallback: every request
    # but one (a first READ can stall past P's lease on a loaded 2-core host; it is
    # recomputed, flagged) went by handoff.
    ok = (all(r["verified"] for r in rows) and len(handed) >= max(1, len(rows) - 1)
          and two_calls["verified"])
    if transport is not None:  # across hosts the KV must have crossed the network
        ok = ok and transport["network"]
    if catalog is not None:  # every beam kept in the catalog is an item, and identical
        ok = ok and catalog["ok"]
    if args.json:
        Path(args.json).write_text(json.dumps({"ok": ok, "requests": rows,
                                               "num_handoff": len(handed),
                                               "two_calls": two_calls,
                                               "hosts": args.hosts or None,
                                               "catalog": catalog,
                                               "transport": transport}, indent=1) + "\n")
    return 0 if ok else 1
