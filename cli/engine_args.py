"""An engine's settings from ``kvhandoff serve``'s flags: what ``EngineConfig`` is
built with (the model resolved, built-in catalogs and adapters written)."""

from __future__ import annotations

import argparse


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``EngineConfig``'s settings from ``kvhandoff serve``'s flags (prefill/decode)."""
    from kvhandoff.model import model_dtype, resolve_model

    model_dir = resolve_model(args.model)
    kwargs = {"model": str(model_dir), "lease_s": args.lease_s,
              "block_size": args.block_size, "max_model_len": args.max_model_len,
              "nixl_progress_thread": args.nixl_progress_delay_us >= 0,
              "nixl_progress_delay_us": max(0, args.nixl_progress_delay_us),
              "side_channel_host": args.side_channel_host,
              "handoff_secret_file": args.handoff_secret_file,
              "kv_events": args.kv_events != "off",
              "kv_events_key_file": args.kv_events_key}
    if args.kv_events not in ("off", "loopback"):
        kwargs["kv_events_host"] = args.kv_events
    if args.max_num_seqs:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.kv_cache_mib:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_mib << 20
    if args.side_channel_port:
        kwargs["side_channel_port"] = args.side_channel_port
    kwargs["ucx_net_devices"] = ucx_net_devices(args.ucx_net_devices, args.side_channel_host)
    if args.load_format:
        kwargs["load_format"] = args.load_format
    # The dtype the model was saved in unless asked (vLLM's "auto" would run float32
    # checkpoints in bfloat16 on CPU).
    kwargs["dtype"] = args.dtype or model_dtype(model_dir)
    if args.fault_injection:
        kwargs["fault_injection"] = True
    if args.catalog:
        from engine.catalog import parse_spec
        from kvhandoff.builtin.generate import builtin_catalog

        kwargs["catalogs"] = tuple(
            (name, str(builtin_catalog(model_dir)) if path == "builtin" else path)
            for name, path in map(parse_spec, args.catalog))
    if args.adapter:
        from engine.catalog import parse_spec
        from kvhandoff.builtin.adapters import resolve

        kwargs["adapters"] = tuple((name, resolve(model_dir, path)) for name, path in
                                   (parse_spec(spec, "--adapter") for spec in args.adapter))
    return kwargs


def check_engine_kwargs(role: str, kwargs: dict) -> None:
    """What the engine would refuse at its start, checked before it starts: the settings
    (``EngineConfig``), every catalog file and every adapter (read and hashed), the KV
    events key. Raises
    ValueError or OSError naming the bad one."""
    from connector.adapters import load_all
    from engine.config import EngineConfig
    from engine.vllm_engine import load_catalogs

    config = EngineConfig(role=role, **kwargs)
    load_catalogs(config)
    load_all(config.adapters)
    if config.kv_events and config.kv_events_key_file:
        from kvhandoff.event_keys import EventKeys

        EventKeys.from_file(config.kv_events_key_file)


def ucx_net_devices(flag: str | None, side_channel_host: str) -> str | None:
    """UCX_NET_DEVICES: as asked ("all": UCX's choice); by default loopback only when
    the side channel is on loopback (one host), else every interface."""
    if flag is None:
        return "lo" if side_channel_host.startswith("127.") else None
    return None if flag == "all" else flag
