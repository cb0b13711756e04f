"""The ``kvhandoff`` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _verify(args: argparse.Namespace) -> int:
    from kvhandoff.harness import main_verify

    return main_verify(args.model, args.quick, args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvhandoff", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("KVHANDOFF_LOG_LEVEL", "WARNING"))
    sub = parser.add_subparsers(dest="command", required=True)

    verify = sub.add_parser(
        "verify", help="prove the P->D handoff gives the same tokens as one engine"
    )
    verify.add_argument("--model", default=None,
                        help="Hugging Face model directory (default: the built-in model)")
    verify.add_argument("--json", default=None, metavar="PATH", help="write the full report here")
    verify.add_argument("--quick", action="store_true", help="a smaller case set")
    verify.set_defaults(func=_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # vLLM's own INFO lines drown the table; keep them unless asked.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", args.log_level.upper())
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
